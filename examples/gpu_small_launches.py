"""A GPU trainer of a small character-level RNN whose recurrence is a Python loop over the time
steps: each of the sequence's 64 steps runs its own four tiny kernels (two 32 x 32 linear layers,
an add, a tanh) on a 32 x 32 state, each done in well under the ~5 us the host takes to launch it.
The GPU then waits on the host's launches, and a faster GPU would not train it any faster. The
loss is also logged with `.item()` every step, a smaller cost. On a machine without a GPU,
`audit run` rehearses it on the CPU and counts the launches."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)

VOCAB, HIDDEN, SEQ, BATCH = 64, 32, 64, 32
corpus = torch.randint(0, VOCAB, (BATCH * 16, SEQ + 1))  # 512 token sequences
loader = DataLoader(TensorDataset(corpus), batch_size=BATCH, shuffle=True, drop_last=True, pin_memory=True)


class CharRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.w_ih = nn.Linear(HIDDEN, HIDDEN)
        self.w_hh = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        h = x.new_zeros(x.shape[0], HIDDEN)
        states = []
        for t in range(x.shape[1]):  # one time step at a time
            h = torch.tanh(self.w_ih(x[:, t]) + self.w_hh(h))  # expect: launch-bound
            states.append(h)
        return self.head(torch.stack(states, dim=1))


model = CharRNN().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
batches = iter(loader)
losses = []


def next_batch():
    global batches
    try:
        return next(batches)[0]
    except StopIteration:
        batches = iter(loader)
        return next(batches)[0]


def step(i):
    batch = next_batch().to(device, non_blocking=True)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    opt.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    opt.step()
    losses.append(loss.item())  # expect: host-sync


if __name__ == "__main__":
    for i in range(20):
        step(i)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
