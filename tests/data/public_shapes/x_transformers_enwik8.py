"""Shaped like lucidrains/x-transformers `train_enwik8.py` (issue #35's first program), small enough
for a CPU: a Dataset whose `__getitem__` returns `.cuda()` batches, a `cycle()` around each
DataLoader, rotary embeddings whose cos/sin every attention layer recomputes, the training loss
printed with `.item()` every step, validation every VALIDATE_EVERY steps and a sample generated
from the validation set. Random bytes stand in for enwik8."""
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

NUM_BATCHES = 8
BATCH_SIZE = 4
LEARNING_RATE = 1e-4
VALIDATE_EVERY = 100
GENERATE_EVERY = 500
SEQ_LEN = 64
DEPTH = 12


def cycle(loader):
    while True:
        for data in loader:
            yield data


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs, scale=1):
    return (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, n, device):
        t = torch.arange(n, device=device).type_as(self.inv_freq)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, freqs):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = apply_rotary_pos_emb(q, freqs), apply_rotary_pos_emb(k, freqs)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens=256, dim=32, depth=DEPTH):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)
        self.rotary = RotaryEmbedding(dim)
        self.layers = nn.ModuleList([Attention(dim) for _ in range(depth)])
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x):
        h = self.emb(x)
        freqs = self.rotary(x.shape[1], x.device)
        for layer in self.layers:
            h = h + layer(h, freqs)
        return self.to_logits(h)


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        inp, target = x[:, :-1], x[:, 1:]
        return F.cross_entropy(self.net(inp).transpose(1, 2), target)

    @torch.no_grad()
    def generate(self, start, length):
        out = start[None]
        for _ in range(length):
            out = torch.cat((out, self.net(out)[:, -1].argmax(-1, keepdim=True)), dim=-1)
        return out


class TextSamplerDataset(Dataset):
    def __init__(self, data, seq_len):
        super().__init__()
        self.data = data
        self.seq_len = seq_len

    def __getitem__(self, index):
        rand_start = torch.randint(0, self.data.size(0) - self.seq_len - 1, (1,))
        full_seq = self.data[rand_start: rand_start + self.seq_len + 1].long()
        return full_seq.cuda()

    def __len__(self):
        return self.data.size(0) // self.seq_len


torch.manual_seed(0)
random.seed(0)
data = torch.randint(0, 256, (20000,), dtype=torch.uint8)
data_train, data_val = data[:16000], data[16000:]

model = AutoregressiveWrapper(TransformerWrapper()).cuda()

train_dataset = TextSamplerDataset(data_train, SEQ_LEN)
val_dataset = TextSamplerDataset(data_val, SEQ_LEN)
train_loader = cycle(DataLoader(train_dataset, batch_size=BATCH_SIZE, drop_last=True))
val_loader = cycle(DataLoader(val_dataset, batch_size=BATCH_SIZE, drop_last=True))

optim = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)

for i in range(NUM_BATCHES):
    model.train()
    loss = model(next(train_loader))
    loss.backward()

    print(f"training loss: {loss.item()}")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optim.step()
    optim.zero_grad()

    if i % VALIDATE_EVERY == 0:
        model.eval()
        with torch.no_grad():
            loss = model(next(val_loader))
            print(f"validation loss: {loss.item()}")

    if i % GENERATE_EVERY == 0:
        model.eval()
        inp = random.choice(val_dataset)[:-1]
        sample = model.generate(inp, 4)
        print(sample.shape)
