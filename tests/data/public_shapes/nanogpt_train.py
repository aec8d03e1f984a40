"""karpathy/nanoGPT `train.py`'s loop, reduced to a CPU stand-in (MIT license, Copyright (c) 2022
Andrej Karpathy): a tiny model on random tokens, its data made in the loop (`get_batch`), AdamW
under a GradScaler (off on the CPU), and the loss fetched for the log line every `log_interval`
iterations as `lossf = loss.item() * gradient_accumulation_steps`, read only by the print."""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

device = 'cpu'
batch_size, block_size, vocab_size = 8, 16, 64
gradient_accumulation_steps = 2
log_interval = 1
max_iters = 10
torch.manual_seed(1337)
data = torch.randint(vocab_size, (4096,))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.lm_head = nn.Linear(32, vocab_size)

    def forward(self, idx, targets):
        x = self.wte(idx)
        logits = self.lm_head(x + self.mlp(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


model = GPT().to(device)
scaler = torch.amp.GradScaler(device, enabled=False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
X, Y = get_batch()
t0 = time.time()
iter_num = 0
while True:
    for micro_step in range(gradient_accumulation_steps):
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt = t1 - t0
    t0 = t1
    if iter_num % log_interval == 0:
        # get loss as float. note: this is a CPU-GPU sync point
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms")
    iter_num += 1
    if iter_num > max_iters:
        break
