"""Where the step finder could misread a whole program's loop, and how it reads it now.

One batch trained on for epochs (pytorch/examples mnist_forward_forward: `x, y = next(iter(train_loader))`,
then a thousand updates of each of its layers, each layer with an Adam of its own): the fetch made
the loader the training DataLoader, whose next fetch never came, and the whole run was one step of
26.8 s ("Tensor.item x2000/step", "x424/step"). One optimizer updating REPEATS_TO_SPLIT times in one
step on backward passes of its own ends that: each later update is a step. A critic's few updates
per batch (a WGAN's five) stay in the batch's step.

Forward passes a program runs before its loop (pytorch/examples fast_neural_style: its style
image's features through VGG, once, after making its DataLoader): they are its setup, not a step.
Step 0 held that forward and nothing else, and the summary read "0.9 per iteration" with per-step
counts averaged over it (conv2d x5.75/step for 6).

An optimizer the program lets go of (pytorch/tutorials' optimizer_step_in_backward: `del
optimizer`, then an Adam per parameter stepped in post-accumulate-grad hooks; a stage's optimizer
rebound to the next stage's): a step waited for it to step again, so every later iteration was one
step (the tutorial's last 3 iterations: one step of 96 updates, "8.8 per iteration").

A program of plain tensors updated by hand (pytorch/tutorials' polynomial_autograd: `a -= lr *
a.grad` under no_grad, no module, no optimizer): nothing marked its iterations, and its 2,000 were
one step. A backward pass whose leaves changed since the one before it now begins a step; one
whose leaves did not (a second loss, a micro-batch) stays in the open step."""
from __future__ import annotations

import pytest

from conftest import ONE_THREAD, audit

from auditor.capture.steps import REPEATS_TO_SPLIT

pytestmark = pytest.mark.slow

UPDATES = 40
ONE_BATCH = f'''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,))), batch_size=256)


class Layer(nn.Linear):
    def __init__(self, i, o):
        super().__init__(i, o)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.01)

    def train_on(self, x):
        for i in range({UPDATES}):
            g = self.forward(x).relu().pow(2).mean(1)  # (its forward called directly, as the example does)
            loss = torch.log1p(torch.exp(2.0 - g)).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return self.forward(x).relu().detach()


x, y = next(iter(loader))
h = x
for layer in (Layer(16, 32), Layer(32, 32)):
    h = layer.train_on(h)
print("done")
'''

CRITIC = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(48, 8)), batch_size=8)
G, D = nn.Linear(4, 8), nn.Linear(8, 1)
opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
for (real,) in loader:
    for _ in range(5):  # the critic's updates on one batch
        loss_d = D(G(torch.randn(8, 4)).detach()).mean() - D(real).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
    loss_g = -D(G(torch.randn(8, 4))).mean()
    opt_g.zero_grad()
    loss_g.backward()
    opt_g.step()
'''


STYLE_FIRST = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(48, 8), torch.randn(48, 1)), batch_size=8)
features = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with torch.no_grad():
    style = features(torch.randn(1, 8)).mean()  # SETUP LINE
    model(torch.randn(2, 8))  # a sanity check of the model's output shape
for x, y in loader:
    opt.zero_grad()
    loss = (model(x) - y).pow(2).mean() + 0 * style
    loss.backward()
    opt.step()
'''

NEVER_FETCHED = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
test_loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=8)  # made, used after training
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(6):
    opt.zero_grad()
    loss = model(torch.randn(8, 8)).pow(2).mean()
    loss.backward()
    opt.step()
'''

NO_OPTIMIZER = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=8)  # made, never iterated
model = nn.Linear(8, 1)
with torch.no_grad():
    for i in range(4):
        model(torch.randn(8, 8))
'''

