"""Issue #80 item 1: the legacy tensor types under the CUDA rehearsal, and a failure the rehearsal
causes reported as the audit's.

tests/data/public_shapes/legacy_gan.py has the shape of eriklindernoren/PyTorch-GAN's programs
(`Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor`, `Tensor(n, 1).fill_(1.0)`,
`Tensor(np.random.normal(...))`, `LongTensor(np.random.randint(...))`, `imgs.type(Tensor)`, each
wrapped in `Variable(...)`): rehearsed, it ran 0 steps ("type torch.cuda.FloatTensor not available")
and the summary blamed the program."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, audit, graded_severity

if torch.cuda.is_available():  # pragma: no cover - rehearsal is for machines without a GPU
    pytest.skip("a CUDA device is present: nothing to rehearse", allow_module_level=True)

GAN = ROOT / "tests" / "data" / "public_shapes" / "legacy_gan.py"


def marked(marker: str) -> int:
    return next(i for i, t in enumerate(GAN.read_text().splitlines(), 1) if t.endswith(f"# {marker}"))


@pytest.mark.slow
def test_legacy_cuda_types_are_rehearsed_as_gpu_tensors(tmp_path):
    (tmp_path / GAN.name).write_text(GAN.read_text())
    a = audit("run", GAN.name, "--steps", "6", "--no-profile", "--no-numerics", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    assert len(a.evidence["steps"]) == 6
    # what it computes is its CPU version's (`python legacy_gan.py` here takes `torch.FloatTensor`)
    plain = subprocess.run([sys.executable, GAN.name], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": ""})
    assert plain.returncode == 0, plain.stderr[-2000:]
    printed = [ln for ln in a.stdout.splitlines() if ln.startswith("[Epoch")]
    assert len(printed) >= 3 and printed == plain.stdout.splitlines()[:len(printed)]
    # made from host data, each is a host->device copy at its line; from sizes alone, none
    copies = {(t["what"], t["where"]["line"]) for s in a.evidence["steps"] for t in s["tallies"]
              if t["kind"] == "h2d-copy"}
    assert copies == {("Tensor.type(cuda)", marked("TYPE LINE")),
                      ("torch.cuda.FloatTensor(host data)", marked("NOISE LINE")),
                      ("torch.cuda.LongTensor(host data)", marked("LABELS LINE"))}
    # and the step is judged as GPU code: its two .item() a step are syncs
    [sync] = a.rule("host-sync")
    assert sync["severity"] == graded_severity(sync, a.findings_doc) and sync["evidence"]["judged_as_gpu_code"] is True


TOLD_A_GPU = """import torch
cuda = torch.cuda.is_available()
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    if cuda:
        torch.cuda.ByteStorage(3)  # a CUDA API the rehearsal does not stand in for
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_failure_the_rehearsal_causes_is_the_audits_and_names_no_rehearse(tmp_path):
    (tmp_path / "train.py").write_text(TOLD_A_GPU)
    a = audit("run", "train.py", "--steps", "3", "--no-profile", "--no-numerics", out=tmp_path / "out",
              cwd=tmp_path)
    assert a.returncode == 4, a.stdout[-3000:]  # the audit's failure, not the program's (3)
    ending = a.findings_doc["ending"]
    assert ending["status"] == "raised" and "Torch not compiled with CUDA enabled" in ending["message"]
    assert ending["audit_cause"].startswith("the audit's CUDA rehearsal caused this, not the program")
    assert "torch.cuda.is_available() at train.py:2" in ending["audit_cause"]
    assert "--no-rehearse" in ending["audit_cause"] and ending["audit_cause"] in a.stdout
    # a plain run takes its CPU path there, and so does the audit told --no-rehearse
    b = audit("run", "train.py", "--steps", "3", "--no-profile", "--no-numerics", "--no-rehearse",
              out=tmp_path / "plain", cwd=tmp_path)
    assert b.returncode == 0 and b.findings_doc["ending"]["audit_cause"] is None, b.stdout[-3000:]


MIXED = """import torch
model = torch.nn.Linear(8, 1).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8).cuda()), torch.randn(4, 1))
    loss.backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_failure_a_gpu_has_too_stays_the_programs(tmp_path):
    """Labels left on the host fail on a GPU: the rehearsal fails there on purpose, the program's (exit 3)."""
    (tmp_path / "train.py").write_text(MIXED)
    a = audit("run", "train.py", "--steps", "3", "--no-profile", "--no-numerics", out=tmp_path / "out",
              cwd=tmp_path)
    assert a.returncode == 3, a.stdout[-3000:]
    assert "Expected all tensors to be on the same device" in a.findings_doc["ending"]["message"]
    assert a.findings_doc["ending"]["audit_cause"] is None and "--no-rehearse" not in a.stdout
