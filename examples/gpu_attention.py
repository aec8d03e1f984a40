"""A GPT block trained on the GPU with its causal self-attention written by hand, as every GPT
tutorial has it: the scores matmul, the scale, the causal mask's masked_fill, softmax, dropout, the
values matmul, under bf16 autocast. Each step writes and reads the [B, heads, T, T] score matrix
several times; F.scaled_dot_product_attention(q, k, v, is_causal=True) runs the chain as one fused
kernel (examples/gpu_attention_clean.py). Small sizes, so that `audit run` rehearses it on a CPU in
seconds; on the H100 it was B16, T512, 8 heads of 64, 4 layers."""
import math

import torch
import torch.nn.functional as F
from torch import nn

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
B, T, HEADS, HEAD_DIM, LAYERS, VOCAB = 4, 128, 4, 16, 2, 256
EMBED = HEADS * HEAD_DIM


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(EMBED, 3 * EMBED)
        self.proj = nn.Linear(EMBED, EMBED)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(EMBED, dim=2)
        q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = torch.softmax(att, dim=-1)
        att = self.dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBED), nn.LayerNorm(EMBED)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(nn.Linear(EMBED, 4 * EMBED), nn.GELU(), nn.Linear(4 * EMBED, EMBED))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.head = nn.Linear(EMBED, VOCAB)

    def forward(self, idx):
        return self.head(self.blocks(self.embed(idx)))


model = GPT().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
data = torch.randint(0, VOCAB, (64, T + 1))


def step(i):
    rows = data[(i * B) % 64:(i * B) % 64 + B].to(device)
    x, y = rows[:, :-1], rows[:, 1:]
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


if __name__ == "__main__":
    for i in range(20):
        step(i)