OPT_IN_BACKWARD = '''import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters())


def train(model, optimizer):
    loss = model(torch.rand(4, 8))
    loss.sum().backward()
    optimizer.step()
    optimizer.zero_grad()


for _ in range(3):
    train(model, optimizer)

optimizer_dict = {p: torch.optim.Adam([p], foreach=False) for p in model.parameters()}


def optimizer_hook(parameter) -> None:
    optimizer_dict[parameter].step()
    optimizer_dict[parameter].zero_grad()


for p in model.parameters():
    p.register_post_accumulate_grad_hook(optimizer_hook)


def train(model):
    loss = model(torch.rand(4, 8))
    loss.sum().backward()


del optimizer
for _ in range(3):
    train(model)
'''

REBOUND = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(48, 8), torch.randn(48, 1)), batch_size=8)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(2):
    if epoch == 1:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # the second stage's optimizer
    for x, y in loader:
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
'''

POLY = '''import math
import torch

x = torch.linspace(-math.pi, math.pi, 200)
y = torch.sin(x)
a, b, c, d = (torch.randn((), requires_grad=True) for _ in range(4))
for t in range(ITERATIONS):
    for _ in range(MICRO):
        loss = (a + b * x + c * x ** 2 + d * x ** 3 - y).pow(2).sum()
        loss.backward()
    with torch.no_grad():
        for p in (a, b, c, d):
            UPDATE
            p.grad = None
print(a.item(), b.item())
'''

NEW_LOADER = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
ds = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
valid_dl = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=8)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
train_dl = DataLoader(ds, batch_size=8)
for epoch in range(2):
    if epoch == 1:
        NEXT_LOADER
    for x, y in train_dl:
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        valid = sum((model(x) - y).pow(2).mean() for x, y in valid_dl)
'''

HAND_THEN_OPTIM = '''import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 1)
for i in range(5):  # by hand first (nn_tutorial's first stages)
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad * 0.01
        model.zero_grad()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(5):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
'''

# pytorch/tutorials' DQN, its shape: each iteration acts (the policy under no_grad on the greedy
# iterations, a random action on the others), reads the action back (`.item()`), stores the
# transition, then updates once the replay memory holds a batch, and soft-updates its target net.
AGENT = '''import random
import torch
from torch import nn

random.seed(0)
torch.manual_seed(0)
policy, target = (nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2)) for _ in range(2))
target.load_state_dict(policy.state_dict())
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
memory = []
for i in range(80):
    state = torch.randn(1, 4)
    if i % 3 == 0:  # greedy: the policy's action
        with torch.no_grad():
            action = policy(state).max(1).indices.view(1, 1)
    else:
        action = torch.tensor([[random.randrange(2)]])
    a = action.item()  # ACTION LINE
    memory.append((state, a))
    if len(memory) < 32:
        continue
    batch = torch.cat([s for s, _ in random.sample(memory, 32)])
    loss = policy(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sd, pd = target.state_dict(), policy.state_dict()
    for key in pd:
        sd[key] = pd[key] * 0.005 + sd[key] * 0.995
    target.load_state_dict(sd)
'''


