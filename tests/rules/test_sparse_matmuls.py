"""Sparse tensors in an audited step (pytorch/examples gcn: a COO adjacency and COO features,
`torch.mm`/`torch.spmm` of them): the numerics checks measure a sparse tensor by its stored values
(aminmax has no sparse kernel: the audit raised NotImplementedError into the program at its first
optimizer step), and a rehearsed sparse matmul counts the FLOPs of its stored values, not those of
a dense product of its shape (gcn was told its 4.7 MFLOP a step were 1.39 GFLOP of fp32 tensor-core
work)."""
from __future__ import annotations

import pytest
import torch

from conftest import ONE_THREAD, audit

pytestmark = pytest.mark.slow

NODES, FEATURES, HIDDEN, CLASSES, EDGES = 2000, 64, 16, 4, 8000
GCN = f'''import torch
from torch import nn
import torch.nn.functional as F

device = torch.device("DEVICE")
torch.manual_seed(0)
src, dst = torch.randint(0, {NODES}, (2, {EDGES}))
adj = torch.sparse_coo_tensor(torch.stack([src, dst]), torch.full(({EDGES},), 0.25), ({NODES}, {NODES}))
adj = (adj + torch.eye({NODES}).to_sparse()).coalesce().to(device)
features = (torch.rand({NODES}, {FEATURES}) * (torch.rand({NODES}, {FEATURES}) < 0.1)).to_sparse().to(device)
labels = torch.randint(0, {CLASSES}, ({NODES},), device=device)
w1 = nn.Parameter(torch.randn({FEATURES}, {HIDDEN}, device=device) * 0.1)
w2 = nn.Parameter(torch.randn({HIDDEN}, {CLASSES}, device=device) * 0.1)
opt = torch.optim.Adam([w1, w2], lr=0.01)


def step(i):
    opt.zero_grad()
    scale = SCALE
    a = adj * scale  # SCALE LINE
    h = F.relu(torch.spmm(a, torch.mm(features, w1)))  # LAYER 1
    out = torch.spmm(a, h @ w2)  # LAYER 2
    loss = F.cross_entropy(out, labels)
    loss.backward()
    opt.step()
'''
STEPS = 6


def run(tmp_path, device: str, scale: str):
    (tmp_path / "gcn.py").write_text(GCN.replace("DEVICE", device).replace("SCALE", scale))
    a = audit("run", f"{tmp_path / 'gcn.py'}:step", "--steps", str(STEPS), "--no-profile", "--quiet",
              out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    return a


def line(marker: str) -> int:
    return next(n for n, text in enumerate(GCN.splitlines(), 1) if marker in text)


def stored_values() -> tuple[int, int]:
    """The program's adjacency's and features' stored values (its own seed and construction)."""
    torch.manual_seed(0)
    src, dst = torch.randint(0, NODES, (2, EDGES))
    adj = torch.sparse_coo_tensor(torch.stack([src, dst]), torch.full((EDGES,), 0.25), (NODES, NODES))
    adj = (adj + torch.eye(NODES).to_sparse()).coalesce()
    features = (torch.rand(NODES, FEATURES) * (torch.rand(NODES, FEATURES) < 0.1)).to_sparse()
    return adj._nnz(), features._nnz()


def test_a_rehearsed_sparse_matmul_counts_its_stored_values(tmp_path):
    a = run(tmp_path, "cuda", "1.0")
    assert a.evidence["environment"]["rehearsal"]
    by_line: dict[int, set[int]] = {}
    for s in a.evidence["steps"]:
        for t in s["tallies"]:
            if t["kind"] == "device-matmul":
                by_line.setdefault(t["where"]["line"], set()).add(t["data"]["flops"])
    adj_nnz, features_nnz = stored_values()
    # each stored value of the sparse operand times a row of the dense one
    assert by_line[line("LAYER 1")] == {2 * features_nnz * HIDDEN, 2 * adj_nnz * HIDDEN}
    assert by_line[line("LAYER 2")] == {2 * NODES * HIDDEN * CLASSES, 2 * adj_nnz * CLASSES}
    dense = 2 * NODES * NODES * HIDDEN  # what the first spmm was counted as: 0.128 GFLOP
    assert max(f for fs in by_line.values() for f in fs) < dense / 100
    # the launches move a sparse operand's stored values and indices (a COO has no nbytes: 0 before;
    # torch.spmm is named as the torch.mm it runs)
    spmm = [t for s in a.evidence["steps"] for t in s["tallies"]
            if t["kind"] == "device-launch" and t["where"]["line"] == line("LAYER 2") and t["what"] == "torch.mm"]
    adj_bytes = adj_nnz * (4 + 2 * 8)  # float32 values, two int64 indices each
    dense_sides = NODES * CLASSES * 4 * 2  # the dense operand read and the output written
    assert spmm and {t["data"]["bytes"] / t["count"] for t in spmm} == {adj_bytes + dense_sides}
    # a few MFLOP a step: not the tensor-core work amp-opportunity is about
    assert not a.rule("amp-opportunity"), a.rule("amp-opportunity")
    assert not a.rule("nonfinite")


def test_an_inf_stored_in_a_sparse_tensor_is_traced_to_the_line_that_made_it(tmp_path):
    a = run(tmp_path, "cpu", 'float("inf") if i >= 3 else 1.0')
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 3
    assert ev["inputs"][0]["finite"] and ev["outputs"][0]["max"] == "inf"
    assert (str(tmp_path / "gcn.py"), line("SCALE LINE")) in {(loc["file"], loc["line"]) for loc in f["locations"]}
