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

BN_CLASS = '''

class {name}(nn.Module):
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
'''
BN_NET = "nn.Sequential(nn.Linear(16, 64), {cls}(64), nn.ReLU(), nn.Linear(64, 1))"
BN_STEP = '''
opt = torch.optim.Adam([p for net in ({nets},) for p in net.parameters()], lr=1e-3)
g = torch.Generator().manual_seed(0)


def step(i):
    x = torch.randn(32, 16, generator=g)
    loss = sum(nn.functional.mse_loss(net(x), x[:, :1]) for net in ({nets},))
    opt.zero_grad(); loss.backward(); opt.step()
'''
LEAKY = "            self.rm = 0.9 * self.rm + 0.1 * m  # UPDATE LINE: no torch.no_grad, no detach"
CLEAN = ("            with torch.no_grad():\n"
         "                self.rm = 0.9 * self.rm + 0.1 * m  # CLEAN LINE")
IN_PLACE = "            self.rm.mul_(0.9).add_(0.1 * m)  # IN PLACE LINE: no torch.no_grad"
# IN_PLACE as graph-leak's patch puts it (test_a_buffer_updated_in_place_with_grad_is_located_and_patched)
IN_PLACE_PATCHED = "            with torch.no_grad(): self.rm.mul_(0.9).add_(0.1 * m)  # PATCHED LINE"


def bn_program(classes: dict[str, str], models: str, nets: list[str]) -> str:
    """A trainer with the hand-written batch norm class `name` of `classes` updating its running
    mean `rm` at line `classes[name]`, the globals `models` (Sequentials of BN_NET), and the nets
    `nets` (expressions) trained in one step from one optimizer. The nets share no tensor: what
    one keeps cannot reach another."""
    return ("\nimport torch\nfrom torch import nn\n\ntorch.manual_seed(0)\n"
            + "".join(BN_CLASS.format(name=name, update=update) for name, update in classes.items())
            + "\n\n" + models + BN_STEP.format(nets=", ".join(nets)))


# Four nets in one run: the running mean assigned without no_grad (`model`) and under it (`clean`),
# updated in place without no_grad (`in_place`) and as graph-leak's patch puts that line
# (`patched`). The rule must name the two leaky ones, each at its line, and neither clean twin.
BN_NETS = {"model": ("MyBN", LEAKY), "clean": ("CleanBN", CLEAN), "in_place": ("InPlaceBN", IN_PLACE),
           "patched": ("PatchedBN", IN_PLACE_PATCHED)}
BN = bn_program(dict(BN_NETS.values()), "".join(f"{g} = {BN_NET.format(cls=c)}\n" for g, (c, _) in BN_NETS.items()),
                list(BN_NETS))


QUEUE_CLASS = '''

class {name}(nn.Module):
    """MoCo-style: this step's keys join a queue of negatives kept as a buffer."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("queue", torch.zeros(0, d))
        self.seen = []  # a plain attribute: a list of tensors

    def forward(self, x):
        k = self.lin(x)
        with torch.no_grad():
            self.queue = torch.cat([self.queue, k.detach()]){trim}  # {queue_marker}
            self.seen.append(k.detach()[:1]){pop}  # {seen_marker}
        return k
'''
# A queue and a list never trimmed (`model`) beside their twins capped at 1,024 rows and eight
# entries (`trimmed`), in one run: the nets share no tensor (each keeps its own keys).
QUEUE = ("\nimport torch\nfrom torch import nn\n\ntorch.manual_seed(0)\n"
         + QUEUE_CLASS.format(name="Queue", trim="", pop="", queue_marker="QUEUE LINE", seen_marker="SEEN LINE")
         + QUEUE_CLASS.format(name="TrimmedQueue", trim="[-1024:]", pop="; self.seen[:-8] = []",
                              queue_marker="CAPPED LINE", seen_marker="LAST EIGHT LINE") + '''

model = nn.Sequential(nn.Linear(16, 256), Queue(256), nn.Linear(256, 1))
trimmed = nn.Sequential(nn.Linear(16, 256), TrimmedQueue(256), nn.Linear(256, 1))
opt = torch.optim.Adam([*model.parameters(), *trimmed.parameters()], lr=1e-3)
g = torch.Generator().manual_seed(0)


def step(i):
    x = torch.randn(256, 16, generator=g)
    loss = model(x).pow(2).mean() + trimmed(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
''')


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


