"""llm.c train_gpt2.py's shape: argparse options of its own for --compile and --dtype, autocast only
on CUDA, a model with a per-token loop."""
import argparse
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tiny(nn.Module):
    """A character model whose recurrence runs one token at a time (tiny kernels), with a wide head."""

    def __init__(self, vocab=64, n=32, out=8192):
        super().__init__()
        self.wte = nn.Embedding(vocab, n)
        self.w_ih = nn.Linear(n, n)
        self.w_hh = nn.Linear(n, n, bias=False)
        self.head = nn.Linear(n, out)

    def forward(self, idx, targets):
        x = self.wte(idx)
        h = x.new_zeros(x.shape[0], x.shape[2])
        states = []
        for t in range(x.shape[1]):
            h = torch.tanh(self.w_ih(x[:, t]) + self.w_hh(h))  # TOKEN LINE
            states.append(h)
        logits = self.head(torch.stack(states, dim=1))  # HEAD LINE
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_iterations", type=int, default=10, help="number of iterations to run")
    parser.add_argument("--compile", type=int, default=0, help="torch.compile the model")  # COMPILE LINE
    parser.add_argument("--dtype", type=str, default="float32", help="float32|float16|bfloat16")  # DTYPE LINE
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype) if device_type == "cuda" else nullcontext()
    torch.manual_seed(42)
    model = Tiny().to(device)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (4, 64), device=device)
    y = torch.randint(0, 64, (4, 64), device=device)
    for step in range(args.num_iterations):
        with ctx:
            loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step + 1:4d}/{args.num_iterations} | train loss {loss.item():.6f} | norm {norm:.4f}")
