"""Auditing never changes what training computes: after `audit run T --steps N` the weights equal
those of N plain calls of the step."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES, audit

STEPS = 12
WRAPPER = '''
import importlib, os, sys
sys.path.insert(0, {examples!r})
import torch

trainers = {{name: importlib.import_module(name) for name in {names!r}}}  # (each seeds its own at import)

if os.environ.get("PARITY_INITIAL"):  # (the plain run's weights before its first step)
    for name, trainer in trainers.items():
        torch.save(trainer.model.state_dict(), os.environ["PARITY_INITIAL"].format(name=name))

def step(i):
    for name, trainer in trainers.items():  # each trainer's step in turn, one step of the program
        trainer.step(i)
    if i == {last}:
        for name, trainer in trainers.items():
            torch.save(trainer.model.state_dict(), os.environ["PARITY_OUT"].format(name=name))

if __name__ == "__main__":
    for i in range({steps}):
        step(i)
'''


# The trainers audited together, each group one program whose step runs each trainer's step in turn:
# the audit sees five models, optimizers and habits in one step, and each trainer's weights must
# still be its plain run's. anomaly_mode is a program of its own: it switches anomaly detection on
# for the whole process at import.
GROUPS = {"together": ("clean", "retained_graph", "host_sync", "graph_leak", "forced_cleanup"),
          "anomaly": ("anomaly_mode",)}
NAMES = [name for names in GROUPS.values() for name in names]
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}
PLAIN_ALL = '''
import runpy, sys
for path in sys.argv[1:]:  # each program in turn, plain (anomaly_mode's last: it switches a global on)
    runpy.run_path(path, run_name="__main__")
'''


def wrapper_for(directory, group):
    wrapper = directory / f"parity_{group}.py"
    wrapper.write_text(WRAPPER.format(examples=str(EXAMPLES), names=GROUPS[group], last=STEPS - 1, steps=STEPS))
    return wrapper


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory):
    """The weights after STEPS plain steps of each program, and before the first, for each trainer,
    all programs in one process (each trainer seeds its own model and data at import; one process
    saves a torch start-up per program)."""
    d = tmp_path_factory.mktemp("plain")
    wrappers = [wrapper_for(d, group) for group in GROUPS]
    # the same environment as the audited run (conftest.audit runs it with one intra-op thread):
    # a different thread count changes the order of float reductions, so the bits
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PARITY_OUT": str(d / "{name}.pt"),
           "PARITY_INITIAL": str(d / "{name}-initial.pt")}
    subprocess.run([sys.executable, "-c", PLAIN_ALL, *map(str, wrappers)], check=True, cwd=d,
                   capture_output=True, env=env)
    return {name: (torch.load(d / f"{name}.pt", weights_only=True), torch.load(d / f"{name}-initial.pt", weights_only=True))
            for name in NAMES}


@pytest.fixture(scope="module")
def audited_weights(tmp_path_factory):
    """Each group's program audited once (STEPS steps): each trainer's weights after its last step."""
    done = {}

    def get(name):
        group = GROUP_OF[name]
        if group not in done:
            d = tmp_path_factory.mktemp(f"audited-{group}")
            a = audit("run", f"{wrapper_for(d, group)}:step", "--steps", str(STEPS), "--quiet", out=d / "out",
                      env={"PARITY_OUT": str(d / "{name}.pt")})
            assert a.returncode in (0, 1), a.stderr
            assert len(a.evidence["steps"]) == STEPS
            done[group] = d
        return torch.load(done[group] / f"{name}.pt", weights_only=True)

    return get


@pytest.mark.parametrize("name", NAMES)
def test_audited_weights_equal_plain_weights(plain_weights, audited_weights, name):
    w_plain, w_initial = plain_weights[name]
    w_audit = audited_weights(name)
    assert w_plain.keys() == w_audit.keys()
    for k in w_plain:
        assert torch.equal(w_plain[k], w_audit[k]), k
    # and training moved the weights from where they started, so the comparison means something
    assert any(not torch.equal(w_plain[k], w_initial[k]) for k in w_plain)


COMPILED = '''
import os, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
compiled = torch.compile(model, backend="aot_eager")


@torch.compile(backend="aot_eager")
def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits, y) + 1e-3 * logits.pow(2).mean()


opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))


def step(i):
    loss = loss_fn(compiled(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i == 5:
        torch.save(model.state_dict(), os.environ["PARITY_OUT"])

if __name__ == "__main__":
    for i in range(6):
        step(i)
'''


def test_torch_compile_is_left_to_compile_what_it_would(tmp_path):
    """Under torch.compile the numerics checks step aside: nothing of the auditor's enters the
    compiled graphs (a graph break there made the audited model run eagerly, with other bits),
    and the checks themselves do not fail on the tracer's fake tensors.

    The `aot_eager` backend runs what meets the auditor (dynamo's tracing and AOT autograd's fake
    tensors) without inductor's C++ builds, which took 23 of this test's 42 s; the old failure shows
    under it as well. Inductor itself is run by test_rehearsal's torch.compile test."""
    path = tmp_path / "compiled.py"
    path.write_text(COMPILED)
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    subprocess.run([sys.executable, str(path)], check=True, cwd=tmp_path, capture_output=True,
                   env={**env, "PARITY_OUT": str(tmp_path / "plain.pt")}, timeout=600)
    a = audit("run", f"{path}:step", "--steps", "6", "--no-profile", "--quiet", out=tmp_path / "out",
              env={**env, "PARITY_OUT": str(tmp_path / "audited.pt")}, timeout=600)
    assert a.returncode == 0, a.stderr[-2000:]
    numerics = [s["numerics"] for s in a.evidence["steps"]]
    assert len(numerics) == 6 and not any("collector_error" in n for n in numerics), numerics[0]
    assert all(n["loss_finite"] for n in numerics)  # (the checks ran: the eager loss is seen)
    assert [f["rule"] for f in a.findings if f["severity"] != "info"] == []
    plain, audited = (torch.load(tmp_path / f, weights_only=True) for f in ("plain.pt", "audited.pt"))
    for k in plain:
        assert torch.equal(plain[k], audited[k]), k
    assert "Graph break" not in a.stderr and "does not know how to trace" not in a.stderr


