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
        torch.save(trainer.model.state_dict(), os.environ["PARITY_OUT"])

if __name__ == "__main__":
    for i in range({steps}):
        step(i)
'''


@pytest.mark.parametrize("name", ["clean", "retained_graph", "host_sync", "graph_leak", "forced_cleanup",
                                  "anomaly_mode"])
def test_audited_weights_equal_plain_weights(tmp_path, name):
    wrapper = tmp_path / f"parity_{name}.py"
    wrapper.write_text(WRAPPER.format(examples=str(EXAMPLES), name=name, last=STEPS - 1, steps=STEPS))
    plain, audited = tmp_path / "plain.pt", tmp_path / "audited.pt"
    # the same environment as the audited run (conftest.audit runs it with one intra-op thread):
    # a different thread count changes the order of float reductions, so the bits
    subprocess.run([sys.executable, str(wrapper)], check=True, cwd=tmp_path, capture_output=True,
                   env={"OMP_NUM_THREADS": "1", **os.environ, "PARITY_OUT": str(plain)})
    a = audit("run", f"{wrapper}:step", "--steps", str(STEPS), "--quiet", out=tmp_path / "out",
              env={"PARITY_OUT": str(audited)})
    assert a.returncode in (0, 1), a.stderr
    w_plain = torch.load(plain, weights_only=True)
    w_audit = torch.load(audited, weights_only=True)
    assert w_plain.keys() == w_audit.keys()
    for k in w_plain:
        assert torch.equal(w_plain[k], w_audit[k]), k
    # and training moved the weights, so the comparison means something
    assert any(not torch.equal(w_plain[k], torch.zeros_like(w_plain[k])) for k in w_plain)
