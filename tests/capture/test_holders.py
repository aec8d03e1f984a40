"""Module state that keeps tensors inside rows: a replay buffer is a list (or deque) of tuples,
dicts or small objects, not of bare tensors. graph-leak and memory-growth see through the rows."""
from __future__ import annotations

import subprocess

from conftest import audit, patch_text

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
    # each row's graph is its log-prob: that item alone is detached (a tuple has no `.detach()`, nor its float)
    source = REPLAY.splitlines()
    assert sorted(e["lines"][0] for e in leak["fix"]["edits"]) == sorted(
        source[n - 1].replace(" logp,", " logp.detach(),") for n in lines)
    rows = {h["name"]: h["rows"] for h in leak["evidence"]["holders"]}
    assert rows["tuples"]["graph"] == [1] and rows["dicts"]["graph"] == ["logp"] and rows["objects"]["graph"] == ["logp"]
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
    t.stats["loss"] = t.stats["loss"] + loss  # SUM LINE
    history["loss"].append(loss)  # LIST LINE
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
'''


def test_running_totals_in_a_dict_are_located_and_patched(tmp_path):
    """`stats["loss"] += loss` (a dict entry, global or an object's attribute) is the holder's
    growing line, and `x = x + loss` or `history["loss"].append(loss)` on such an entry too; each is patched `loss.detach()` in
    fixes.patch (a running total: its value is unchanged). Before, the `+=` on an entry was not seen
    (no line, no patch, or another function's line), and `x = x + loss` was marked as changing
    results as if it cut a recurrent state. Where the file holds several such lines, the step's own comes
    first, and a plain store (a reset) last: `t.stats` grows at SUM LINE in `step` and at ATTR
    LINE in `step_attr`, each audited (each holder of `step` at its own line, in one run)."""
    path = tmp_path / "totals.py"
    path.write_text(TOTALS)
    source = TOTALS.splitlines()
    for fn, holders in (("step", {"stats": "DICT LINE", "t.stats": "SUM LINE", "history": "LIST LINE"}),
                        ("step_attr", {"t.stats": "ATTR LINE"})):
        a = audit("run", f"{path}:{fn}", "--steps", "8", "--quiet", "--no-profile", "--no-numerics",
                  out=tmp_path / f"out-{fn}")
        assert a.returncode == 0, a.stderr[-2000:]
        [leak] = a.rule("graph-leak")
        names = [h["name"] for h in leak["evidence"]["holders"]]
        assert sorted(names) == sorted(holders), leak["message"]
        lines = {name: next(n for n, text in enumerate(source, 1) if marker in text) for name, marker in holders.items()}
        # (one location per holder, in the holders' order)
        assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), lines[n]) for n in names], fn
        edits = sorted((e["start"], e["end"], e["lines"]) for e in leak["fix"]["edits"])
        assert edits == sorted((n, n, [source[n - 1].replace("+ loss", "+ loss.detach()").replace(
            "+= loss", "+= loss.detach()").replace("(loss)", "(loss.detach())")]) for n in lines.values()), fn
        assert leak["fix"]["changes_numerics"] is False
        for _, _, edit in edits:
            assert f"+{edit[0]}" in patch_text(tmp_path / f"out-{fn}" / "fixes.patch")


PUSHED = '''
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=1e-2)


class Buffer:
    def __init__(self):
        self.items = []

    def push(self, s, a, r, value):
        self.items.append((s, a, r, value))  # TUPLE LINE: value carries a graph


class Log:
    def __init__(self):
        self.items = []

    def push_dict(self, s, value):
        self.items.append({"s": s,
                           "v": value, "r": 1.0})  # (DICT LINE, one above)


# the twins: each row as fixes.patch stores it (test_a_row_pushed_into_a_buffer_has_its_graph_item_detached)
class TwinBuffer:
    def __init__(self):
        self.items = []

    def push(self, s, a, r, value):
        self.items.append((s, a, r, value.detach()))  # TWIN TUPLE LINE: value carries a graph


class TwinLog:
    def __init__(self):
        self.items = []

    def push_dict(self, s, value):
        self.items.append({"s": s,
                           "v": value.detach(), "r": 1.0})  # (TWIN DICT LINE, one above)


buf, log = Buffer(), Log()
twin_buf, twin_log = TwinBuffer(), TwinLog()


