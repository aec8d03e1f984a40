"""A Lightning `Trainer.fit` script, run unmodified (a tiny model: nothing is downloaded).

    audit run examples/lightning_fit.py --steps 12

The steps are the Trainer's optimizer steps. The loss is logged every step with `sync_dist=True`
(across processes it is reduced at every call) and shown in the progress bar, which Lightning
refreshes every step, reading the metric back to the host: that read is made inside Lightning,
under the user's `trainer.fit()` line, and reported there with the settings that cause it
(`Trainer(enable_progress_bar=False)`, or `prog_bar=False`), never as an edit of that line.
"""
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Points(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.tensor(i % 4)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=200, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(), DataLoader(Points(2048), batch_size=16))


if __name__ == "__main__":
    main()
