"""LightningCLI's shape (Lightning's examples/pytorch/basics: backbone_image_classifier.py): the Trainer is
built by the CLI from `trainer_defaults` and the command line (`--trainer.accelerator cpu`), its
accelerator left to "auto" unless told."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


class LitClassifier(LightningModule):
    def __init__(self, hidden_dim: int = 32, learning_rate: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden_dim), torch.nn.ReLU(), torch.nn.Linear(hidden_dim, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class Points(LightningDataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g)),
                          batch_size=self.batch_size)


def cli_main():
    cli = LightningCLI(LitClassifier, Points, seed_everything_default=1234, run=False, save_config_kwargs={"overwrite": True},
                       trainer_defaults={"max_epochs": 1, "logger": False, "enable_checkpointing": False,
                                         "enable_model_summary": False, "enable_progress_bar": False})
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)


if __name__ == "__main__":
    cli_main()