def step(i):
    s = torch.randn(16, 8)
    value = model(s).max()
    buf.push(s, i % 4, 1.0, value)
    log.push_dict(s, value * 2)
    twin_buf.push(s, i % 4, 1.0, value)
    twin_log.push_dict(s, value * 2)
    loss = (value - 1.0) ** 2
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_a_row_pushed_into_a_buffer_has_its_graph_item_detached(tmp_path):
    """`self.items.append((s, a, r, value))` in a buffer's `push`: the scan records which item of
    the rows carries the graph (position 3; key "v" of a dict row), and the patch detaches that item
    alone at the growing line, in fixes.patch (a detached copy stores the same values). Before, the
    holder and line were named with no patch. The patch applies with `git apply`, and the patched
    lines, pushing rows into twin buffers in the same run, keep no graph: graph-leak names neither
    twin, nor their lines."""
    repo = tmp_path / "repo"
    repo.mkdir()
    path = repo / "buffer.py"
    path.write_text(PUSHED)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "trainer"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    a = audit("run", "buffer.py:step", "--steps", "12", "--quiet", "--no-profile", "--no-numerics",
              out=tmp_path / "before", cwd=repo)
    assert a.returncode == 0, a.stderr[-2000:]
    [leak] = a.rule("graph-leak")
    held = {h["name"]: h for h in leak["evidence"]["holders"]}
    assert set(held) == {"buf.items", "log.items"}, leak["message"]
    source = PUSHED.splitlines()

    def at(marker: str) -> int:
        return next(n for n, text in enumerate(source, 1) if marker in text)

    tuple_line, dict_line = at("# TUPLE LINE"), at("# (DICT LINE") - 1
    assert sorted((loc["file"], loc["line"]) for loc in leak["locations"]) == [(str(path), tuple_line),
                                                                               (str(path), dict_line)]
    edits = sorted((e["start"], e["end"], e["lines"]) for e in leak["fix"]["edits"])
    assert edits == [(tuple_line, tuple_line, [source[tuple_line - 1].replace("value)", "value.detach())")]),
                     (dict_line, dict_line + 1, [source[dict_line - 1],
                                                 source[dict_line].replace('"v": value', '"v": value.detach()')])]
    assert leak["fix"]["changes_numerics"] is False
    assert held["buf.items"]["rows"]["graph"] == [3] and held["log.items"]["rows"]["graph"] == ["v"]
    # the twins' lines are the patched lines, and the run's scans saw them keep no graph
    twin_tuple, twin_dict = at("TWIN TUPLE LINE"), at("TWIN DICT LINE") - 1
    assert edits[0][2] == [source[twin_tuple - 1].replace("TWIN TUPLE", "TUPLE")]
    assert edits[1][2] == [source[twin_dict - 1], source[twin_dict].replace("TWIN DICT", "DICT")]
    twins = [h for s in a.evidence["graph_scans"] for h in s["holders"] if h["name"] in ("twin_buf.items", "twin_log.items")]
    assert {h["name"] for h in twins} == {"twin_buf.items", "twin_log.items"}
    assert all(h["nodes"] == 0 for h in twins), twins
    patch = tmp_path / "before" / "fixes.patch"
    assert "value.detach()" in patch.read_text() and "[changes results" not in patch.read_text()
    subprocess.run(["git", "apply", "--check", str(patch)], cwd=repo, check=True)
    subprocess.run(["git", "apply", str(patch)], cwd=repo, check=True)
    patched = path.read_text().splitlines()
    assert patched[tuple_line - 1] == edits[0][2][0] and patched[dict_line - 1:dict_line + 1] == edits[1][2]