@pytest.fixture(scope="module")
def bn_run(tmp_path_factory):
    """BN's four nets audited once: (path, audit, graph-leak's one finding)."""
    path, a = _run(tmp_path_factory.mktemp("bn"), BN, "bn")
    [leak] = a.rule("graph-leak")
    return path, a, leak


def _edit_at(leak, line: int) -> dict:
    [edit] = [e for e in leak["fix"]["edits"] if e["start"] <= line <= e["end"]]
    return edit


def test_a_buffer_updated_with_grad_is_named_at_its_line(bn_run):
    """The running mean assigned from the batch mean without no_grad: every step's graph hangs off
    `model.1.rm`. Named by module path, located at the assignment in MyBN.forward, and patched
    there with `.detach()` (marked as changing results: an assignment's detach can cut backprop).
    Its twins in the same run stay unnamed (test_a_buffer_updated_under_no_grad_is_clean)."""
    from auditor.rules.graph_leak import _detach_edit

    path, a, leak = bn_run
    assert [h["name"] for h in leak["evidence"]["holders"]] == ["model.1.rm", "in_place.1.rm"], leak["message"]
    assert "held by `model.1.rm`, `in_place.1.rm`" in leak["message"], leak["message"]
    line = _line(BN, "UPDATE LINE")
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [(str(path), line),
                                                                         (str(path), _line(BN, "IN PLACE LINE"))]
    edit = _edit_at(leak, line)
    assert edit["start"] == edit["end"] == line and len(leak["fix"]["edits"]) == 2
    assert edit["lines"][0].strip().startswith("self.rm = (0.9 * self.rm + 0.1 * m).detach()")
    assert leak["fix"]["changes_numerics"] is True
    # (the fix is numerics-changing if any of its edits is: this edit's own judgement, on the audited file)
    assert _detach_edit(str(path), line)[1] is True
    assert "self.rm = (0.9 * self.rm + 0.1 * m).detach()" in patch_text(a.out / "fixes.patch")
    assert "graph-leak" in patch_text(a.out / "fixes.patch").split("[changes results: review it]")[0]
    # the parameter `w` and the Linear weights are leaves: never holders
    assert not any(n.endswith((".w", ".weight", ".bias")) for n in _holder_names(a))


def test_a_buffer_updated_under_no_grad_is_clean(bn_run):
    """The same module with its update under torch.no_grad() (`clean`), and the in-place update as
    graph-leak's patch puts it (`patched`), in the run that names the leaky ones: the walk sees
    `clean.1.rm` and `patched.1.rm` at every scan (no graph, no growth), and nothing is reported
    of them: no holder, no line, no edit, no memory-growth."""
    path, a, leak = bn_run
    assert not a.rule("memory-growth"), [f["message"] for f in a.findings]
    assert not a.rule("memory-growth"), [f["message"] for f in a.findings]
    clean_lines = {_line(BN, "CLEAN LINE"), _line(BN, "PATCHED LINE")}
    assert not clean_lines & {loc["line"] for loc in leak["locations"]}
    assert not clean_lines & {n for e in leak["fix"]["edits"] for n in range(e["start"], e["end"] + 1)}
    assert not {"clean.1.rm", "patched.1.rm"} & {h["name"] for h in leak["evidence"]["holders"]}
    scans = a.evidence["graph_scans"]
    for name in ("clean.1.rm", "patched.1.rm"):
        rm = [h for s in scans for h in s["holders"] if h["name"] == name]
        assert len(rm) == len(scans) and all(h["nodes"] == 0 and h["bytes"] == 64 * 4 for h in rm), name


