"""The per-step counts of a CUDA rehearsal (launch-bound's kernel launches, amp-opportunity's fp32
matmuls) describe the training step, not a one-off burst in one step: minGPT's chargpt samples 500
tokens in its first step's callback (after the optimizer step, so in step 0), 46,593 rehearsed
launches there against 93 in each later step, and was reported as 1,643 launches a step. A
program of that shape: an RNN whose recurrence is a Python loop (launch-bound) trained a step at a
time, with a generation of GEN_CALLS forward passes under no_grad after the first update. Its
twin samples in every other step: work that recurs is no burst, and is counted."""
from __future__ import annotations

import pytest

from conftest import audit
from auditor.evidence import model as m

pytestmark = pytest.mark.slow

STEPS, SEQ, GEN_CALLS = 8, 56, 150
PROGRAM = f'''import torch
import torch.nn.functional as F
from torch import nn

device = "cuda"
torch.manual_seed(0)
V, H, SEQ, B = 4096, 16, {SEQ}, 16


class RNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.w_ih, self.w_hh, self.head = nn.Embedding(V, H), nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, V)

    def forward(self, tokens):
        x = self.emb(tokens)
        h = x.new_zeros(x.shape[0], H)
        out = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.w_ih(x[:, t]) + self.w_hh(h))  # LINE:loop
            out.append(h)
        return self.head(torch.stack(out, dim=1))


def sample(batch):
    with torch.no_grad():
        tokens = batch[:1, :1]
        for _ in range({GEN_CALLS}):
            nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)[:, -4:]


model = RNN().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(100):
    batch = torch.randint(0, V, (B, SEQ + 1), device=device)
    loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, V), batch[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    if it % EVERY == EVERY - 1:  # an evaluation in the step, before its update
        sample(batch)
    opt.step()
    if it == AFTER:  # a callback after the update: sampling, as chargpt's at iteration 0
        sample(batch)
'''


def _audit(tmp_path, every: int = 1000, after: int = -1):
    (tmp_path / "train.py").write_text(PROGRAM.replace("EVERY", str(every)).replace("AFTER", str(after)))
    a = audit("run", str(tmp_path / "train.py"), "--steps", str(STEPS), "--no-profile", "--no-numerics", "-q",
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.evidence["environment"]["rehearsal"] is True
    return a


def _per_step(evidence: dict, kind: str) -> list[int]:
    return [sum(t["count"] for t in s["tallies"] if t["kind"] == kind) for s in evidence["steps"]]


def test_a_burst_in_one_step_is_left_out_of_the_per_step_counts(tmp_path):
    a = _audit(tmp_path, after=0)  # (the callback runs at iteration 0 only, in step 0's tail)
    launches = _per_step(a.evidence, m.DEVICE_LAUNCH)
    matmuls = _per_step(a.evidence, m.DEVICE_MATMUL)
    # the training steps make the same calls; step 0 makes them and the sampling's, many times more
    assert len(set(launches[1:])) == 1 and launches[0] > 10 * launches[1], launches
    (lb,) = a.rule("launch-bound")
    ev = lb["evidence"]
    assert ev["steps"] == STEPS - 1 and ev["left_out_steps"] == {"0": launches[0]}
    assert ev["launches_per_step"] == launches[1]  # (over all 8 steps it read (l0 + 7 l1) / 8)
    loop = next(n for n, ln in enumerate(PROGRAM.splitlines(), 1) if "# LINE:loop" in ln)
    # (the burst named with the places that made most of it: the sampling runs the same recurrence)
    assert f"step 0 ({launches[0]:,}: F.linear x" in lb["message"] and f" at line {loop}, " in lb["message"]
    assert f"against {launches[1]:g} in the median step" in lb["message"]
    assert lb["locations"][0]["line"] == loop
    (amp,) = a.rule("amp-opportunity")
    assert amp["evidence"]["left_out_steps"] == {"0": matmuls[0]}
    assert amp["evidence"]["fp32_calls_per_step"] == matmuls[1]


def test_work_that_recurs_is_counted(tmp_path):
    """The same sampling in every other step (half the steps): no step is left out, the per-step
    counts are the run's mean."""
    a = _audit(tmp_path, every=2)
    launches = _per_step(a.evidence, m.DEVICE_LAUNCH)
    assert launches[1] > 10 * launches[0] and launches[3] == launches[1] and launches[2] == launches[0], launches
    (lb,) = a.rule("launch-bound")
    assert lb["evidence"]["left_out_steps"] == {} and lb["evidence"]["steps"] == STEPS
    assert lb["evidence"]["launches_per_step"] == pytest.approx(sum(launches) / STEPS, abs=0.01)
    assert "left out" not in lb["message"]