EPISODES = '''
import torch
from torch import nn

torch.manual_seed(0)
policy = nn.Linear(8, 4)
opt = torch.optim.SGD(policy.parameters(), lr=1e-2)


class Buffer:
    def __init__(self):
        self.items = []

    def push(self, obs, reward, logp):
        self.items.append((obs, reward, logp))  # ROW LINE


buf = Buffer()
logps = []


def step(i):
    obs = torch.randn(8)
    logp = policy(obs).log_softmax(-1)[i % 4]
    buf.push(obs, float(i % 3), logp)
    logps.append(logp)  # LIST LINE
    if (i + 1) % 4 == 0:  # an episode ends: REINFORCE over its rows, kept afterwards as history
        loss = -sum(r * lp for _, r, lp in buf.items[-4:]) - 0.1 * torch.stack(logps[-4:]).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def test_stored_graphs_a_later_backward_uses_get_no_patch(tmp_path):
    """Rows (and a list of log-probs) kept for the whole run, whose last episode a backward runs
    through at the episode's end: the graphs pile up, but they are kept to be used, and a
    `.detach()` where they are stored would leave that loss with no graph. So graph-leak names both
    holders at their lines and offers no patch, and says why. Before, the list was patched with
    `logps.append(logp.detach())` in fixes.patch, which breaks the training."""
    path = tmp_path / "episodes.py"
    path.write_text(EPISODES)
    a = audit("run", f"{path}:step", "--steps", "12", "--quiet", "--no-profile", "--no-numerics",
              out=tmp_path / "out")
    assert a.returncode == 0, a.stderr[-2000:]
    [leak] = a.rule("graph-leak")
    held = {h["name"]: h for h in leak["evidence"]["holders"]}
    assert set(held) == {"buf.items", "logps"}, leak["message"]
    lines = {n for n, text in enumerate(EPISODES.splitlines(), 1) if "ROW LINE" in text or "LIST LINE" in text}
    assert {(loc["file"], loc["line"]) for loc in leak["locations"]} == {(str(path), n) for n in lines}
    assert not (tmp_path / "out" / "fixes.patch").exists()
    assert leak["fix"]["edits"] == [] and leak["fix"]["patch"] is None
    assert "a later backward ran through what `buf.items`, `logps` keep" in leak["fix"]["summary"]
    assert all(h["backpropagated"] for h in held.values()) and held["buf.items"]["rows"]["graph"] == [2]


def test_how_a_pushed_row_is_matched_to_its_graph_items(tmp_path):
    """The row as spelled at the growing line is matched to where the scan saw its graphs; where
    the spelling cannot be matched (a `*rest`, another length, a key only `**extra` may hold, a
    graph nested in an item, a row pushed by name), no patch rather than a wrong one."""
    from auditor.rules.graph_leak import _detach_edit

    tup = {"kind": "tuple", "class": None, "size": 3, "fields": None, "graph": [2], "nested": False}
    named = {"kind": "tuple", "class": "T", "size": 3, "fields": ["s", "r", "v"], "graph": [2], "nested": False}
    dc = {"kind": "object", "class": "Row", "size": None, "fields": ["s", "v"], "graph": ["v"], "nested": False}
    dct = {"kind": "dict", "class": None, "size": None, "fields": None, "graph": ["v"], "nested": False}
    cases = [
        ("xs.append((s, r, v))", tup, ["xs.append((s, r, v.detach()))"]),
        ("xs.append([s, r, a + b])", tup, ["xs.append([s, r, (a + b).detach()])"]),
        ("xs.insert(0, (s, r, v))", tup, ["xs.insert(0, (s, r, v.detach()))"]),
        ("cache[i] = (s, r, v)", tup, ["cache[i] = (s, r, v.detach())"]),
        ("xs.append((s, *rest))", tup, None),
        ("xs.append((s, v))", tup, None),
        ("xs.append(row)", tup, None),
        ("xs.append((s, r, v))", {**tup, "nested": True}, None),
        ("xs.append(T(s, r, v))", named, ["xs.append(T(s, r, v.detach()))"]),
        ("xs.append(T(s, r=r, v=v))", named, ["xs.append(T(s, r=r, v=v.detach()))"]),
        ("xs.append(U(s, r, v))", named, None),
        ("xs.append(Row(s, v))", dc, ["xs.append(Row(s, v.detach()))"]),
        ("xs.append({'s': s, 'v': v})", dct, ["xs.append({'s': s, 'v': v.detach()})"]),
        ("xs.append({'s': s, **extra})", dct, None),
        ("xs.append({'s': s,\n               'v': v})", dct, ["xs.append({'s': s,", "           'v': v.detach()})"]),
    ]
    for i, (code, rows, want) in enumerate(cases):
        path = tmp_path / f"m{i}.py"
        path.write_text(f"def step():\n    {code}\n")
        edit, numerics = _detach_edit(str(path), 2, rows)
        got = [ln[4:] for ln in edit.lines] if edit else None
        assert got == want and numerics is False, (code, got)


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

