"""amp-opportunity in CUDA rehearsal counts the matmuls of nn.LSTM and nn.GRU: their input and
hidden projections run in C++ at every time step, below the one `torch.lstm` / `torch.gru` call
the rehearsal's torch-function mode sees. Before, a recurrent language model (the shape of
pytorch/examples' word_language_model) was reported as "1 F.linear ... 100% of the GPU matmul/conv
FLOPs": its decoder alone."""
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
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(i):
    x = torch.randint(0, V, (T, B), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=AMP):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def _audit(tmp_path, amp: bool):
    path = tmp_path / "rnn_lm.py"
    path.write_text(RNN_LM.replace("enabled=AMP", f"enabled={amp}"))
    a = audit("run", f"{path}:step", "--steps", "3", "--no-profile", "--quiet", out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings_doc["environment"]["rehearsal"] is True
    return a


def test_lstm_and_gru_matmuls_are_counted(tmp_path):
    a = _audit(tmp_path, amp=False)
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
    assert ev["gflop_per_step"] == pytest.approx((lstm + gru + cell + head) / 1e9, abs=1e-4)
    assert ev["fp32_share"] == 1.0
    # the recurrent layers' lines: self.lstm(e) and self.gru(out) in forward
    lines = {s["what"]: s["line"] for s in ev["sites"]}
    src = RNN_LM.splitlines()
    assert "self.lstm(e)" in src[lines["torch.lstm (nn.LSTM)"] - 1]
    assert "self.gru(out)" in src[lines["torch.gru (nn.GRU)"] - 1]
    assert "torch.lstm (nn.LSTM) x1/step" in f["message"]


def test_rnn_under_autocast_is_silent(tmp_path):
    a = _audit(tmp_path, amp=True)
    assert a.rule("amp-opportunity") == []
