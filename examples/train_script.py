"""A training program written as people write them: argparse, epochs, its own loop, an eval loop.

    audit run examples/train_script.py --steps 30 -- --epochs 2

It runs unmodified, as `python examples/train_script.py --epochs 2` runs it; the audit finds its
steps (one per optimizer step), audits 30 of them, then ends it as a Ctrl-C would. Two habits cost
it time: images decoded in the training process (num_workers=0), and the loss read back to the
host every step for the log.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    """Stands in for decoding and augmenting images: real CPU work per sample."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx)
        img = F.avg_pool2d(torch.rand(1, 3, 72, 72, generator=g), 3, stride=1, padding=1)[0, :, :64, :64]
        return (img - img.mean()) / (img.std() + 1e-6), idx % 10


def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    model.train()
    return correct / max(total, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--log", default=None, help="write the loss log here (JSON) at the end")
    args = ap.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train = DataLoader(Images(2048), batch_size=args.batch_size, shuffle=True)  # expect: dataloader-bound
    val = DataLoader(Images(256), batch_size=128)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    history = []
    try:
        for epoch in range(args.epochs):
            for x, y in train:
                x, y = x.to(device), y.to(device)
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                history.append(loss.item())  # expect: host-sync
            print(f"epoch {epoch}: loss {history[-1]:.3f}, val accuracy {evaluate(model, val, device):.2%}")
    finally:  # (runs when the audit ends the program after its steps, as after a Ctrl-C)
        if args.log:
            with open(args.log, "w") as f:
                json.dump(history, f)


if __name__ == "__main__":
    main()
