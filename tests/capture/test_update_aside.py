"""While an optimizer step of torch's own code runs (no hook of the user's around it), the Tensor
methods' sync probes pass every call on at once (probes.optimizer_updates._aside): its per-parameter `step.item()`
calls are not looked at. Run for real in a process of its own (the probes are global): torch's
AdamW step must have no probe look at its caller, and leave the probes looking after it; a sync
the user makes inside a step (their own optimizer's code, their hook on torch's optimizer, the
closure given to Adam as Lightning does or to LBFGS) must still be recorded at its line; and a
step that raised must leave the probes passing calls on no later than its step's end."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ONE_THREAD, ROOT

SCRIPT = r"""
import json, sys
import torch
from torch import nn
from auditor.capture import probes
from auditor.capture.probes import optimizer_updates
from auditor.capture.collectors import load_collectors

rec = probes.install()
if sys.argv[1] == "numerics":  # (the numerics collector's optimizer hooks take over the probes')
    col = next(c for c in load_collectors() if c.name == "numerics")
    col.install()
    col.step_begin(100)  # (an unchecked step: past the dense start, not one in 32)
ITEM_PROBE = torch.Tensor.item.__code__  # (every Tensor method's probe shares this code)
calls = [0]


def count(frame, event, arg):  # a probe that looks at its caller's frame, not one that passes the call on
    if event == "c_call" and arg is sys._getframe and frame.f_code is ITEM_PROBE:
        calls[0] += 1


def probed_calls(fn):
    calls[0] = 0
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


class MyOpt(torch.optim.SGD):
    def step(self, closure=None):
        self.param_groups[0]["lr"] = float(torch.tensor(0.1).item())  # MYOPT LINE
        return super().step(closure)


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))
x = torch.randn(8, 4)
adam = torch.optim.AdamW(net.parameters(), lr=1e-3)
out = {}


def backward():
    net.zero_grad()
    net(x).pow(2).mean().backward()


backward()
adam.step()  # (the first step makes the state: counters from the second on)
rec.drain()
backward()
out["torch_step"] = probed_calls(adam.step)
out["after"] = optimizer_updates._aside == [0, False]
out["torch_step_syncs"] = [t for t in rec.drain() if t["kind"] == "sync"]

h = adam.register_step_post_hook(lambda o, a, k: torch.tensor(1.0).item())  # HOOK LINE
backward()
out["hooked_step"] = probed_calls(adam.step)
out["hooked_syncs"] = [(t["what"], t["where"]["line"]) for t in rec.drain() if t["kind"] == "sync"]
h.remove()

mine = MyOpt(net.parameters(), lr=0.1)
backward()
mine.step()
out["my_syncs"] = [(t["what"], t["where"]["line"]) for t in rec.drain() if t["kind"] == "sync"]



def closure_a():  # (Lightning's way: every optimizer step is given its closure)
    adam.zero_grad()
    loss = net(x).pow(2).mean()
    loss.backward()
    loss.item()  # ADAM CLOSURE LINE
    return loss


out["closure_step"] = probed_calls(lambda: adam.step(closure_a))
out["adam_closure_syncs"] = [(t["what"], t["where"]["line"]) for t in rec.drain() if t["kind"] == "sync"]
out["closure_after"] = optimizer_updates._aside == [0, False]

lbfgs = torch.optim.LBFGS(net.parameters(), max_iter=2)


def closure():
    lbfgs.zero_grad()
    loss = net(x).pow(2).mean()
    loss.backward()
    loss.item()  # CLOSURE LINE
    return loss


lbfgs.step(closure)
out["closure_syncs"] = sorted({(t["what"], t["where"]["line"]) for t in rec.drain() if t["kind"] == "sync"})

sparse = nn.Embedding(4, 2, sparse=True)
bad = torch.optim.AdamW(sparse.parameters())
sparse(torch.tensor([1])).sum().backward()
try:
    bad.step()  # (AdamW does not take sparse gradients: raises inside the step)
except RuntimeError:
    pass
out["raised_aside"] = optimizer_updates._aside[1]
rec.drain()  # (the step's end)
out["drained_back"] = optimizer_updates._aside == [0, False]
print(json.dumps(out))
"""


def _line(marker: str) -> int:
    return next(n for n, text in enumerate(SCRIPT.splitlines(), 1) if marker in text)


def _run(tmp_path, collector: str) -> dict:
    script = tmp_path / "aside.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), collector], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _check(out: dict) -> None:
    # torch's own step reached no probe, recorded nothing, and left the probes in place
    assert out["torch_step"] == 0
    assert out["after"] and out["torch_step_syncs"] == []
    # a hook of the user's on torch's optimizer: the step is probed, and the hook's sync recorded
    assert out["hooked_step"] > 0
    assert out["hooked_syncs"] == [["Tensor.item", _line("# HOOK LINE")]]
    # the user's own optimizer code and an LBFGS closure: their syncs at their lines
    assert out["my_syncs"] == [["Tensor.item", _line("# MYOPT LINE")]]
    assert ["Tensor.item", _line("# CLOSURE LINE")] in out["closure_syncs"]
    # torch's step given a closure: the closure runs probed (its one `.item()`, recorded at its
    # line), the update's own per-parameter calls reach no probe
    assert out["closure_step"] == 1
    assert out["adam_closure_syncs"] == [["Tensor.item", _line("# ADAM CLOSURE LINE")]]
    assert out["closure_after"]
    # a step that raised left the probes aside until its step's end, not past it
    assert out["raised_aside"] and out["drained_back"]


def test_torch_own_update_passes_the_probes_by_and_a_users_sync_inside_a_step_is_recorded(tmp_path):
    _check(_run(tmp_path, "probes"))


def test_the_numerics_collectors_optimizer_hooks_step_the_probes_aside_too(tmp_path):
    _check(_run(tmp_path, "numerics"))
