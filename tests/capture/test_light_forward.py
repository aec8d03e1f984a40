"""Outside the checked steps an outermost module call takes the numerics collector's global hooks
out of torch's dicts for its duration (Numerics._light_call), so the calls inside it take torch's
fast path: run for real in a process of its own (the probes and hooks are global), it must still
time the forward phase at the user's line, put the hooks back in their order (after a forward that
raised too), and leave the checked steps' hooks as they were. A module without submodules makes no
calls inside it: its outermost calls leave torch's dicts as they are."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ONE_THREAD, ROOT

SCRIPT = r"""
import json
import torch
from torch import nn
from torch.nn.modules import module as M
from auditor.capture import probes
from auditor.capture.collectors import load_collectors

rec = probes.install()
col = next(c for c in load_collectors() if c.name == "numerics")
col.install()
user = M.register_module_forward_pre_hook(lambda m, a: None)  # a user's global hook, after ours
order = (list(M._global_forward_pre_hooks), list(M._global_forward_hooks))
seen = []


class Probe(nn.Module):
    def forward(self, x):  # what a nested call finds in torch's global dicts
        seen.append((col.module_hooks[0].id in M._global_forward_pre_hooks,
                     col.module_hooks[1].id in M._global_forward_hooks))
        if x.sum() > 1e9:
            raise ValueError("too big")
        return x


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 4), Probe(), nn.Sequential(nn.ReLU(), Probe()))
x = torch.randn(2, 4)
out = {}
for i, name in ((0, "checked"), (100, "timed")):  # (step 100: past the dense start, not one in 32)
    col.step_begin(i)
    net(x).sum().backward()  # FORWARD LINE
    col.step_end(i)
    out[name] = {"nested": seen[:], "tallies": [t for t in rec.drain() if t["kind"] == "forward"],
                 "order": [list(M._global_forward_pre_hooks), list(M._global_forward_hooks)]}
    seen.clear()
col.step_begin(101)
try:
    net(x * 1e10)
except ValueError:
    pass
col.step_end(101)
out["raised"] = {"order": [list(M._global_forward_pre_hooks), list(M._global_forward_hooks)],
                 "local": [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_always_called)
                           for m in net.modules()]}
leaf = Probe()  # a module without submodules, called three times a step (an RNN cell's loop)
seen.clear()
rec.drain()
col.step_begin(102)
for _ in range(3):
    leaf(x)  # LEAF LINE
try:
    leaf(x * 1e10)  # RAISING LEAF LINE
except ValueError:
    pass
col.step_end(102)
out["leaf"] = {"nested": seen[:], "tallies": [t for t in rec.drain() if t["kind"] == "forward"],
               "order": [list(M._global_forward_pre_hooks), list(M._global_forward_hooks)],
               "open": [len(col.mstack), len(col.wstack), len(col.lstack)],
               "local": len(leaf._forward_hooks) + len(leaf._forward_pre_hooks) + len(leaf._forward_hooks_always_called)}
out["before"] = [list(o) for o in order]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def light_run(tmp_path_factory) -> dict:
    """SCRIPT's output, run once in a process of its own."""
    script = tmp_path_factory.mktemp("light") / "light.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_a_timed_steps_forward_is_timed_without_the_hooks_inside_it(light_run):
    out = light_run
    line = next(n for n, text in enumerate(SCRIPT.splitlines(), 1) if "# FORWARD LINE" in text)
    # the checked step: the hooks run in every nested call; the timed step: in none
    assert out["checked"]["nested"] == [[True, True]] * 2
    assert out["timed"]["nested"] == [[False, False]] * 2
    # both steps time one forward phase, of the outermost module, at the user's line
    for role in ("checked", "timed"):
        [t] = out[role]["tallies"]
        assert (t["what"], t["where"]["line"], t["count"]) == ("Sequential", line, 1), t
        assert t["ms"] > 0
    # the global hooks back in their order among the user's, after a forward that raised too;
    # nothing left on the user's modules
    assert out["checked"]["order"] == out["timed"]["order"] == out["raised"]["order"] == out["before"]
    assert out["raised"]["local"] == [0] * len(out["raised"]["local"])


def test_a_timed_steps_calls_of_a_module_without_submodules_keep_the_hooks_in(light_run):
    """A module with no submodules makes no module calls for torch's fast path to speed up: its
    outermost calls in a timed step (an RNN cell's, many a step) leave torch's dicts as they are,
    and each is timed at the user's line by the global hooks, one that raised too."""
    leaf = light_run["leaf"]
    lines = {key: next(n for n, text in enumerate(SCRIPT.splitlines(), 1) if text.endswith(f"# {key}"))
             for key in ("LEAF LINE", "RAISING LEAF LINE")}
    assert leaf["nested"] == [[True, True]] * 4  # the hooks stayed in torch's dicts in every call
    by_line = {t["where"]["line"]: t for t in leaf["tallies"]}
    assert {line: (t["what"], t["count"]) for line, t in by_line.items()} == {
        lines["LEAF LINE"]: ("Probe", 3), lines["RAISING LEAF LINE"]: ("Probe", 1)}
    assert all(t["ms"] > 0 for t in leaf["tallies"])
    assert leaf["order"] == light_run["before"]
    assert leaf["open"] == [0, 0, 0] and leaf["local"] == 0  # nothing left open, nothing on the module
