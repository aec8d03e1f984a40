"""Module state that keeps tensors inside rows: a replay buffer is a list (or deque) of tuples,
dicts or small objects, not of bare tensors. graph-leak and memory-growth see through the rows."""
from __future__ import annotations

from conftest import audit

REPLAY = '''
from collections import deque
from dataclasses import dataclass
import torch
from torch import nn

torch.manual_seed(0)
policy = nn.Linear(16, 4)
opt = torch.optim.SGD(policy.parameters(), lr=1e-3)
tuples, dicts, objects = [], deque(), []


@dataclass
class Transition:
    obs: torch.Tensor
    logp: torch.Tensor
    reward: float


def step(i):
    obs = torch.randn(80, 64, 64)  # a frame: 1.25 MiB
    logp = policy(obs.mean(0)[:, :16]).log_softmax(-1)[:, 0]  # carries the graph
    tuples.append((obs, logp, 1.0))  # TUPLE LINE: never evicted, graph kept
    dicts.append({"obs": obs.clone(), "logp": logp, "reward": 1.0})  # DICT LINE
    objects.append(Transition(obs.clone(), logp, 1.0))  # OBJECT LINE
    loss = -logp.mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_replay_buffers_of_rows_are_seen(tmp_path):
    path = tmp_path / "rl.py"
    path.write_text(REPLAY)
    a = audit("run", f"{path}:step", "--steps", "20", "--quiet", "--no-profile", "--no-numerics", out=tmp_path / "out",
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-2000:]
    lines = {n for n, text in enumerate(REPLAY.splitlines(), 1) if "LINE" in text}
    [leak] = a.rule("graph-leak")
    assert {h["name"] for h in leak["evidence"]["holders"]} == {"tuples", "dicts", "objects"}, leak["message"]
    assert {(loc["file"], loc["line"]) for loc in leak["locations"]} == {(str(path), n) for n in lines}
    # no patch: `.detach()` on a row would fail (a tuple has none; its float neither)
    assert leak["fix"]["patch"] is None
    [growth] = a.rule("memory-growth")
    held = {h["name"]: h for h in growth["evidence"]["holders"]}
    assert set(held) == {"tuples", "dicts", "objects"}
    frame = 80 * 64 * 64 * 4
    for h in held.values():  # a frame a step each, between the scans at steps 1 and 19
        assert h["tensors"] == 40 and 18 * frame <= h["growth_bytes"] < 18 * frame + 2**16, h


TOTALS = '''
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
stats = {"loss": 0.0}


class Trainer:
    def __init__(self):
        self.stats = {"loss": 0.0}


t = Trainer()


def reset():
    stats["loss"] = 0.0  # a store, not the leak


def loss_of_batch():
    x = torch.randn(32, 16)
    return nn.functional.mse_loss(model(x), x[:, :1])


def step(i):
    loss = loss_of_batch()
    stats["loss"] += loss  # DICT LINE: kept as a tensor, graph and all
    opt.zero_grad()
    loss.backward()
    opt.step()


def step_summed(i):
    loss = loss_of_batch()
    t.stats["loss"] = t.stats["loss"] + loss  # SUM LINE
    opt.zero_grad()
    loss.backward()
    opt.step()


def step_attr(i):
    loss = loss_of_batch()
    t.stats["loss"] += loss  # ATTR LINE
    opt.zero_grad()
    loss.backward()
    opt.step()


history = {"loss": []}


def step_listed(i):
    loss = loss_of_batch()
    history["loss"].append(loss)  # LIST LINE
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_running_totals_in_a_dict_are_located_and_patched(tmp_path):
    """`stats["loss"] += loss` (a dict entry, global or an object's attribute) is the holder's
    growing line, and `x = x + loss` or `history["loss"].append(loss)` on such an entry too; each is patched `loss.detach()` in
    fixes.patch (a running total: its value is unchanged). Before, the `+=` on an entry was not seen
    (no line, no patch, or another function's line), and `x = x + loss` went to numerics-fixes.patch
    as if it cut a recurrent state. Where the file holds several such lines, the step's own comes
    first, and a plain store (a reset) last."""
    path = tmp_path / "totals.py"
    path.write_text(TOTALS)
    source = TOTALS.splitlines()
    for fn, marker, holder in (("step", "DICT LINE", "stats"), ("step_summed", "SUM LINE", "t.stats"),
                               ("step_attr", "ATTR LINE", "t.stats"), ("step_listed", "LIST LINE", "history")):
        a = audit("run", f"{path}:{fn}", "--steps", "8", "--quiet", "--no-profile", "--no-numerics",
                  out=tmp_path / f"out-{fn}")
        assert a.returncode == 0, a.stderr[-2000:]
        [leak] = a.rule("graph-leak")
        assert [h["name"] for h in leak["evidence"]["holders"]] == [holder], leak["message"]
        line = next(n for n, text in enumerate(source, 1) if marker in text)
        assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)], fn
        [edit] = leak["fix"]["edits"]
        assert edit["lines"] == [source[line - 1].replace("+ loss", "+ loss.detach()")
                                 .replace("+= loss", "+= loss.detach()").replace("(loss)", "(loss.detach())")]
        assert leak["fix"]["changes_numerics"] is False
        assert f"+{edit['lines'][0]}" in (tmp_path / f"out-{fn}" / "fixes.patch").read_text()


CELL_NOT_DETACHED = '''
import torch
from torch import nn

torch.manual_seed(0)
lstm = nn.LSTM(8, 16, batch_first=True)
head = nn.Linear(16, 1)
opt = torch.optim.SGD([*lstm.parameters(), *head.parameters()], lr=1e-2)
state = None


def step(i):
    global state
    if state is not None:
        state = (state[0].detach(), state[1]{detach_c})  # STATE LINE: c is carried on
    y, state = lstm(torch.randn(4, 5, 8), state)
    loss = head(y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_a_state_carried_into_a_freed_graph_is_named_when_backward_fails(tmp_path):
    """Truncated BPTT that detaches h but not the LSTM's cell state c: step 1's backward reaches
    step 0's graph, already freed, and raises "Trying to backward through the graph a second
    time". The run had no finding (one graph scan, after the failure, where two are needed to see
    growth). The error is proof enough: the state holding a graph is named at the first line of
    the step that assigns it from itself, with no patch (a tuple has no .detach()). Detached
    whole, the run is clean."""
    path = tmp_path / "tbptt.py"
    path.write_text(CELL_NOT_DETACHED.format(detach_c=""))
    a = audit("run", f"{path}:step", "--steps", "6", "--quiet", "--no-profile", "--no-numerics", out=tmp_path / "out")
    assert a.returncode == 3 and a.evidence["ending"]["step"] == 1, a.stderr
    [leak] = a.rule("graph-leak")
    line = next(n for n, t in enumerate(CELL_NOT_DETACHED.splitlines(), 1) if "STATE LINE" in t)
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)]
    assert "Step 1's backward ran into a graph" in leak["message"] and "`state` carries" in leak["message"]
    [held] = leak["evidence"]["holders"]
    assert held["name"] == "state" and held["graph_tensors"] == 2  # step 1's (h, c): c's history reaches step 0
    assert leak["fix"]["edits"] == [] and "detach both h and c" in leak["fix"]["summary"]
    path.write_text(CELL_NOT_DETACHED.format(detach_c=".detach()"))
    b = audit("run", f"{path}:step", "--steps", "6", "--quiet", "--no-profile", "--no-numerics", out=tmp_path / "ok")
    assert b.returncode == 0 and not b.rule("graph-leak"), [f["message"] for f in b.findings]
