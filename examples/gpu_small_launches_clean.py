"""The clean twin of gpu_small_launches.py: the same character-level RNN (the same embedding,
tanh recurrence and head, at the same sizes) with its recurrence in one `nn.RNN` call, which runs
the whole sequence in a few kernels (cuDNN) instead of four per time step; the loss is summed on
the device and read every 10 steps. `audit run` rehearses it on a machine without a GPU and finds
nothing to say about its launches."""
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
        self.rnn = nn.RNN(HIDDEN, HIDDEN, nonlinearity="tanh", batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        states, _ = self.rnn(self.embed(tokens))  # the whole sequence in one call
        return self.head(states)


model = CharRNN().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
batches = iter(loader)
running = torch.zeros((), device=device)
losses = []


def next_batch():
    global batches
    try:
        return next(batches)[0]
    except StopIteration:
        batches = iter(loader)
        return next(batches)[0]


def step(i):
    global running
    batch = next_batch().to(device, non_blocking=True)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    opt.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    opt.step()
    running += loss.detach()
    if (i + 1) % 10 == 0:
        losses.append(running.item() / 10)
        running.zero_()


if __name__ == "__main__":
    for i in range(20):
        step(i)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
