"""Auditing never changes what training computes: after `audit run T --steps N` the weights equal
those of N plain calls of the step."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import EXAMPLES, audit

STEPS = 12
WRAPPER = '''
import os, sys
sys.path.insert(0, {examples!r})
import torch
import {name} as trainer

def step(i):
    trainer.step(i)
    if i == {last}:
        torch.save(trainer.model.state_dict(), os.environ["PARITY_OUT"].format(name={name!r}))

if __name__ == "__main__":
    for i in range({steps}):
        step(i)
'''


NAMES = ["clean", "retained_graph", "host_sync", "graph_leak", "forced_cleanup", "anomaly_mode"]
PLAIN_ALL = '''
import runpy, sys
for path in sys.argv[1:]:  # each trainer in turn, plain (anomaly_mode last: it switches a global on)
    runpy.run_path(path, run_name="__main__")
'''


def wrapper_for(directory, name):
    wrapper = directory / f"parity_{name}.py"
    wrapper.write_text(WRAPPER.format(examples=str(EXAMPLES), name=name, last=STEPS - 1, steps=STEPS))
    return wrapper


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory):
    """The weights after STEPS plain calls of each trainer's step, all trainers in one process (each
    seeds its own model and data at import; one process saves five torch start-ups)."""
    d = tmp_path_factory.mktemp("plain")
    wrappers = [wrapper_for(d, name) for name in NAMES]
    # the same environment as the audited run (conftest.audit runs it with one intra-op thread):
    # a different thread count changes the order of float reductions, so the bits
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PARITY_OUT": str(d / "{name}.pt")}
    subprocess.run([sys.executable, "-c", PLAIN_ALL, *map(str, wrappers)], check=True, cwd=d,
                   capture_output=True, env=env)
    return {name: torch.load(d / f"{name}.pt", weights_only=True) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_audited_weights_equal_plain_weights(tmp_path, plain_weights, name):
    wrapper = wrapper_for(tmp_path, name)
    audited = tmp_path / "audited.pt"
    a = audit("run", f"{wrapper}:step", "--steps", str(STEPS), "--quiet", out=tmp_path / "out",
              env={"PARITY_OUT": str(audited)})
    assert a.returncode in (0, 1), a.stderr
    w_plain = plain_weights[name]
    w_audit = torch.load(audited, weights_only=True)
    assert w_plain.keys() == w_audit.keys()
    for k in w_plain:
        assert torch.equal(w_plain[k], w_audit[k]), k
    # and training moved the weights, so the comparison means something
    assert any(not torch.equal(w_plain[k], torch.zeros_like(w_plain[k])) for k in w_plain)