@pytest.fixture(scope="module")
def queue_run(tmp_path_factory):
    """QUEUE audited once: (path, audit)."""
    return _run(tmp_path_factory.mktemp("queue"), QUEUE, "queue")


def test_a_queue_kept_as_a_buffer_is_named_at_its_line(queue_run):
    """A queue buffer grown by `torch.cat` every step and never trimmed: 256 KiB a step, too little
    for RSS to prove in 30 steps, counted exactly as `model.1.queue`, at the line that grows it.
    A plain list attribute of the module growing beside it is named too (`model.1.seen`): its
    one-row slices keep each step's whole 256 KiB key alive, and are counted so. Their capped twins
    in the same run are not (test_a_trimmed_queue_is_clean)."""
    path, a = queue_run
    source = QUEUE
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


def test_a_trimmed_queue_is_clean(queue_run):
    """The same queue capped at 1,024 rows (full after four steps) and a list that keeps its last
    eight, in the run whose uncapped ones grow: no growth reported of them (no holder, no line),
    and no graph-leak."""
    path, a = queue_run
    assert not a.rule("graph-leak"), [f["message"] for f in a.findings]
    for growth in a.rule("memory-growth"):
        assert not [h for h in growth["evidence"]["holders"] if h["name"].startswith("trimmed.")], growth["message"]
        assert "trimmed." not in growth["message"]
        assert not {_line(QUEUE, "CAPPED LINE"), _line(QUEUE, "LAST EIGHT LINE")} & {
            loc["line"] for loc in growth["locations"]}
    # seen, and steady once full: two steps' keys after step 1; then the last 1,024 rows, a view
    # of the concatenation that keeps its 1,280 rows of storage
    scans = sorted(a.evidence["graph_scans"], key=lambda s: s["after_step"])
    queue = [h["bytes"] for s in scans for h in s["holders"] if h["name"] == "trimmed.1.queue"]
    seen = [h["tensors"] for s in scans for h in s["holders"] if h["name"] == "trimmed.1.seen"]
    assert [s["after_step"] for s in scans] == [1, 4, 16, 29]
    assert queue == [512 * 256 * 4] + [1280 * 256 * 4] * 3
    assert seen == [2, 5, 8, 8]  # (capped at eight, steady from step 7)


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



# A GAN-style trainer's networks in a list and in a dict, each with its own leaky batch norm class
LISTED = bn_program({"MyBN": LEAKY, "DictBN": LEAKY.replace("UPDATE LINE", "DICT UPDATE LINE")},
                    f"nets = [nn.Linear(16, 16), {BN_NET.format(cls='MyBN')}]\n"
                    f"by_name = {{'g': nn.Linear(16, 16), 'd': {BN_NET.format(cls='DictBN')}}}\n",
                    ["nets[1]", "by_name['d']"])


def test_modules_inside_a_list_global_are_walked(tmp_path):
    """A trainer that keeps its networks in a list (`nets = [G, D]`, as GAN code does) or a dict
    holds their state all the same: the leaking buffers are named `nets[1].1.rm` and
    `by_name['d'].1.rm`, each at its class's line; before, modules inside containers were not
    walked and the leak had no holder. (Both in one run: each net its own class, its own line.)"""
    path, a = _run(tmp_path, LISTED, "in_a_list_and_a_dict")
    [leak] = a.rule("graph-leak")
    assert [h["name"] for h in leak["evidence"]["holders"]] == ["nets[1].1.rm", "by_name['d'].1.rm"], leak["message"]
    assert [(loc["file"], loc["line"]) for loc in leak["locations"]] == [
        (str(path), _line(LISTED, "# UPDATE LINE")), (str(path), _line(LISTED, "DICT UPDATE LINE"))]


