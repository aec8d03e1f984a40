"""The host-bound programs the steady-state benches run (bench_steady_parts.py, bench_instructions.py).

Each is the setup of a training script: it defines `model` (called on `x`, its output's squares
averaged into the loss) and `opt`, on DEVICE, from `width` and `layers`. The scripts around it do
`loss = model(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()` each iteration.
"""
from __future__ import annotations

# program: (setup, default width, default layers)
SETUP: dict[str, tuple[str, int, int]] = {
    # the CPU proxy: one outermost module call a step, 120 module calls inside it; on a GPU,
    # a host-bound step (its kernels take a few microseconds each)
    "proxy": ("""\
model = nn.Sequential(*[nn.Sequential(nn.Linear({width}, {width}), nn.LayerNorm({width}), nn.GELU())
                        for _ in range({layers})]).to(DEVICE)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(16, {width}, device=DEVICE)
""", 32, 40),
    # an RNN cell in a loop: 32 outermost calls of a module without submodules a step, and a head
    # (the GRU trainer's shape: many tiny kernels)
    "cell-loop": ("""\
cell, head = nn.GRUCell({width}, {width}).to(DEVICE), nn.Linear({width}, 1).to(DEVICE)
opt = torch.optim.AdamW([*cell.parameters(), *head.parameters()], lr=1e-3)
x, y = torch.randn(8, 32, {width}, device=DEVICE), torch.randn(8, 1, device=DEVICE)


def model(x):
    h = torch.zeros(8, {width}, device=DEVICE)
    for t in range(32):
        h = cell(x[:, t], h)
    return head(h) - y
""", 32, 1),
    # a nanoGPT-style causal Transformer, B16 x T256, bf16 autocast: its attention fills the mask
    # with -inf on every step by design (the 6-layer encoder, and its causal-mask case)
    "causal-lm": ("""\
class Block(nn.Module):
    def __init__(self, d, heads, t):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


net = nn.Sequential(*[Block({width}, 8, 256) for _ in range({layers})]).to(DEVICE)
opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
x = torch.randn(16, 256, {width}, device=DEVICE)


def model(x):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        return net(x).float()
""", 512, 6),
    # a step of many tiny calls on one small tensor (layers x (mul, add, tanh)): each checked call
    # costs several times its own time, so a checked step costs steps (numerics/schedule.Spacing)
    "tiny-calls": ("""\
w = nn.Parameter(torch.randn({width}, device=DEVICE))
opt = torch.optim.SGD([w], lr=1e-3)
x = torch.randn({width}, device=DEVICE)


def model(x):
    for _ in range({layers}):
        x = torch.tanh(x * w + 0.01)
    return x
""", 8, 300),
    # a PPO minibatch update (CleanRL's ppo.py): an actor and a critic of two hidden layers, a
    # Categorical's log_prob and entropy of 128 actions: many tiny calls a step, the distribution's
    # argument checks among them
    "policy-gradient": ("""\
from torch.distributions import Categorical

actor = nn.Sequential(nn.Linear(4, {width}), nn.Tanh(), nn.Linear({width}, {width}), nn.Tanh(),
                      nn.Linear({width}, 2)).to(DEVICE)
critic = nn.Sequential(nn.Linear(4, {width}), nn.Tanh(), nn.Linear({width}, {width}), nn.Tanh(),
                       nn.Linear({width}, 1)).to(DEVICE)
opt = torch.optim.Adam([*actor.parameters(), *critic.parameters()], lr=2.5e-4, eps=1e-5)
x, actions = torch.randn(128, 4, device=DEVICE), torch.randint(0, 2, (128,), device=DEVICE)


def model(x):
    probs = Categorical(logits=actor(x))
    return probs.log_prob(actions) - 0.01 * probs.entropy() + critic(x).view(-1)
""", 64, 2),
    # a module called many times a step, each call its own outermost forward (an agent acting step by
    # step, a per-sample loop): the audit's cost per outermost call shows (capture/one_call.py)
    "many-forwards": ("""\
q = nn.Sequential(nn.Linear(4, {width}), nn.ReLU(), nn.Linear({width}, 2)).to(DEVICE)
opt = torch.optim.SGD(q.parameters(), lr=1e-3)
x = torch.randn(1, 4, device=DEVICE)


def model(x):
    for _ in range({layers}):
        y = q(x)
    return y
""", 16, 50),
    # a DQN update (CleanRL's dqn.py, one environment): acting calls whose graphs are never used, the
    # action fetched with .item(), a no-grad target network's pass, the Q-network's loss
    "dqn": ("""\
def mlp():
    return nn.Sequential(nn.Linear(4, {width}), nn.ReLU(), nn.Linear({width}, 84), nn.ReLU(),
                         nn.Linear(84, 2)).to(DEVICE)


qnet, target = mlp(), mlp()
opt = torch.optim.Adam(qnet.parameters(), lr=1e-3)
x = torch.randn(32, 4, device=DEVICE)


def model(x):
    for _ in range({layers}):  # (acting: one observation each)
        qnet(torch.randn(1, 4, device=DEVICE)).argmax().item()
    with torch.no_grad():
        y = target(x).max(1).values
    return qnet(x).max(1).values - y
""", 120, 8),
}


def setup(program: str, width: int | None, layers: int | None, device: str) -> str:
    """The setup's text for `program`, its width and layers defaulted, with DEVICE defined."""
    text, w, n = SETUP[program]
    return f"DEVICE = {device!r}\n" + text.format(width=width or w, layers=layers or n)


def describe(program: str, width: int | None, layers: int | None) -> str:
    """One line naming the program as `setup` builds it, and its optimizer."""
    _, w, n = SETUP[program]
    width, layers = width or w, layers or n
    return {"proxy": f"{layers} x (Linear({width}) + LayerNorm + GELU), batch 16, AdamW",
            "cell-loop": f"GRUCell({width}) x 32 calls + Linear head, batch 8, AdamW",
            "causal-lm": f"{layers}-layer causal Transformer d{width}, B16 x T256, bf16 autocast, masked_fill(-inf), AdamW",
            "tiny-calls": f"{layers} x (mul, add, tanh) of a {width}-element tensor, SGD",
            "policy-gradient": f"PPO update: actor and critic MLPs ({layers} x {width} Tanh), Categorical "
                               f"log_prob and entropy of 128 actions, Adam",
            "many-forwards": f"{layers} calls of Linear(4, {width}) + ReLU + Linear({width}, 2) a step, SGD",
            "dqn": f"DQN update: {layers} acting calls (.item() of each argmax), a no-grad target pass, "
                   f"MLPs 4-{width}-84-2, Adam"}[program]

