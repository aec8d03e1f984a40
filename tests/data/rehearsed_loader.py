"""In the shape of karpathy/makemore's bigram run: a DataLoader (pinned, no workers) over a tiny
dataset of names whose `__getitem__` builds its tensors with torch ops, each batch copied with
`.to(DEVICE)`, a tiny model trained with AdamW. DEVICE is the first argument ("cuda" or "cpu"),
so the same program runs rehearsed and with --no-rehearse on a CPU machine."""
import sys

import torch
from torch.utils.data import DataLoader, Dataset

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
torch.manual_seed(0)
WORDS = ["emma", "olivia", "ava", "isabella", "sophia", "mia", "charlotte", "amelia", "harper", "evelyn"] * 40
CHARS = sorted(set("".join(WORDS)))
MAX_LEN = max(len(w) for w in WORDS)


class Names(Dataset):
    def __init__(self):
        self.stoi = {ch: i + 1 for i, ch in enumerate(CHARS)}

    def __len__(self):
        return len(WORDS)

    def __getitem__(self, idx):
        ix = torch.tensor([self.stoi[w] for w in WORDS[idx]], dtype=torch.long)
        x = torch.zeros(MAX_LEN + 1, dtype=torch.long)
        y = torch.zeros(MAX_LEN + 1, dtype=torch.long)
        x[1:1 + len(ix)] = ix
        y[:len(ix)] = ix
        y[len(ix) + 1:] = -1
        return x, y


loader = DataLoader(Names(), batch_size=32, shuffle=True, pin_memory=True, num_workers=0)
model = torch.nn.Embedding(len(CHARS) + 1, len(CHARS) + 1).to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
for epoch in range(3):  # 13 batches an epoch, 30 steps
    for step, (x, y) in enumerate(loader):
        x, y = x.to(DEVICE), y.to(DEVICE)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if epoch * len(loader) + step == 29:
            break
