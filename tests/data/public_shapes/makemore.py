"""Shaped like karpathy/makemore `makemore.py` (issue #35's sixth program), small enough for a CPU:
an InfiniteDataLoader that hands its **kwargs to a DataLoader (pinned, with workers), the batch
copied with `.to(device)`, the step timed with `torch.cuda.synchronize()` and `time.time()`, the
loss printed every 10 steps. A few made-up names stand in for names.txt."""
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

DEVICE = "cuda"
MAX_STEPS = 8


class CharDataset(Dataset):
    def __init__(self, words, chars, max_word_length):
        self.words = words
        self.stoi = {ch: i + 1 for i, ch in enumerate(chars)}
        self.max_word_length = max_word_length

    def __len__(self):
        return len(self.words)

    def get_vocab_size(self):
        return len(self.stoi) + 1

    def __getitem__(self, idx):
        ix = torch.tensor([self.stoi[w] for w in self.words[idx]], dtype=torch.long)
        x = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        y = torch.zeros(self.max_word_length + 1, dtype=torch.long)
        x[1:1 + len(ix)] = ix
        y[:len(ix)] = ix
        y[len(ix) + 1:] = -1
        return x, y


class InfiniteDataLoader:
    def __init__(self, dataset, **kwargs):
        train_sampler = torch.utils.data.RandomSampler(dataset, replacement=True, num_samples=int(1e10))
        self.train_loader = DataLoader(dataset, sampler=train_sampler, **kwargs)
        self.data_iter = iter(self.train_loader)

    def next(self):
        try:
            batch = next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.train_loader)
            batch = next(self.data_iter)
        return batch


class MLP(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd=16, n_hidden=64):
        super().__init__()
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.wte = nn.Embedding(vocab_size + 1, n_embd)
        self.mlp = nn.Sequential(nn.Linear(block_size * n_embd, n_hidden), nn.Tanh(), nn.Linear(n_hidden, vocab_size))

    def forward(self, idx, targets=None):
        embs = []
        for k in range(self.block_size):
            embs.append(self.wte(idx))
            idx = torch.roll(idx, 1, 1)
            idx[:, 0] = self.vocab_size
        logits = self.mlp(torch.cat(embs, -1))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


torch.manual_seed(3407)
words = ["emma", "olivia", "ava", "isabella", "sophia", "charlotte", "mia", "amelia"] * 16
chars = sorted(set("".join(words)))
train_dataset = CharDataset(words, chars, max(len(w) for w in words))
model = MLP(train_dataset.get_vocab_size(), train_dataset.max_word_length + 1).to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8)
batch_loader = InfiniteDataLoader(train_dataset, batch_size=32, pin_memory=True, num_workers=0)

step = 0
while True:
    t0 = time.time()
    batch = batch_loader.next()
    batch = [t.to(DEVICE) for t in batch]
    X, Y = batch
    logits, loss = model(X, Y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
    t1 = time.time()
    if step % 10 == 0:
        print(f"step {step} | loss {loss.item():.4f} | step time {(t1 - t0) * 1000:.2f}ms")
    step += 1
    if step >= MAX_STEPS:
        break