def test_a_buffer_updated_in_place_with_grad_is_located_and_patched(bn_run):
    """`self.rm.mul_(0.9).add_(0.1 * m)` outside no_grad: the buffer takes the batch mean's history
    and each step's in-place update adds to it. Named `in_place.1.rm`, located at the update
    (before, named with no line and no patch), and patched by putting the line under
    `torch.no_grad()`; that patched line, audited in the same run (`patched`), is clean
    (test_a_buffer_updated_under_no_grad_is_clean)."""
    from auditor.rules.graph_leak import _detach_edit

    path, a, leak = bn_run
    assert "in_place.1.rm" in [h["name"] for h in leak["evidence"]["holders"]], leak["message"]
    line = _line(BN, "IN PLACE LINE")
    assert (str(path), line) in [(loc["file"], loc["line"]) for loc in leak["locations"]]
    edit = _edit_at(leak, line)
    assert edit["start"] == edit["end"] == line
    assert edit["lines"] == ["            with torch.no_grad(): self.rm.mul_(0.9).add_(0.1 * m)"
                             "  # IN PLACE LINE: no torch.no_grad"]
    assert leak["fix"]["changes_numerics"] is True and _detach_edit(str(path), line)[1] is True
    assert edit["lines"][0].replace("IN PLACE LINE: no torch.no_grad", "PATCHED LINE") == IN_PLACE_PATCHED
    assert "with torch.no_grad(): self.rm.mul_(0.9)" in patch_text(a.out / "fixes.patch")


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



# Each EMA beside its twin as graph-leak's patch puts its update line (under torch.no_grad()): the
# rule must name the EMA at its line and not the twin.
EMA_FUNCTION = ('''
ema_model = copy.deepcopy(model)
for p in ema_model.parameters():
    p.requires_grad_(False)
twin_model = copy.deepcopy(model).requires_grad_(False)


def update_ema():
    for e, p in zip(ema_model.parameters(), model.parameters()):
        e.mul_(DECAY).add_(p, alpha=1 - DECAY)  # UPDATE LINE


def update_twin():
    for e, p in zip(twin_model.parameters(), model.parameters()):
        with torch.no_grad(): e.mul_(DECAY).add_(p, alpha=1 - DECAY)  # TWIN LINE
''', "update_ema(); update_twin()", "ema_model", "twin_model", 2)  # per parameter and step: mul_, add_


EMA_CLASS = ('''
class EMA:
    def __init__(self, net):
        self.net = copy.deepcopy(net).requires_grad_(False)

    def update(self, net):
        for (_, e), p in zip(self.net.named_parameters(), net.parameters()):
            e.copy_(e * DECAY + p * (1 - DECAY))  # UPDATE LINE


class TwinEMA(EMA):
    def update(self, net):
        for (_, e), p in zip(self.net.named_parameters(), net.parameters()):
            with torch.no_grad(): e.copy_(e * DECAY + p * (1 - DECAY))  # TWIN LINE


ema = EMA(model)
twin = TwinEMA(model)
''', "ema.update(model); twin.update(model)", "ema", "twin", 4)  # e * DECAY, p * (1 - DECAY), +, copy_


@pytest.mark.parametrize("ema", [EMA_FUNCTION, EMA_CLASS], ids=["function", "class"])
def test_ema_parameters_updated_in_place_with_grad_are_a_leak(tmp_path, ema):
    """A hand-written EMA updated outside torch.no_grad(): its parameters (leaves that do not
    require grad) take the trained model's history and chain every step's update onto the last.
    The scan only counted plain tensors and never parameters, so nothing was found. Named per
    global, located at the update in the loop over the EMA's parameters, patched by putting it
    under torch.no_grad(); that patched line, updating a twin EMA in the same run, is clean:
    the twin is no holder, its line has no finding, and the graph grows by the EMA's nodes alone."""
    code, call, name, twin, per_param = ema
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
    twin_line = source.splitlines()[_line(source, "TWIN LINE") - 1]
    assert edit["lines"][0].replace("UPDATE LINE", "TWIN LINE") == twin_line  # (the twin's line is the patched one)
    assert not [h for h in leak["evidence"]["holders"] if h["name"].split(".")[0] == twin], leak["evidence"]["holders"]
    assert not any(n.split(".")[0] == twin for n in _holder_names(a))
    assert not a.rule("memory-growth"), [f["message"] for f in a.findings]
