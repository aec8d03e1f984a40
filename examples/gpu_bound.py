"""A GPU-bound trainer: an 8-layer, 4096-wide fp32 MLP trained on 4096-row batches, with nothing in
the loop that waits for the device (the losses stay on it until the end). The host queues a step in
a few milliseconds; the GPU runs it in tens. `audit run` reports the step on the device's clock,
device-bound, and its amp-opportunity finding prices the fp32 matmuls against that step.

On a machine without a GPU it is rehearsed; pass `--width 256 --batch 256` to keep that quick."""
import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--batch", type=int, default=4096)
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
layers = []
for _ in range(args.layers):
    layers += [nn.Linear(args.width, args.width), nn.ReLU()]
model = nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
x = torch.randn(args.batch, args.width, device=device)
y = torch.randint(0, 10, (args.batch,), device=device)
losses = torch.zeros(args.steps, device=device)

for i in range(args.steps):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses[i] = loss.detach()
print(f"final loss {losses[-1].item():.4f}")
