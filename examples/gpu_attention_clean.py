"""The clean twin of examples/gpu_attention.py: the same GPT blocks with their causal
self-attention computed by F.scaled_dot_product_attention(q, k, v, is_causal=True), one fused kernel
on the GPU for the scores, mask, softmax, dropout and values, which never writes the [B, heads, T, T]
score matrix."""
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

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(EMBED, dim=2)
        q = q.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        k = k.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        v = v.view(b, t, HEADS, c // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
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
