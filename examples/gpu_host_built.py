"""A small GAN trainer that builds its labels and its noise on the host every step and copies them
to the GPU (`torch.ones(n, 1).to(device)`, `torch.randn(n, latent).to(device)`): a host allocation,
a host draw and a blocking copy each, every step, where `device=device` makes them on the GPU. On a
machine without a GPU, `audit run` rehearses it on the CPU and reads the copies."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
LATENT, WIDTH, BATCH = 32, 64, 128
data = TensorDataset(torch.rand(4096, WIDTH) * 2 - 1)
loader = DataLoader(data, sampler=BatchSampler(RandomSampler(data), batch_size=BATCH, drop_last=True), batch_size=None,
                    pin_memory=True)
generator = nn.Sequential(nn.Linear(LATENT, 128), nn.ReLU(), nn.Linear(128, WIDTH), nn.Tanh()).to(device)
discriminator = nn.Sequential(nn.Linear(WIDTH, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1)).to(device)
opt_g = torch.optim.Adam(generator.parameters(), lr=2e-4)
opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4)
batches = iter(loader)


def next_batch():
    global batches
    try:
        return next(batches)[0]
    except StopIteration:
        batches = iter(loader)
        return next(batches)[0]


def step(i):
    real = next_batch().to(device, non_blocking=True)
    ones = torch.ones(real.size(0), 1).to(device)  # expect: host-built-tensor
    zeros = torch.zeros(real.size(0), 1).to(device)  # expect: host-built-tensor
    z = torch.randn(real.size(0), LATENT).to(device)  # expect: host-built-tensor
    fake = generator(z)
    d_loss = (F.binary_cross_entropy_with_logits(discriminator(real), ones)
              + F.binary_cross_entropy_with_logits(discriminator(fake.detach()), zeros))
    opt_d.zero_grad(set_to_none=True)
    d_loss.backward()
    opt_d.step()
    g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
    opt_g.zero_grad(set_to_none=True)
    g_loss.backward()
    opt_g.step()
    return g_loss.detach()


if __name__ == "__main__":
    for i in range(30):
        step(i)