ANNEALED = '''
import torch
from torch import nn

torch.manual_seed(0)


class Quant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, levels):
        return torch.round(x * levels) / levels

    @staticmethod
    def backward(ctx, g):
        return g, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head, self.levels = nn.Linear(8, 16), nn.Linear(16, 2), 8.0

    def forward(self, x):
        return self.head(Quant.apply(self.lin(x), self.levels))


net = Net()
compiled = torch.compile(net, backend="aot_eager")
opt = torch.optim.SGD(net.parameters(), lr=1e-2)
x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))


def step(i):
    net.levels = 8.0 if i < 3 else float(i)  # a float that changes each step: dynamo recompiles once
    loss = nn.functional.cross_entropy(compiled(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_torch_compile_does_not_compile_the_auditors_own_frames(tmp_path):
    """Python that torch.compile runs eagerly (after a graph break) calls the numerics mode for each
    torch call: dynamo must not compile the mode's own frames too (it would recompile them for every
    new float until its recompile limit, fill the user's stderr with recompiles of
    auditor/capture/numerics/, and make steps up to 30x slower). Only the user's function is
    recompiled, as without the audit."""
    path = tmp_path / "annealed.py"
    path.write_text(ANNEALED)
    a = audit("run", f"{path}:step", "--steps", "14", "--no-profile", "--quiet", out=tmp_path / "out",
              env={"TORCH_LOGS": "recompiles"}, timeout=600)
    assert a.returncode == 0, a.stderr[-2000:]
    recompiled = [ln for ln in a.stderr.splitlines() if "Recompiling function" in ln]
    assert recompiled and not [ln for ln in recompiled if "auditor" in ln], recompiled
    assert "recompile_limit" not in a.stderr


COMPILED_STEP = """
import torch
from torch import nn

torch.manual_seed(0)
model, head = nn.Linear(8, 4), nn.Linear(4, 2)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
opt_head = torch.optim.SGD(head.parameters(), lr=1e-2, momentum=0.9)
opt_head.step = torch.compile(opt_head.step, backend="eager")  # the optimizer's step compiled
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
x, y = torch.randn(16, 8), torch.randn(16, 2)
used = []  # per step: the learning rate and gradient norm each update used


@torch.compile(backend="eager")  # a compiled function that calls one
def update():
    opt.step()


def norm(m):
    return torch.cat([p.grad.flatten() for p in m.parameters()]).norm().item()


def step(i):
    loss = nn.functional.mse_loss(head(model(x)), y)
    opt.zero_grad()
    opt_head.zero_grad()
    loss.backward()
    used.append([[opt.param_groups[0]["lr"], norm(model)], [opt_head.param_groups[0]["lr"], norm(head)]])
    update()
    opt_head.step()
    sched.step()


def state():
    return {"model": model.state_dict(), "head": head.state_dict()}


extra = {"used": used}
"""


def user_stderr(text: str) -> list[str]:
    """stderr lines without torch's log prefix (time and process id differ between runs)."""
    return [re.sub(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", "", ln) for ln in text.splitlines()]


def plain_run(d: Path, name: str, steps: int, parity_out: str = "plain.pt") -> str:
    """`steps` plain calls of `name`.step in `d`, saving to d/PARITY_OUT; its stderr."""
    p = subprocess.run([sys.executable, "-c", f"import {name}\nfor i in range({steps}): {name}.step(i)"],
                       cwd=d, capture_output=True, text=True, timeout=600,
                       env={"OMP_NUM_THREADS": "1", **os.environ, "PARITY_OUT": str(d / parity_out)})
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stderr


def assert_same_compiled_run(d: Path, out: Path, a, plain_stderr: str, saved: str = "{}.pt") -> tuple[dict, dict]:
    """The audited run of a compiled program against its plain run: the same stderr, graphs, graph
    breaks and weights. Both runs' dynamo counters, as the program wrote them (to `saved`, its
    weights; with the json of its counters beside: `saved`.json), "{}" plain or audited."""
    assert a.returncode == 0, a.stderr[-2000:]
    assert user_stderr(a.stderr) == user_stderr(plain_stderr), a.stderr[-3000:]
    paths = (d / saved.format("plain"), out / saved.format("audited"))
    plain_stats, audited_stats = (json.loads(Path(f"{p}.json").read_text()) for p in paths)
    keys = ("unique_graphs", "calls_captured", "graph_break")
    assert {k: audited_stats[k] for k in keys} == {k: plain_stats[k] for k in keys}, (plain_stats, audited_stats)
    plain, audited = (torch.load(p, weights_only=True) for p in paths)
    for part in plain:
        for k in plain[part]:
            assert torch.equal(plain[part][k], audited[part][k]), (part, k)
    return plain_stats, audited_stats


@pytest.mark.parametrize("numerics", ["--numerics", "--no-numerics"])
def test_a_compiled_optimizer_step_shows_what_it_shows_without_the_audit(compiled_parts, numerics):
    """torch.compile of an optimizer's step (`opt.step = torch.compile(opt.step)`, or a compiled
    function that calls it) traces the optimizer step hooks torch calls inside it. Traced, the
    auditor's hooks warned to the user's stderr that dynamo 'does not know how to trace the builtin
    time.perf_counter'; run as they are, outside the graph, they were one graph break more (or
    one less, where dynamo gave up on the rest of the step: 1 for the plain run's 3 here). They
    only note the step there now: the stderr, graphs and graph breaks are the plain run's, the
    weights too, and each step's gradient norms and learning rates are read after the compiled
    code, before the scheduler's step: the ones the update used (0.005 from step 2 on)."""
    plain_stats, a = part_run(compiled_parts, "compiled_step", numerics)
    assert plain_stats["unique_graphs"] >= 2 and plain_stats["graph_break"] >= 2  # (both compiled; torch's breaks)
    steps = a.evidence["steps"]
    source = COMPILED_STEP.splitlines()
    # (the user's line of each step: `opt.step()` in update, where dynamo compiles Adam's step on its
    # own after torch's graph break; the compiled method's call)
    calls = {"Adam": source.index("    opt.step()") + 1, "SGD": source.index("    opt_head.step()") + 1}
    tallies = [sorted((t["what"], t["where"]["line"], t["ms"], t["data"])
                      for t in in_file([t for t in s["tallies"] if t["kind"] == "optimizer"], "compiled_step"))
               for s in steps]
    assert tallies == [[("Adam", calls["Adam"], 0.0, {"compiled": True}), ("SGD", calls["SGD"], 0.0, {"compiled": True})]] * 4
    if numerics == "--numerics":
        used = plain_stats["used"]
        assert [u[0][0] for u in used] == [0.01, 0.01, 0.005, 0.005]
        seen = [[(o["lrs"][0], o["grad_norm"], o.get("compiled")) for o in s] for s in opt_steps_in(steps, "compiled_step")]
        assert [[lr for lr, _, _ in s] for s in seen] == [[lr for lr, _ in u] for u in used], seen
        assert [[n for _, n, _ in s] for s in seen] == [[pytest.approx(n, rel=1e-5) for _, n in u] for u in used], seen
        assert all(c for s in seen for _, _, c in s)


FULLGRAPH = """
import torch
from torch import nn


class PlainSGD(torch.optim.Optimizer):  # a step dynamo traces whole, without torch's graph breaks
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


torch.manual_seed(0)
model = nn.Linear(8, 2)
opt = PlainSGD(model.parameters(), lr=1e-2)
x, y = torch.randn(16, 8), torch.randn(16, 2)
norms = []


@torch.compile(backend="eager", fullgraph=True)
def opt_step():
    opt.step()


def step(i):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
    opt_step()
    opt.zero_grad()  # (the gradients go before the step's end)


def state():
    return {"model": model.state_dict()}


extra = {"norms": norms}
"""


@pytest.mark.parametrize("numerics", ["--numerics", "--no-numerics"])
def test_an_optimizer_step_compiled_with_fullgraph_runs_as_without_the_audit(compiled_parts, numerics):
    """A custom optimizer whose step torch.compile traces whole, compiled with fullgraph=True, ran
    in a plain run and died under the audit at step 0 ('Skip inlining `torch.compiler.disable()`d
    function Numerics._opt_pre', exit 3): the auditor's step hooks were a graph break, which
    fullgraph=True refuses. Traced, they note the step: the run completes with the plain run's
    stderr, graph (one, no break) and weights, the step counts as an optimizer phase at the line
    that calls the compiled function, and its gradient norms, cleared by zero_grad before the
    step's end, are read before they go."""
    plain_stats, a = part_run(compiled_parts, "fullgraph_step", numerics)
    assert (plain_stats["unique_graphs"], plain_stats["graph_break"]) == (1, 0)
    steps = a.evidence["steps"]
    line = FULLGRAPH.splitlines().index("    opt_step()") + 1
    assert [[(t["what"], t["where"]["line"], t["count"])
             for t in in_file([t for t in s["tallies"] if t["kind"] == "optimizer"], "fullgraph_step")]
            for s in steps] == [[("PlainSGD", line, 1)]] * 4
    if numerics == "--numerics":
        opt_steps = opt_steps_in(steps, "fullgraph_step")
        assert [[o["lrs"] for o in s] for s in opt_steps] == [[[0.01]]] * 4
        assert [[o["grad_norm"] for o in s] for s in opt_steps] == [[pytest.approx(n, rel=1e-5)] for n in plain_stats["norms"]]
        sites = {int(k): x for s in steps for k, x in s["numerics"].get("sites", {}).items()}
        assert {(sites[o["site"]]["where"]["line"], sites[o["site"]]["op"]) for s in opt_steps for o in s} == \
            {(line, "optimizer.step")}


COMPILED_MODEL = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
cnet = torch.compile(net, backend="eager")  # a compiled model
opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
x, y = torch.randn(16, 8), torch.randn(16, 2)


@torch.compile(backend="eager")  # a compiled function whose backward pass breaks its graph
def backward(loss):
    loss.backward()


def step(i):
    loss = nn.functional.mse_loss(cnet(x), y)
    backward(loss)
    opt.step()
    opt.zero_grad()


def state():
    return {"net": net.state_dict()}


extra = {}
"""


PARTS = {"compiled_step": COMPILED_STEP, "fullgraph_step": FULLGRAPH, "compiled_model": COMPILED_MODEL}
COMPILED_PARTS = """
import json, os
import torch
from torch._dynamo.utils import counters
import compiled_step, fullgraph_step, compiled_model

# three compiled programs, one step of each in turn a step of this one: each one's dynamo counters
# are what its own calls added, the process's are written too
PARTS = {"compiled_step": compiled_step, "fullgraph_step": fullgraph_step, "compiled_model": compiled_model}
added = {name: {"unique_graphs": 0, "calls_captured": 0, "graph_break": 0} for name in PARTS}


def counts():
    return {"unique_graphs": counters["stats"]["unique_graphs"], "calls_captured": counters["stats"]["calls_captured"],
            "graph_break": sum(counters["graph_break"].values())}


def step(i):
    for name, part in PARTS.items():
        before = counts()
        part.step(i)
        for k, n in counts().items():
            added[name][k] += n - before[k]
        if i == 3:
            with open(f"{os.environ['PARITY_OUT']}-{name}.pt.json", "w") as f:
                json.dump({**added[name], **part.extra}, f)
            torch.save(part.state(), f"{os.environ['PARITY_OUT']}-{name}.pt")
    if i == 3:
        with open(f"{os.environ['PARITY_OUT']}-process.pt.json", "w") as f:
            json.dump(counts(), f)
"""


@pytest.fixture(scope="module")
def compiled_parts(tmp_path_factory):
    """COMPILED_STEP, FULLGRAPH and COMPILED_MODEL, each a module of its own, run as one program
    (4 steps): its plain run's stderr, and its audit with --numerics or --no-numerics (each run
    once, for the three tests that read it). The three programs share no model, optimizer or
    compiled function; each test reads its own program's counters, weights and tallies (by file),
    and the stderr and the process's counters are the whole program's."""
    d = tmp_path_factory.mktemp("compiled_parts")
    for name, source in PARTS.items():
        (d / f"{name}.py").write_text(source)
    (d / "compiled_parts.py").write_text(COMPILED_PARTS)
    plain_stderr = plain_run(d, "compiled_parts", 4, parity_out="plain")
    done = {}

    def audited(numerics: str):
        out = d / f"out{numerics}"
        if numerics not in done:
            done[numerics] = audit(
                "run", f"{d / 'compiled_parts.py'}:step", "--steps", "4", "--quiet", "--no-profile", numerics,
                out=out, cwd=d, env={"OMP_NUM_THREADS": "1", "PARITY_OUT": str(out / "audited")}, timeout=600)
        return done[numerics], out

    return d, plain_stderr, audited


def part_run(compiled_parts, name: str, numerics: str):
    """`name`'s part of the audited program against its plain run (assert_same_compiled_run), the
    process's counters the plain run's too; its plain counters and the audit."""
    d, plain_stderr, audited = compiled_parts
    a, out = audited(numerics)
    plain_stats, _ = assert_same_compiled_run(d, out, a, plain_stderr, saved="{}-%s.pt" % name)
    plain_total, audited_total = (json.loads((p / f"{w}-process.pt.json").read_text())
                                  for p, w in ((d, "plain"), (out, "audited")))
    # (the whole process: what the auditor's own code compiled, between the parts or the steps, shows here)
    assert audited_total == plain_total, (plain_total, audited_total)
    return plain_stats, a


def in_file(records: list[dict], name: str) -> list[dict]:
    """The records of `name`'s part (by the file their `where` names); every record names one of
    the parts' files (none the wrapper's, none without a place)."""
    files = [r["where"] and os.path.basename(r["where"]["file"]) for r in records]
    assert not [f for f in files if f not in {f"{p}.py" for p in PARTS}], files
    return [r for r, f in zip(records, files) if f == f"{name}.py"]


def opt_steps_in(steps: list[dict], name: str) -> list[list[dict]]:
    """Each step's numerics records of optimizer steps in `name`'s part, by the file of the site
    each names (in_file: every one names a site in one of the parts' files)."""
    sites = {k: x for s in steps for k, x in s["numerics"].get("sites", {}).items()}
    return [in_file([{**o, "where": sites[str(o["site"])]["where"]} for o in s["numerics"]["opt_steps"]], name)
            for s in steps]


@pytest.mark.parametrize("numerics", ["--numerics", "--no-numerics"])
def test_the_probes_leave_compiled_code_as_it_is(compiled_parts, numerics):
    """torch.compile traces the probes it reaches: the phase hooks (--no-numerics) in a compiled
    model's submodules, the backward probe where a compiled function calls loss.backward(). Their
    timers and frame reads were graph breaks in the user's graph, with warnings that dynamo 'does
    not know how to trace the builtin time.perf_counter' and 'sys._getframe', a timer's value a
    guard that recompiled the model, the auditor's arithmetic captured in it, and the auditor's
    frames run after a break compiled too (--no-numerics: 9 graph breaks, 6 calls captured, 3
    graphs for the plain run's 1, 3, 1). Compiling, a probe is the call it wraps now, and the
    calls that run as they are are recorded there: the model's forward at its compiled module's
    call, the backward pass in the compiled function."""
    plain_stats, a = part_run(compiled_parts, "compiled_model", numerics)
    assert (plain_stats["unique_graphs"], plain_stats["graph_break"]) == (1, 1)
    source = COMPILED_MODEL.splitlines()
    lines = {"forward": source.index("    loss = nn.functional.mse_loss(cnet(x), y)") + 1,
             "backward": source.index("    loss.backward()") + 1}
    assert [sorted((t["kind"], t["what"], t["where"]["line"], t["count"])
                   for t in in_file([t for t in s["tallies"] if t["kind"] in ("forward", "backward")], "compiled_model"))
            for s in a.evidence["steps"]] == \
        [[("backward", "Tensor.backward", lines["backward"], 1), ("forward", "OptimizedModule", lines["forward"], 1)]] * 4



COMPILED_UNDER_THE_MODE = """
import json, os
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return 0.37 / (self.lin(x).abs() + 1.3)  # (Tensor.__rtruediv__: reciprocal * 0.37 in Python)


net, head = Net(), nn.Linear(4, 1)
cnet = torch.compile(net, backend="eager")  # a compiled model
opt = torch.optim.SGD([*net.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
x, y = torch.randn(16, 8), torch.randn(16, 1)
losses = []


@torch.compile(backend="eager")  # a compiled function: its backward pass and .item() break its graph
def train(h):
    loss = nn.functional.mse_loss(head(h), y)
    loss.backward()
    losses.append(loss.item())
    return loss


def step(i):
    opt.zero_grad()
    train(cnet(x))
    opt.step()
    if i == 3:
        from torch._dynamo.utils import counters
        with open(os.environ["PARITY_OUT"] + ".json", "w") as f:
            json.dump({**counters["stats"], "graph_break": sum(counters["graph_break"].values()), "losses": losses}, f)
        torch.save({"net": net.state_dict(), "head": head.state_dict()}, os.environ["PARITY_OUT"])


step(-1)  # a warm-up step at import: both compiled before the audit's first step
"""


@pytest.fixture(scope="module")
def under_mode_plain(tmp_path_factory):
    d = tmp_path_factory.mktemp("under_mode")
    (d / "under_mode.py").write_text(COMPILED_UNDER_THE_MODE)
    return d, plain_run(d, "under_mode", 4)


def test_compiled_code_is_traced_as_in_a_plain_run_under_the_numerics_checks(under_mode_plain):
    """The numerics checks' torch-function mode is on the stack for the whole step, and dynamo
    traced the user's compiled code through it: the graphs were made of the calls the mode passes
    on (`0.37 / t` as `t.reciprocal() * 0.37`: one call more captured per compile), `.item()` in a
    compiled function warned that dynamo 'does not know how to trace the builtin
    TensorBase.item' where the plain run says 'Graph break from `Tensor.item()`', and what was
    compiled at import (no mode there) failed its mode-stack guard in the steps and was compiled
    again (more graph breaks). The mode is off the stack for each call of compiled code now: the
    same graphs, graph breaks, stderr and weights as the plain run. The checks that need no mode
    still run: the loss of the backward pass inside the compiled function (its values are the
    plain run's), and each compiled call is checked as one call at the user's line."""
    d, plain_stderr = under_mode_plain
    out = d / "out"
    a = audit("run", f"{d / 'under_mode.py'}:step", "--steps", "4", "--quiet", "--no-profile", "--numerics",
              out=out, cwd=d, env={"OMP_NUM_THREADS": "1", "PARITY_OUT": str(out / "audited.pt")}, timeout=600)
    plain_stats, audited_stats = assert_same_compiled_run(d, out, a, plain_stderr)
    assert "Graph break from `Tensor.item()`" in plain_stderr
    assert plain_stats["graph_break"] > 0 and plain_stats["calls_captured"] > 0
    numerics = [s["numerics"] for s in a.evidence["steps"]]
    assert [n["loss"] for n in numerics] == pytest.approx(plain_stats["losses"][1:], rel=1e-6)
    assert all(n["loss_finite"] and n["backward"] == 1 for n in numerics), numerics[0]
    assert a.rule("nonfinite") == []
    source = (d / "under_mode.py").read_text().splitlines()
    line = source.index("    train(cnet(x))") + 1
    sites = {int(k): v for n in numerics for k, v in n.get("sites", {}).items()}
    compiled = sorted((v["op"], v["where"]["line"]) for v in sites.values() if v["op"].startswith("torch.compile("))
    assert compiled == [("torch.compile(Net)", line), ("torch.compile(train)", line)], sites


COUNTED = '''
import contextlib, json, os
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext


class Counting(TorchFunctionMode):  # the user's own op counter
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


MODE = os.environ["MODE"]
COUNTER = None
if MODE == "import":  # entered once, at import (below the auditor's numerics mode, pushed per step)
    COUNTER = Counting().__enter__()
elif MODE == "default-device":  # torch's own mode, pushed by set_default_device: its calls counted
    COUNTER = Counting()
    passed_on = DeviceContext.__torch_function__

    def counted(self, func, types, args=(), kwargs=None):
        COUNTER.n += 1
        return passed_on(self, func, types, args, kwargs)

    DeviceContext.__torch_function__ = counted
    torch.set_default_device("cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 16)
counts, losses = [], []


def step(i):
    counter = COUNTER or Counting()  # (MODE "step": a mode entered in the step, above the auditor's)
    before = counter.n
    with contextlib.nullcontext() if COUNTER else counter:
        h = torch.tanh(model[0](x) @ torch.ones(32, 32) / 32)  # the user's own calls, a factory among them
        loss = model[2](model[1](h)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    counts.append(counter.n - before)
    if i == 5:
        with open(os.environ["COUNTS_OUT"], "w") as f:
            json.dump({"counts": counts, "losses": losses}, f)
'''


@pytest.mark.parametrize("mode", ["step", "import", "default-device"])
def test_the_users_torch_function_mode_does_not_see_the_auditors_calls(tmp_path, mode):
    """A TorchFunctionMode of the user's (an op counter, a tracer) counts the same calls audited as
    in a plain run, wherever it sits on the mode stack: the auditor's own torch calls and reads
    (the numerics checks' ranges, `item`s and dtype reads, a probe's read of a tensor's device, grad
    mode switches) run with torch-function dispatch off. Entered in the step it is above the
    auditor's numerics mode: it saw 1 more call a step (the probe of `loss.item()` read its device).
    Entered once at import it is below that mode, and saw the mode's bookkeeping too: 98 more a
    step (90 in the plain run). torch.set_default_device pushes a mode of torch's own (a
    DeviceContext) at the bottom of the stack, which saw the same 98, each a Python call: the
    checks cost about 2.5x as much with it. The user's own calls, the factory in the step among
    them, still reach it (the default device is theirs), exactly as in a plain run, and the losses
    are the plain run's."""
    trainer = tmp_path / "counted.py"
    trainer.write_text(COUNTED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COUNTS_OUT": str(tmp_path / "plain.json"), "MODE": mode}
    subprocess.run([sys.executable, "-c", "import counted\nfor i in range(6): counted.step(i)"],
                   cwd=tmp_path, env=env, check=True)
    # (--no-profile: in a profiled step torch's optimizer opens record_function ranges of its own,
    # which the mode sees as in any profiled run)
    a = audit("run", f"{trainer}:step", "--steps", "6", "--quiet", "--no-profile", out=tmp_path / "out",
              env={"COUNTS_OUT": str(tmp_path / "audited.json"), "MODE": mode})
    assert a.returncode == 0, a.stderr
    plain = json.loads((tmp_path / "plain.json").read_text())
    audited = json.loads((tmp_path / "audited.json").read_text())
    assert audited["counts"] == plain["counts"], (plain["counts"], audited["counts"])
    assert audited["losses"] == plain["losses"]
    # (and the checks ran: every step's loss and gradient norms were seen)
    numerics = [s["numerics"] for s in a.evidence["steps"]]
    assert all(n["loss_finite"] and n["opt_steps"][0]["grad_norm"] > 0 for n in numerics), numerics[0]