def run(tmp_path, source: str):
    """`audit run` of the program `source` to its end (each has fewer than 200 steps)."""
    (tmp_path / "prog.py").write_text(source)
    a = audit("run", str(tmp_path / "prog.py"), "--steps", "200", "--to-end", "--no-profile", "--quiet",
              out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    return a


def count(step: dict, kind: str) -> int:
    return sum(t["count"] for t in step["tallies"] if t["kind"] == kind)


def test_a_batch_trained_on_for_epochs_is_stepped_by_its_updates(tmp_path):
    a = run(tmp_path, ONE_BATCH)
    split = REPEATS_TO_SPLIT + 1  # (the step that shows the boundary missed holds them)
    rest = UPDATES - split
    # the second layer's Adam steps at the first layer's line, in the loop that held the first's
    # updates: its first repeat leaves the first's out of the optimizers a step waits for
    assert [count(s, "optimizer") for s in a.evidence["steps"]] == [split] + [1] * rest + [2] + [1] * (UPDATES - 2)
    found = a.evidence["program"]["steps_found"]
    assert found.startswith("optimizer steps (Adam), 1 per iteration") and "DataLoader" not in found


def test_a_critics_updates_on_one_batch_stay_in_its_step(tmp_path):
    a = run(tmp_path, CRITIC)
    steps = a.evidence["steps"]
    assert len(steps) == 6  # one a batch
    assert [count(s, "optimizer") for s in steps] == [6] * 6
    assert "each begins at a fetch of the training DataLoader" in a.evidence["program"]["steps_found"]


def test_a_forward_before_the_first_fetch_is_setup(tmp_path):
    a = run(tmp_path, STYLE_FIRST)
    steps = a.evidence["steps"]
    assert len(steps) == 6  # one a batch
    assert [count(s, "optimizer") for s in steps] == [1] * 6
    assert [count(s, "forward") for s in steps] == [1] * 6
    assert a.evidence["program"]["steps_found"].startswith(
        "optimizer steps (SGD), 1 per iteration; each begins at a fetch of the training DataLoader")
    setup_forwards = [t for t in a.evidence["setup"] if t["kind"] == "forward"]
    assert sum(t["count"] for t in setup_forwards) == 2
    line = next(n for n, text in enumerate(STYLE_FIRST.splitlines(), 1) if "SETUP LINE" in text)
    assert line in {t["where"]["line"] for t in setup_forwards}


def test_a_loop_that_never_fetches_is_stepped_by_its_updates(tmp_path):
    a = run(tmp_path, NEVER_FETCHED)
    steps = a.evidence["steps"]
    assert [count(s, "optimizer") for s in steps] == [1] * 6
    # (the first iteration's forward and backward were taken for setup until its update showed a
    # loop that never fetches: they are in step 0)
    assert [count(s, "forward") for s in steps] == [1] * 6
    assert [count(s, "backward") for s in steps] == [1] * 6
    assert not [t for t in a.evidence["setup"] if t["kind"] in ("forward", "backward")]
    assert a.evidence["program"]["steps_found"].startswith("optimizer steps (SGD), 1 per iteration")


def test_a_program_that_makes_no_optimizer_keeps_its_work_as_one_step(tmp_path):
    """(an inference script: nothing marks its iterations, and its work from its first pass is one
    step, as in any program without optimizer, fetch or marker)"""
    a = run(tmp_path, NO_OPTIMIZER)
    [step] = a.evidence["steps"]
    assert count(step, "forward") == 4
    assert a.evidence["program"]["steps_found"].startswith("no optimizer step")


def test_optimizers_stepped_in_the_backward_pass_after_one_let_go_of(tmp_path):
    """Three steps of one Adam, then (it deleted) one Adam per parameter stepped by each
    parameter's post-accumulate-grad hook inside the backward pass: six steps, the last three
    with six updates each, and the summary says how many per iteration, not their mean."""
    a = run(tmp_path, OPT_IN_BACKWARD)
    steps = a.evidence["steps"]
    assert [count(s, "optimizer") for s in steps] == [1, 1, 1, 6, 6, 6]
    assert [count(s, "backward") for s in steps] == [1] * 6
    assert [count(s, "forward") for s in steps] == [1] * 6
    assert a.evidence["program"]["steps_found"] == "optimizer steps (Adam), 1-6 per iteration"


def test_a_stage_whose_optimizer_is_rebound_is_stepped_by_the_new_one(tmp_path):
    a = run(tmp_path, REBOUND)
    steps = a.evidence["steps"]
    assert [count(s, "optimizer") for s in steps] == [1] * 12  # (one a batch, both epochs)
    found = a.evidence["program"]["steps_found"]
    assert found.startswith("optimizer steps (SGD, Adam), 1 per iteration") or found.startswith(
        "optimizer steps (Adam, SGD), 1 per iteration"), found


@pytest.mark.parametrize("micro,update", [(1, "p -= 1e-6 * p.grad"), (2, "p -= 1e-6 * p.grad"),
                                          (1, "p.data -= 1e-6 * p.grad")])
def test_plain_tensors_updated_by_hand_are_stepped_at_their_backward_passes(tmp_path, micro, update):
    """30 iterations: one step each, with its MICRO backward passes (a micro-batch's leaves are
    unchanged: it stays in the step); an update through `.data` moves no version counter, and is
    read by the leaves' norms."""
    a = run(tmp_path, POLY.replace("ITERATIONS", "30").replace("MICRO", str(micro)).replace("UPDATE", update))
    steps = a.evidence["steps"]
    assert [count(s, "backward") for s in steps] == [micro] * 30
    assert a.evidence["program"]["steps_found"] == (
        "weight updates outside torch.optim (the tensors a backward pass reached changed before the next "
        "backward pass), 1 per iteration")


@pytest.mark.parametrize("next_loader", ["train_dl = DataLoader(ds, batch_size=8, shuffle=True)",
                                         "first_dl, train_dl = train_dl, DataLoader(ds, batch_size=8, shuffle=True)"])
def test_a_new_training_loader_marks_the_steps(tmp_path, next_loader):
    """The first epoch's loader rebound to a new one (freed): 12 steps of one batch each, forward,
    backward and update in each; the evaluation's forwards are outside the steps. Kept alive under
    another name, the new loader is known for the training one at its first optimizer step: that
    step begins after it (its batch's work ran outside the steps), the next ones are whole."""
    a = run(tmp_path, NEW_LOADER.replace("NEXT_LOADER", next_loader))
    steps = a.evidence["steps"]
    whole = [1] * 12 if next_loader.startswith("train_dl =") else [1] * 6 + [0] + [1] * 5
    assert [count(s, "optimizer") for s in steps] == whole
    assert [count(s, "backward") for s in steps] == whole
    assert [count(s, "forward") for s in steps] == whole
    assert [len(d["where"] and [1] or []) for d in a.evidence["dataloaders"]] == [1, 1, 1]  # (each loader made, recorded)


def test_updates_by_hand_then_by_an_optimizer(tmp_path):
    """Five iterations updated by hand, five by SGD: ten steps, and the summary says how many had no
    optimizer step, not '0-1' nor their mean."""
    a = run(tmp_path, HAND_THEN_OPTIM)
    steps = a.evidence["steps"]
    assert [count(s, "optimizer") for s in steps] == [0] * 5 + [1] * 5
    assert [count(s, "backward") for s in steps] == [1] * 10
    assert a.evidence["program"]["steps_found"] == (
        "optimizer steps (SGD), 1 per iteration (none in 5 of the 10 steps, marked by weight updates outside "
        "torch.optim)")


def test_an_agent_that_acts_under_no_grad_on_some_iterations_keeps_each_action_in_its_step(tmp_path):
    """Its iterations hold 0 or 1 no-grad forwards after the update (the next action, greedy on
    every third, of a policy of nested modules): a step's tail holds one in any case, counted at
    its outermost module call only, so an iteration after a random one is not taken for an
    evaluation, its action and its read put between the steps (the tutorial's `.item()`: 5 of its syncs in 50 steps were reported as between
    steps, "an eval loop, a checkpoint save"; with gymnasium's CartPole, 67 of 300)."""
    a = run(tmp_path, AGENT)
    line = next(n for n, text in enumerate(AGENT.splitlines(), 1) if "ACTION LINE" in text)
    steps = a.evidence["steps"]
    assert len(steps) == 80 - 31 and [count(s, "optimizer") for s in steps] == [1] * len(steps)
    reads = [sum(t["count"] for t in s["tallies"] if t["kind"] == "sync" and t["where"]["line"] == line) for s in steps]
    # (the first holds the memory's filling; each step closes at the next update's forward, after
    # the next iteration's action, and the last has none after it)
    assert reads == [33] + [1] * (len(steps) - 2) + [0], reads
    assert not [o for o in a.evidence["outside"] if o["phase"] == "between"]
    # host-sync's rate is a typical step's: the first step's filling of the memory is a one-off
    # burst, left out and named (over all the steps it read as 1.63 a step)
    [f] = a.rule("host-sync")
    typical = round((len(steps) - 2) / (len(steps) - 1), 2)  # (the steps but the first: one read each, the last none)
    assert f["evidence"]["syncs_per_step"] == typical and f["evidence"]["left_out_steps"] == {"0": 33}, f["evidence"]
    assert (f"one-off burst of calls: step 0 (33: Tensor.item x33 at line {line}), against 1 in the median step"
            in f["message"]), f["message"]


SIDE_ITERATOR = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
train_dl = DataLoader(TensorDataset(torch.randn(48, 8), torch.randn(48, 1)), batch_size=8, shuffle=True)
val_dl = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=8)
model = nn.Linear(8, 1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def calc_loss_loader(loader, num_batches=1):
    total = 0.0
    for i, (x, y) in enumerate(loader):  # EVAL FETCH LINE
        if i < num_batches:
            total += (model(x) - y).pow(2).mean().item()
        else:
            break
    return total / num_batches


step = -1
for epoch in range(2):
    for x, y in train_dl:  # LOOP FETCH LINE
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        step += 1
        if step % 3 == 0:  # LLMs-from-scratch's evaluation: a batch of each set, the training one too
            model.eval()
            with torch.no_grad():
                train_loss, val_loss = calc_loss_loader(train_dl), calc_loss_loader(val_dl)
            model.train()
'''


def test_an_evaluation_that_reads_the_training_loader_mid_epoch_is_between_the_steps(tmp_path):
    """Every third step the evaluation iterates the training DataLoader afresh (a second iterator
    while the loop's lives): its fetch is no fetch of the loop's, so it begins no step. Each step
    holds the loop's fetch, its forward and its update; the evaluations are between the steps (they
    had begun the next step, which then held them: 3 forwards, 4 fetches, every third step); the
    second epoch's new iterator, after the first ran out, begins its steps."""
    a = run(tmp_path, SIDE_ITERATOR)
    loop = next(n for n, text in enumerate(SIDE_ITERATOR.splitlines(), 1) if "LOOP FETCH LINE" in text)
    steps = a.evidence["steps"]
    assert len(steps) == 12
    assert [count(s, "forward") for s in steps] == [1] * 12
    assert [count(s, "optimizer") for s in steps] == [1] * 12
    fetches = [[(t["where"]["line"], t["count"]) for t in s["tallies"] if t["kind"] == "data-wait"] for s in steps]
    assert fetches == [[(loop, 1)]] * 12, fetches
    between = [o["after_step"] for o in a.evidence["outside"] if o["phase"] == "between"]
    assert between == [0, 3, 5, 6, 9], between  # (after step 5: the first epoch's end, the next iterator made)
    [f] = [f for f in a.rule("host-sync") if f["evidence"].get("phase") == "between"]
    assert f["evidence"]["evaluation"] is True and f["evidence"]["sites"][0]["count"] == 8  # (two a stretch)


EVALUATED_FIRST = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
train_dl = DataLoader(TensorDataset(torch.randn(48, 8), torch.randn(48, 1)), batch_size=8, shuffle=True)
val_dl = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=8)
model = nn.Linear(8, 1)


def calc_loss_loader(loader, num_batches):
    total = 0.0
    for i, (x, y) in enumerate(loader):
        if i < num_batches:
            total += (model(x) - y).pow(2).mean().item()
        else:
            break
    return total / num_batches


with torch.no_grad():  # the initial losses, before the optimizer is made (LLMs-from-scratch ch07)
    train_loss, val_loss = calc_loss_loader(train_dl, 4), calc_loss_loader(val_dl, 2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for epoch in range(2):
    for x, y in train_dl:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def test_an_evaluation_before_training_is_setup(tmp_path):
    """Losses read under no_grad over batches of both loaders before the optimizer is made: setup,
    not steps (each of its fetches began one: 6 steps of one forward and no update, taken for a
    first training loop of its own). The 12 steps are the training loop's, each with its update."""
    a = run(tmp_path, EVALUATED_FIRST)
    steps = a.evidence["steps"]
    assert len(steps) == 12 and [count(s, "optimizer") for s in steps] == [1] * 12
    assert [count(s, "forward") for s in steps] == [1] * 12
    setup = a.evidence["setup"]
    assert sum(t["count"] for t in setup if t["kind"] == "forward") == 6
    assert sum(t["count"] for t in setup if t["kind"] == "sync") == 6
    assert a.evidence["program"]["steps_found"] == (
        "optimizer steps (AdamW), 1 per iteration; each begins at a fetch of the training DataLoader")


FETCHED_AHEAD = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
train = DataLoader(TensorDataset(torch.randn(40, 8), torch.randn(40, 1)), batch_size=8)
valid = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=8)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


class PrefetchLoader:
    """timm's: the next batch is fetched (and its copy to the device started) before the one held
    is yielded, so the last batch comes after the loader's end."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        first = True
        for nx, ny in self.loader:
            nx = nx * 1.0  # (the wrapper's own work on the batch it fetched: a copy, a normalisation)
            if not first:
                yield x, y
            else:
                first = False
            x, y = nx, ny
        yield x, y


for epoch in range(3):
    for x, y in PrefetchLoader(train):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        print(epoch, sum(float((model(vx) - vy).pow(2).mean()) for vx, vy in valid))
'''


@pytest.mark.parametrize("prepare", ["nx * 1.0", "nx.to('cuda').sub_(0.5)"], ids=["cpu", "rehearsed-cuda"])
def test_the_last_batch_a_wrapper_fetched_ahead_is_a_step(tmp_path, prepare):
    """timm's PrefetchLoader (and accelerate's loader) yields an epoch's last batch after the
    DataLoader ran out: that fetch closed the step before it and began none, so the last
    iteration's forward and backward ran between steps, and its optimizer step began a step of its
    own (timm's resnet18, rehearsed: one 77 ms step per epoch beside 5 s ones, and 'backward passes'
    between steps). That step now begins at the fetch that found the loader exhausted: every
    iteration is a step with its update, and what runs between the epochs is the evaluation.
    The wrapper's work on the batch it fetched (rehearsed: its copy to the device and an op on it,
    as timm normalises each batch on the GPU) is fetching too: it closed a step 0 that had done
    nothing else ("none in 1 of the 25 steps", Tensor.item x0.96/step)."""
    text = FETCHED_AHEAD.replace("nx * 1.0", prepare)
    if "cuda" in prepare:
        text = text.replace("for x, y in PrefetchLoader(train):", "for x, y in PrefetchLoader(train):\n        y = y.to('cuda')")
        text = text.replace("model = nn.Linear(8, 1)", "model = nn.Linear(8, 1).to('cuda')")
        text = text.replace("(model(vx) - vy)", "(model(vx.to('cuda')) - vy.to('cuda'))")
    a = run(tmp_path, text)
    steps = a.evidence["steps"]
    assert len(steps) == 15 and [count(s, "optimizer") for s in steps] == [1] * 15
    assert [count(s, "backward") for s in steps] == [1] * 15
    assert [count(s, "data-wait") for s in steps] == [2, 1, 1, 1, 1] * 3  # (the epoch's first fetches two)
    between = [o for o in a.evidence["outside"] if o["phase"] == "between"]
    assert [o["after_step"] for o in between] == [4, 9]  # the evaluations, after each epoch's last step
    assert not [t for o in between for t in o["tallies"] if t["kind"] in ("backward", "optimizer")]
    assert all(sum(t["count"] for t in o["tallies"] if t["kind"] == "forward") == 2 for o in between)


PEEKED = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

torch.manual_seed(0)
data = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
train = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0))
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(3):
    b_sz = len(next(iter(train))[0])
    train.sampler.set_epoch(epoch)
    for x, y in train:
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
'''


def test_a_batch_peeked_at_before_the_loop_is_no_step_of_its_own(tmp_path):
    """pytorch/examples' DDP tutorial (multigpu_torchrun.py) reads the batch size from a batch of
    its own iterator before each epoch (`len(next(iter(self.train_data))[0])`), with a
    DistributedSampler: its sampler's iteration counted as the step's work, so the loop's first
    fetch closed a step that had fetched and done nothing else ("none in 1 of the 40 steps", and
    every per-step rate over one step too many). A sampler's iteration is fetching."""
    a = run(tmp_path, PEEKED)
    steps = a.evidence["steps"]
    assert len(steps) == 15 and [count(s, "optimizer") for s in steps] == [1] * 15
    assert a.evidence["program"]["steps_found"] == (
        "optimizer steps (SGD), 1 per iteration; each begins at a fetch of the training DataLoader")


DELAYED = '''import torch
from torch import nn

