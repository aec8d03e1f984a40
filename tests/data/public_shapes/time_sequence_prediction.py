"""Shaped like pytorch/examples `time_sequence_prediction/train.py`: two LSTMCells stepped over the
sequence in a Python loop, trained with LBFGS whose closure prints `loss.item()` at each call, and a
prediction with its test loss printed after every step. The sine waves generate_sine_wave.py writes
are made here, in memory; the plots are left out. Its defaults are small; the flags set its size:
`--steps 15 --length 1000 --batch 100 --max-iter 20 --future 1000` is the example's own."""
import argparse

import numpy as np
import torch
import torch.optim as optim
from torch import nn


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, 51)
        self.lstm2 = nn.LSTMCell(51, 51)
        self.linear = nn.Linear(51, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 51, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 51, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="steps to run")
    parser.add_argument("--length", type=int, default=100, help="samples in each sine wave (L)")
    parser.add_argument("--batch", type=int, default=24, help="sine waves (N; 3 of them the test set)")
    parser.add_argument("--max-iter", type=int, default=4, help="LBFGS's closure calls a step")
    parser.add_argument("--future", type=int, default=10, help="samples predicted after each step")
    opt = parser.parse_args()
    # generate_sine_wave.py
    np.random.seed(2)
    T, L, N = 20, opt.length, opt.batch
    x = np.empty((N, L), np.int64)
    x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
    data = np.sin(x / 1.0 / T).astype("float64")
    # train.py
    np.random.seed(0)
    torch.manual_seed(0)
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    seq = Sequence()
    seq.double()
    criterion = nn.MSELoss()
    optimizer = optim.LBFGS(seq.parameters(), lr=0.8, max_iter=opt.max_iter)
    for i in range(opt.steps):
        print("STEP: ", i)

        def closure():
            optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss:", loss.item())
            loss.backward()
            return loss
        optimizer.step(closure)
        with torch.no_grad():
            future = opt.future
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print("test loss:", loss.item())
            y = pred.detach().numpy()
