"""amp-opportunity in CUDA rehearsal counts the matmuls of nn.MultiheadAttention: its projections
and attention matmuls run inside F.multi_head_attention_forward, below the one call the rehearsal's
torch-function mode sees. Lightning Fabric's language model was reported as "9 F.linear, 4.31
GFLOP, 100% of the GPU matmul/conv FLOPs" without them. The shape here: an embedding, a
TransformerEncoderLayer and a head, on "cuda"."""
from __future__ import annotations

import runpy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import ONE_THREAD, audit

V, E, T, B = 128, 128, 64, 16
LM = f'''import torch
from torch import nn
torch.manual_seed(0)
device = "cuda"
V, E, T, B = {V}, {E}, {T}, {B}


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.layer = nn.TransformerEncoderLayer(E, nhead=4, dim_feedforward=512, batch_first=True, dropout=0.0)
        self.head = nn.Linear(E, V)

    def forward(self, x):
        return self.head(self.layer(self.emb(x)))


model = LM().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(i):
    x = torch.randint(0, V, (B, T), device=device)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_multihead_attention_matmuls_are_counted(tmp_path):
    path = tmp_path / "lm.py"
    path.write_text(LM)
    a = audit("run", f"{path}:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    [f] = a.rule("amp-opportunity")
    # the forward's matmul FLOPs as the dispatcher sees them (torch's own counter, on the CPU), and
    # the attention's q @ k^T and attn @ v, which it has no CPU formula for: 2 x (B x T x T x E) x 2
    cpu = tmp_path / "lm_cpu.py"
    cpu.write_text(LM.replace('device = "cuda"', 'device = "cpu"'))
    g = runpy.run_path(str(cpu))
    with FlopCounterMode(display=False) as counter:
        g["model"](torch.randint(0, V, (B, T)))
    counted = counter.get_flop_counts()["Global"]
    assert set(map(str, counted)) == {"aten.mm", "aten.addmm"}
    expected = counter.get_total_flops() + 4 * B * T * T * E
    ev = f["evidence"]
    assert ev["gflop_per_step"] == pytest.approx(expected / 1e9, abs=1e-4)
    assert ev["fp32_share"] == 1.0
    sites = {s["what"]: s["gflop"] / ev["steps"] for s in ev["sites"]}
    assert sites["F.multi_head_attention_forward"] == pytest.approx((4 * B * T * E * E * 2 + 4 * B * T * T * E) / 1e9,
                                                                     abs=1e-4)
    assert "F.multi_head_attention_forward x1/step" in f["message"]