torch.manual_seed(0)
q, pi = nn.Linear(4, 1), nn.Linear(4, 4)
opt_q, opt_pi = torch.optim.Adam(q.parameters()), torch.optim.Adam(pi.parameters())
for it in range(60):
    with torch.no_grad():
        action = pi(torch.randn(1, 4))  # the agent acts
    x = torch.randn(64, 4)
    loss_q = q(x).pow(2).mean()
    opt_q.zero_grad()
    loss_q.backward()
    opt_q.step()
    if it % 2 == 0:  # the delayed policy update
        loss_pi = -q(pi(x)).mean()
        opt_pi.zero_grad()
        loss_pi.backward()
        opt_pi.step()
'''

EVERY_NTH_BATCH = '''import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(120, 8)), batch_size=8)
G, D = nn.Linear(4, 8), nn.Linear(8, 1)
opt_g, opt_d = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
for i, (real,) in enumerate(loader):
    loss_d = D(G(torch.randn(8, 4)).detach()).mean() - D(real).mean()
    opt_d.zero_grad()
    loss_d.backward()
    opt_d.step()
    if i % 3 == 0:  # the generator every n_critic-th batch
        loss_g = -D(G(torch.randn(8, 4))).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
'''


def test_an_optimizer_stepped_every_other_iteration_leaves_one_step_an_iteration(tmp_path):
    """TD3's delayed actor (cleanrl td3_continuous_action.py: the critic every iteration, the actor
    every second): the critic steps again before the actor in a loop that holds both steps, so the
    actor is not waited for, and each iteration is a step (32 steps of these 60 iterations before;
    the first two stay together, as the second shows the pattern)."""
    a = run(tmp_path, DELAYED)
    updates = [count(s, "optimizer") for s in a.evidence["steps"]]
    assert len(updates) == 59 and sum(updates) == 60 + 30  # every update in a step: the critic's and the actor's
    assert set(updates) == {1, 2}  # a critic's update a step, with the actor's where it came


def test_a_generator_stepped_every_nth_batch_leaves_one_step_a_batch(tmp_path):
    """A WGAN-GP loop that steps its generator every 3rd batch (eriklindernoren's `if i %
    opt.n_critic == 0`): a step a batch, as the loop counts them; a critic's inner loop of updates
    on one batch still stays in its generator's step (above)."""
    a = run(tmp_path, EVERY_NTH_BATCH)
    updates = [count(s, "optimizer") for s in a.evidence["steps"]]
    assert len(updates) == 15 - 1 and sum(updates) == 15 + 5  # 15 batches; the first two together (6 steps before)
    assert "each begins at a fetch of the training DataLoader" in a.evidence["program"]["steps_found"]
