"""State kept inside an nn.Module is module state: a buffer updated in `forward` outside
`torch.no_grad()` keeps a graph per step, and a queue kept as a buffer and never trimmed grows
without bound. graph-leak and memory-growth walk the modules reachable from the target's globals,
name the holder by its module path (`model.1.rm`) and point at the line of its class that grows it.
Parameters are leaves, and no holders, until an in-place update outside `torch.no_grad()` gives
them a history (a hand-written EMA)."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from conftest import audit, patch_text

BN = '''
import torch
from torch import nn

torch.manual_seed(0)


class MyBN(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.register_buffer("rm", torch.zeros(c))
        self.w = nn.Parameter(torch.ones(c))

    def forward(self, x):
        if self.training:
            m = x.mean(0)
{update}
        else:
            m = self.rm
        return (x - m) * self.w


model = nn.Sequential(nn.Linear(16, 64), MyBN(64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)


def step(i):
    x = torch.randn(32, 16, generator=g)
    loss = nn.functional.mse_loss(model(x), x[:, :1])
    opt.zero_grad(); loss.backward(); opt.step()
'''
LEAKY = "            self.rm = 0.9 * self.rm + 0.1 * m  # UPDATE LINE: no torch.no_grad, no detach"
CLEAN = ("            with torch.no_grad():\n"
         "                self.rm = 0.9 * self.rm + 0.1 * m  # UPDATE LINE")

QUEUE = '''
import torch
from torch import nn

torch.manual_seed(0)


class Queue(nn.Module):
    """MoCo-style: this step's keys join a queue of negatives kept as a buffer."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("queue", torch.zeros(0, d))
        self.seen = []  # a plain attribute: a list of tensors

    def forward(self, x):
        k = self.lin(x)
        with torch.no_grad():
            self.queue = torch.cat([self.queue, k.detach()]){trim}  # QUEUE LINE
            self.seen.append(k.detach()[:1]){pop}  # SEEN LINE
        return k


