"""The clean twin of gpu_convnet.py: the same fixed-shape convnet with cuDNN's autotuner on and the
forward under bf16 autocast. `audit run` rehearses it on a machine without a GPU and finds nothing
to say about its convolutions or their precision."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
images = torch.randn(512, 3, 32, 32)
labels = torch.randint(0, 10, (512,))
loader = DataLoader(TensorDataset(images, labels), batch_size=32, shuffle=True, drop_last=True, pin_memory=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


model = Net().to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
batches = iter(loader)


def next_batch():
    global batches
    try:
        return next(batches)
    except StopIteration:
        batches = iter(loader)
        return next(batches)


def step(i):
    x, y = next_batch()
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
