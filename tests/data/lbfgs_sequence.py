"""In the shape of pytorch/examples time_sequence_prediction: an LSTMCell sequence model fitted
with LBFGS, whose state keeps at most `history_size` direction/step pairs."""
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)


np.random.seed(0)
torch.manual_seed(0)
T, L, N = 20, 24, 8
x = np.empty((N, L), np.int64)
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype("float64")
input = torch.from_numpy(data[3:, :-1])
target = torch.from_numpy(data[3:, 1:])
seq = Sequence().double()
criterion = nn.MSELoss()
optimizer = optim.LBFGS(seq.parameters(), lr=0.8)


def closure():
    optimizer.zero_grad()
    loss = criterion(seq(input), target)
    loss.backward()
    return loss


for i in range(6):
    optimizer.step(closure)