model = nn.Sequential(nn.Linear(16, 256), Queue(256), nn.Linear(256, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)


def step(i):
    x = torch.randn(256, 16, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
'''


def _line(source: str, marker: str) -> int:
    return next(n for n, text in enumerate(source.splitlines(), 1) if marker in text)


def _run(tmp_path, source: str, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    a = audit("run", f"{path}:step", "--steps", "30", "--quiet", "--no-profile", "--no-numerics",
              out=tmp_path / f"out-{name}", env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-2000:]
    return path, a


def _holder_names(a) -> set[str]:
    return {h["name"] for s in a.evidence["graph_scans"] for h in s["holders"]}


def test_a_buffer_updated_with_grad_is_named_at_its_line(tmp_path):
    """The running mean assigned from the batch mean without no_grad: every step's graph hangs off
    `model.1.rm`. Named by module path, located at the assignment in MyBN.forward, and patched
    there with `.detach()` (in numerics-fixes.patch: an assignment's detach can cut backprop)."""
    source = BN.format(update=LEAKY)
    path, a = _run(tmp_path, source, "bn")
    [leak] = a.rule("graph-leak")
    assert [h["name"] for h in leak["evidence"]["holders"]] == ["model.1.rm"], leak["message"]
    assert "held by `model.1.rm`" in leak["message"]
    line = _line(source, "UPDATE LINE")
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)]
    [edit] = leak["fix"]["edits"]
    assert edit["start"] == edit["end"] == line
    assert edit["lines"][0].strip().startswith("self.rm = (0.9 * self.rm + 0.1 * m).detach()")
    assert leak["fix"]["changes_numerics"] is True
    assert "self.rm = (0.9 * self.rm + 0.1 * m).detach()" in patch_text(a.out / "numerics-fixes.patch")
    # the parameter `w` and the Linear weights are leaves: never holders
    assert not any(n.endswith((".w", ".weight", ".bias")) for n in _holder_names(a))


def test_a_buffer_updated_under_no_grad_is_clean(tmp_path):
    """The same module with its update under torch.no_grad(): the walk sees `model.1.rm` (no graph,
    no growth), and nothing is reported."""
    path, a = _run(tmp_path, BN.format(update=CLEAN), "bn_clean")
    assert not a.rule("graph-leak") and not a.rule("memory-growth"), [f["message"] for f in a.findings]
    scans = a.evidence["graph_scans"]
    rm = [h for s in scans for h in s["holders"] if h["name"] == "model.1.rm"]
    assert len(rm) == len(scans) and all(h["nodes"] == 0 and h["bytes"] == 64 * 4 for h in rm)


def test_a_queue_kept_as_a_buffer_is_named_at_its_line(tmp_path):
    """A queue buffer grown by `torch.cat` every step and never trimmed: 256 KiB a step, too little
    for RSS to prove in 30 steps, counted exactly as `model.1.queue`, at the line that grows it.
    A plain list attribute of the module growing beside it is named too (`model.1.seen`): its
    one-row slices keep each step's whole 256 KiB key alive, and are counted so."""
    source = QUEUE.format(trim="", pop="")
    path, a = _run(tmp_path, source, "queue")
    [growth] = a.rule("memory-growth")
    held = {h["name"]: h for h in growth["evidence"]["holders"]}
    assert set(held) == {"model.1.queue", "model.1.seen"}, growth["message"]
    assert "`model.1.queue` grew by" in growth["message"] and "`model.1.seen` grew by" in growth["message"]
    scans = sorted(a.evidence["graph_scans"], key=lambda s: s["after_step"])
    per_step = 256 * 256 * 4  # one (batch, d) float32 key
    for h in held.values():
        assert h["growth_bytes"] == per_step * (scans[-1]["after_step"] - scans[0]["after_step"]), h
    assert held["model.1.queue"]["kind"] == "Tensor" and held["model.1.seen"]["kind"] == "list"
    assert held["model.1.seen"]["tensors"] == 30
    assert {(loc["file"], loc["line"]) for loc in growth["locations"]} == {
        (str(path), _line(source, "QUEUE LINE")), (str(path), _line(source, "SEEN LINE"))}
    assert not a.rule("graph-leak")


def test_a_trimmed_queue_is_clean(tmp_path):
    """The same queue capped at 1,024 rows (full after four steps) and a list that keeps its last
    eight: no growth to report."""
    source = QUEUE.format(trim="[-1024:]", pop="; self.seen[:-8] = []")
    path, a = _run(tmp_path, source, "queue_clean")
    assert not a.rule("memory-growth") and not a.rule("graph-leak"), [f["message"] for f in a.findings]
    # seen, and steady once full: two steps' keys after step 1; then the last 1,024 rows, a view
    # of the concatenation that keeps its 1,280 rows of storage
    scans = sorted(a.evidence["graph_scans"], key=lambda s: s["after_step"])
    queue = [h["bytes"] for s in scans for h in s["holders"] if h["name"] == "model.1.queue"]
    assert [s["after_step"] for s in scans] == [1, 4, 16, 29]
    assert queue == [512 * 256 * 4] + [1280 * 256 * 4] * 3


class _Stats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("unset", None)
        self.history = [torch.ones(2)]
        self.settings = (3, "x", None)


def test_module_walk_names_and_limits():
    """Names by module path, through a global object's attribute (`trainer.net`); a submodule
    reached twice is named once, under the first name; parameters, None buffers and settings
    are not holders."""
    from auditor.capture.graphs import _holders

    shared = _Stats()
    net = nn.Sequential(nn.Linear(4, 4), shared)
    mod = types.ModuleType("target")
    mod.net = net
    mod.trainer = types.SimpleNamespace(net=nn.ModuleDict({"head": shared, "extra": _Stats()}))
    names = [h[0] for h in _holders(mod)]
    assert names == ["net.1.count", "net.1.history", "trainer.net.extra.count", "trainer.net.extra.history"]
    owners = {h[0]: h[3] for h in _holders(mod)}
    assert owners["net.1.count"] == (_Stats, "count")


def test_modules_in_a_list_attribute_of_a_global_are_walked():
    """`trainer.nets = [G, D]` (a GAN trainer object): the networks in the list are walked as
    `nets = [G, D]` is, and named `trainer.nets[1].count`; a dict attribute likewise. Before, only a
    module held directly by the attribute (`trainer.net`) was walked, and these had no holder."""
    from auditor.capture.graphs import _holders

    mod = types.ModuleType("target")
    mod.trainer = types.SimpleNamespace(nets=[nn.Linear(4, 4), _Stats()], by_name={"d": _Stats()}, steps=3)
    assert [h[0] for h in _holders(mod)] == ["trainer.nets[1].count", "trainer.nets[1].history",
                                             "trainer.by_name['d'].count", "trainer.by_name['d'].history"]



LISTED = BN.replace(
    "model = nn.Sequential(nn.Linear(16, 64), MyBN(64), nn.ReLU(), nn.Linear(64, 1))\n"
    "opt = torch.optim.Adam(model.parameters(), lr=1e-3)\n",
    "NETS\n"
    "opt = torch.optim.Adam([p for n in NAMED for p in n.parameters()], lr=1e-3)\n").replace(
    "nn.functional.mse_loss(model(x), x[:, :1])", "nn.functional.mse_loss(D(x), x[:, :1])")


def test_modules_inside_a_list_global_are_walked(tmp_path):
    """A trainer that keeps its networks in a list (`nets = [G, D]`, as GAN code does) or a dict
    holds their state all the same: the leaking buffer is named `nets[1].1.rm` (`nets['d'].1.rm`)
    at its line; before, modules inside containers were not walked and the leak had no holder."""
    body = "nn.Sequential(nn.Linear(16, 64), MyBN(64), nn.ReLU(), nn.Linear(64, 1))"
    for kind, nets, named, d, name in (
            ("list", f"nets = [nn.Linear(16, 16), {body}]", "nets", "nets[1]", "nets[1].1.rm"),
            ("dict", f"nets = {{'g': nn.Linear(16, 16), 'd': {body}}}", "nets.values()", "nets['d']", "nets['d'].1.rm")):
        source = LISTED.format(update=LEAKY).replace("NETS", nets).replace("NAMED", named).replace("D(x)", f"{d}(x)")
        path, a = _run(tmp_path, source, f"in_a_{kind}")
        [leak] = a.rule("graph-leak")
        assert [h["name"] for h in leak["evidence"]["holders"]] == [name], leak["message"]
        line = _line(source, "UPDATE LINE")
        assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)]


IN_PLACE = "            self.rm.mul_(0.9).add_(0.1 * m)  # UPDATE LINE: in place, no torch.no_grad"


def test_a_buffer_updated_in_place_with_grad_is_located_and_patched(tmp_path):
    """`self.rm.mul_(0.9).add_(0.1 * m)` outside no_grad: the buffer takes the batch mean's history
    and each step's in-place update adds to it. Named `model.1.rm`, located at the update (before,
    named with no line and no patch), and patched by putting the line under `torch.no_grad()`; the
    patched trainer audits clean."""
    source = BN.format(update=IN_PLACE)
    path, a = _run(tmp_path, source, "bn_in_place")
    [leak] = a.rule("graph-leak")
    assert [h["name"] for h in leak["evidence"]["holders"]] == ["model.1.rm"], leak["message"]
    line = _line(source, "UPDATE LINE")
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)]
    [edit] = leak["fix"]["edits"]
    assert edit["lines"] == ["            with torch.no_grad(): self.rm.mul_(0.9).add_(0.1 * m)"
                             "  # UPDATE LINE: in place, no torch.no_grad"]
    assert leak["fix"]["changes_numerics"] is True
    patched = source.splitlines()
    patched[line - 1] = edit["lines"][0]
    _, after = _run(tmp_path, "\n".join(patched) + "\n", "bn_in_place_patched")
    assert not after.rule("graph-leak") and not after.rule("memory-growth"), [f["message"] for f in after.findings]


def test_the_no_grad_patch_needs_the_name_torch(tmp_path):
    """`with torch.no_grad():` is only offered where the file binds `torch` (`import torch`), not
    where it only has `from torch import nn`: the patch must not break the file."""
    from auditor.rules.graph_leak import _detach_edit

    body = "\n\nclass M(nn.Module):\n    def forward(self, x):\n        self.rm.mul_(0.9).add_(x)\n        return x\n"
    for header, patched in (("import torch\nfrom torch import nn", True), ("from torch import nn", False)):
        path = tmp_path / "m.py"
        path.write_text(header + body)
        line = (header + body).splitlines().index("        self.rm.mul_(0.9).add_(x)") + 1
        edit, numerics = _detach_edit(str(path), line)
        assert (edit is not None) is patched and numerics is patched
        if patched:
            assert edit.lines == ["        with torch.no_grad(): self.rm.mul_(0.9).add_(x)"]


BUFFER = '''from collections import deque


class ReplayBuffer:
    def __init__(self):
        self.items = deque()

    def push(self, *row):
        self.items.append(row)  # GROW LINE
'''
AGENT = '''
import torch
from torch import nn

from rb import ReplayBuffer

torch.manual_seed(0)


class Agent:
    def __init__(self):
        self.net = nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-2)
        self.memory = ReplayBuffer()


agent = Agent()
x = torch.randn(8, 4)


def step():
    value = agent.net(x).sum()
    agent.memory.push(x, 1, value)  # the value keeps its graph
    agent.opt.zero_grad()
    value.backward()
    agent.opt.step()
'''


def test_a_buffer_object_inside_a_global_object_is_walked(tmp_path):
    """`agent.memory.items`: a replay buffer object (the user's class, in another module) held by
    a global object, whose deque keeps each step's value with its graph. Named by attribute path and
    located at the buffer class's line that grows it; before, objects below a global's attributes
    were not walked, and the leak was "held by tensors outside the target module's globals"."""
    (tmp_path / "rb.py").write_text(BUFFER)
    path, a = _run(tmp_path, AGENT, "agent")
    [leak] = a.rule("graph-leak")
    assert [h["name"] for h in leak["evidence"]["holders"]] == ["agent.memory.items"], leak["message"]
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(tmp_path / "rb.py"), _line(BUFFER, "GROW LINE"))]
    assert "agent.opt.state" not in _holder_names(a)  # a library object (the optimizer) is not walked
    # the row is pushed whole (`push(self, *row)`: `self.items.append(row)`): a tuple has no
    # `.detach()`, so that line has no patch (it was `self.items.append(row.detach())`, which raises)
    assert leak["fix"]["edits"] == [] and leak["fix"]["patch"] is None
    [holder] = leak["evidence"]["holders"]
    assert holder["rows"]["kind"] == "tuple" and holder["rows"]["graph"] == [2]


EMA = '''
import copy

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(0)
DECAY = 0.99
{ema}

def step(i):
    x = torch.randn(32, 16, generator=g)
    loss = nn.functional.mse_loss(model(x), x[:, :1])
    opt.zero_grad(); loss.backward(); opt.step()
    {update}
'''



EMA_FUNCTION = ('''
ema_model = copy.deepcopy(model)
for p in ema_model.parameters():
    p.requires_grad_(False)


def update_ema():
    for e, p in zip(ema_model.parameters(), model.parameters()):
        e.mul_(DECAY).add_(p, alpha=1 - DECAY)  # UPDATE LINE
''', "update_ema()", "ema_model", 2)  # per parameter and step: mul_, add_



EMA_CLASS = ('''
class EMA:
    def __init__(self, net):
        self.net = copy.deepcopy(net).requires_grad_(False)

    def update(self, net):
        for (_, e), p in zip(self.net.named_parameters(), net.parameters()):
            e.copy_(e * DECAY + p * (1 - DECAY))  # UPDATE LINE


ema = EMA(model)
''', "ema.update(model)", "ema", 4)  # e * DECAY, p * (1 - DECAY), +, copy_



@pytest.mark.parametrize("ema", [EMA_FUNCTION, EMA_CLASS], ids=["function", "class"])
def test_ema_parameters_updated_in_place_with_grad_are_a_leak(tmp_path, ema):
    """A hand-written EMA updated outside torch.no_grad(): its parameters (leaves that do not
    require grad) take the trained model's history and chain every step's update onto the last.
    The scan only counted plain tensors and never parameters, so nothing was found. Named per
    global, located at the update in the loop over the EMA's parameters, patched by putting it
    under torch.no_grad(); the patched trainer audits clean."""
    code, call, name, per_param = ema
    source = EMA.format(ema=code, update=call)
    path, a = _run(tmp_path, source, "ema")
    [leak] = a.rule("graph-leak")
    n_params = 4  # two Linear layers, weight and bias each
    assert leak["evidence"]["nodes_per_step"] == per_param * n_params
    assert f"held by `{name}`'s parameters ({n_params})" in leak["message"], leak["message"]
    line = _line(source, "UPDATE LINE")
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line)]
    [edit] = leak["fix"]["edits"]
    update = source.splitlines()[line - 1]
    indent = update[:len(update) - len(update.lstrip())]
    assert edit["lines"] == [f"{indent}with torch.no_grad(): {update.lstrip()}"]
    patched = source.splitlines()
    patched[line - 1] = edit["lines"][0]
    _, after = _run(tmp_path, "\n".join(patched) + "\n", "ema_patched")
    assert not after.rule("graph-leak") and not after.rule("memory-growth"), [f["message"] for f in after.findings]

