"""Lightning Fabric's image_classifier/train_fabric.py shape: Fabric() picks the device, the
DataLoader goes through fabric.setup_dataloaders (Fabric moves the batches), no autocast."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning.fabric import Fabric, seed_everything


class Slow(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(256, generator=g)
        for _ in range(40):
            x = torch.tanh(x * 1.01)
        return x, i % 10


def run():
    fabric = Fabric()  # FABRIC LINE
    seed_everything(0)
    train_loader = DataLoader(Slow(), batch_size=64)  # LOADER LINE
    train_loader = fabric.setup_dataloaders(train_loader)  # SETUP LINE
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    for epoch in range(2):
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            fabric.backward(loss)
            optimizer.step()


if __name__ == "__main__":
    run()
