"""amp-opportunity in CUDA rehearsal counts the matmuls of nn.LSTM and nn.GRU: their input and
hidden projections run in C++ at every time step, below the one `torch.lstm` / `torch.gru` call
the rehearsal's torch-function mode sees. Before, a recurrent language model (the shape of
pytorch/examples' word_language_model) was reported as "1 F.linear ... 100% of the GPU matmul/conv
FLOPs": its decoder alone. Its autocast twin runs beside it in the same step, at the same lines:
counted in the run's FLOPs, never as fp32. oneDNN is held to AVX2 (ONEDNN_MAX_CPU_ISA), as on a CPU
without AVX-512, where it cannot build the twin's lower-precision LSTM: the rehearsal runs that
call in torch's own kernels (rehearsal.rnn) instead of stopping the program there."""
from __future__ import annotations

import pytest

from conftest import ONE_THREAD, audit

V, E, H, T, B = 200, 64, 128, 35, 20
RNN_LM = f'''import torch
from torch import nn
torch.manual_seed(0)
device = "cuda"
V, E, H, T, B = {V}, {E}, {H}, {T}, {B}


class RNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.lstm = nn.LSTM(E, H, num_layers=2)
        self.gru = nn.GRU(H, H, bidirectional=True)
        self.cell = nn.LSTMCell(E, H)
        self.head = nn.Linear(2 * H, V)

    def forward(self, x):
        e = self.emb(x)
        out, _ = self.lstm(e)
        out, _ = self.gru(out)
        h, c = self.cell(e[0])
        return self.head(out) + h.sum()


model = RNNModel().to(device)
twin = RNNModel().to(device)  # the same model, run under autocast
opt = torch.optim.SGD([*model.parameters(), *twin.parameters()], lr=0.1)


def step(i):
    x = torch.randint(0, V, (T, B), device=device)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss + nn.functional.cross_entropy(twin(x).flatten(0, 1).float(), x.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


@pytest.fixture(scope="module")
def rnn_audit(tmp_path_factory):
    """One rehearsed audit of both models, each call at the same source lines: the fp32 model's work
    and its autocast twin's, in one step."""
    path = tmp_path_factory.mktemp("rnn") / "rnn_lm.py"
    path.write_text(RNN_LM)
    a = audit("run", f"{path}:step", "--steps", "3", "--no-profile", "--quiet", out=path.parent / "out",
              env={**ONE_THREAD, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    return a


def test_lstm_and_gru_matmuls_are_counted(rnn_audit):
    a = rnn_audit
    [f] = a.rule("amp-opportunity")
    ev = f["evidence"]
    # by hand: per time step and sequence (T x B of them), 2 FLOPs an element of each layer and
    # direction's input weight (gates x H, input) and hidden weight (gates x H, H)
    lstm = T * B * 2 * (4 * H * E + 4 * H * H) + T * B * 2 * (4 * H * H + 4 * H * H)
    gru = 2 * T * B * 2 * (3 * H * H + 3 * H * H)  # two directions
    cell = B * 2 * (4 * H * E + 4 * H * H)  # one time step
    head = T * B * 2 * (2 * H) * V
    sites = {s["what"]: s["gflop"] / ev["steps"] for s in ev["sites"]}
    assert sites["torch.lstm (nn.LSTM)"] == pytest.approx(lstm / 1e9, abs=1e-4)
    assert sites["torch.gru (nn.GRU)"] == pytest.approx(gru / 1e9, abs=1e-4)
    assert sites["torch.lstm_cell (nn.LSTMCell)"] == pytest.approx(cell / 1e9, abs=1e-4)
    assert sites["F.linear"] == pytest.approx(head / 1e9, abs=1e-4)
    assert ev["fp32_gflop_per_step"] == pytest.approx((lstm + gru + cell + head) / 1e9, abs=1e-4)
    # the recurrent layers' lines: self.lstm(e) and self.gru(out) in forward
    lines = {s["what"]: s["line"] for s in ev["sites"]}
    src = RNN_LM.splitlines()
    assert "self.lstm(e)" in src[lines["torch.lstm (nn.LSTM)"] - 1]
    assert "self.gru(out)" in src[lines["torch.gru (nn.GRU)"] - 1]
    assert "torch.lstm (nn.LSTM) x1/step" in f["message"]


def test_rnn_under_autocast_is_not_counted_as_fp32(rnn_audit):
    """The autocast twin's recurrent layers and head do the same work at the same lines: it counts
    in the run's matmul FLOPs, never as fp32 (the fp32 sites' figures are one model's, each call
    once a step, and half the FLOPs are fp32)."""
    [f] = rnn_audit.rule("amp-opportunity")
    ev = f["evidence"]
    lstm = T * B * 2 * (4 * H * E + 4 * H * H) + T * B * 2 * (4 * H * H + 4 * H * H)
    gru = 2 * T * B * 2 * (3 * H * H + 3 * H * H)
    cell = B * 2 * (4 * H * E + 4 * H * H)
    head = T * B * 2 * (2 * H) * V
    one = (lstm + gru + cell + head) / 1e9
    assert ev["gflop_per_step"] == pytest.approx(2 * one, abs=2e-4)
    assert ev["fp32_share"] == pytest.approx(0.5, abs=1e-4)
    assert all(s["count"] == ev["steps"] for s in ev["sites"]), ev["sites"]  # (the twin's calls: not among them)
    assert sum(s["gflop"] for s in ev["sites"]) / ev["steps"] == pytest.approx(one, abs=2e-4)
    assert ev["fp32_calls_per_step"] == len(ev["sites"]) == 4
