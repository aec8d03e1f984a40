"""A GPU asked for by its index, or by a framework that picks it, is CUDA intent: pytorch/examples'
ddp-tutorial `single_gpu.py` (`device = 0`, `model.to(gpu_id)`) is rehearsed on a machine without a
GPU, and a run that fails for want of one says to try `--rehearse`."""
from __future__ import annotations

import pytest
import torch

from conftest import ROOT, audit
from auditor.capture.rehearsal.intent import cuda_reasons
from auditor.reports.terminal import NO_GPU_ERRORS

# what a CUDA build of torch says where there is no GPU (no driver; no visible device), among the
# errors the summary's --rehearse hint knows
CUDA_BUILD_NO_GPU = ("Found no NVIDIA driver on your system", "No CUDA GPUs are available")
assert set(CUDA_BUILD_NO_GPU) <= set(NO_GPU_ERRORS)


@pytest.mark.parametrize("source, asks", [
    ("x = x.to(0)", ".to(0)"),
    ("model = model.cuda(0)", ".cuda()"),
    ("dev = torch.device(1)", "torch.device(1)"),
    ("device = 0  # shorthand for cuda:0", "device = 0"),
    ("self.gpu_id = 0", "self.gpu_id = 0"),
    ("x = torch.zeros(3, device=0)", "device=<index>"),
    ("import lightning as L\ntrainer = L.Trainer(max_epochs=1)", "L.Trainer() (picks a GPU when there is one)"),
    ("from lightning.fabric import Fabric\nfabric = Fabric(accelerator='auto')", "Fabric() (picks a GPU when there is one)"),
    ("import lightning as L\ntrainer = L.Trainer(accelerator='cpu')", None),
    ("trainer = Trainer(max_epochs=1)", None),  # not Lightning's
    ("n_gpu = 0\nnum_devices = 0", None),  # counts, not indices
    ("x = x.to(dtype)\nsteps = 0", None),
])
def test_a_device_by_index_is_cuda_intent(tmp_path, source, asks):
    f = tmp_path / "t.py"
    f.write_text(source + "\n")
    reasons = cuda_reasons(f)
    assert (reasons[0][1] if reasons else None) == asks


# pytorch/examples distributed/ddp-tutorial-series/single_gpu.py, with its datautils.py
SINGLE_GPU = '''import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from datautils import MyTrainDataset


class Trainer:
    def __init__(self, model, train_data, optimizer, gpu_id, save_every):
        self.gpu_id = gpu_id
        self.model = model.to(gpu_id)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            source = source.to(self.gpu_id)
            targets = targets.to(self.gpu_id)
            self._run_batch(source, targets)

    def train(self, max_epochs: int):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)


def load_train_objs():
    train_set = MyTrainDataset(2048)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=True, shuffle=True)


def main(device, total_epochs, save_every, batch_size):
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, device, save_every)
    trainer.train(total_epochs)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description='simple distributed training job')
    parser.add_argument('total_epochs', type=int, help='Total epochs to train the model')
    parser.add_argument('save_every', type=int, help='How often to save a snapshot')
    parser.add_argument('--batch_size', default=32, type=int, help='Input batch size on each device (default: 32)')
    args = parser.parse_args()
    device = 0  # shorthand for cuda:0
    main(device, args.total_epochs, args.save_every, args.batch_size)
'''

DATAUTILS = '''import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]
'''


@pytest.fixture
def single_gpu(tmp_path):
    (tmp_path / "single_gpu.py").write_text(SINGLE_GPU)
    (tmp_path / "datautils.py").write_text(DATAUTILS)
    return tmp_path


def test_single_gpu_by_index_is_rehearsed(single_gpu):
    a = audit("run", "single_gpu.py", "--steps", "20", "--no-profile", "--quiet", "--", "1", "1",
              out=single_gpu / "out", cwd=single_gpu,
              env={"PYTHONPATH": str(ROOT)})  # (the auditor under test, from the program's directory)
    assert a.returncode == 0, a.stderr[-3000:]
    env = a.findings_doc["environment"]
    assert env["rehearsal"] is True
    assert any("device = 0" in n for n in env["notes"]), env["notes"]
    assert a.findings_doc["steps"]["count"] == 20


def test_a_run_that_fails_for_want_of_a_gpu_says_to_rehearse(single_gpu):
    a = audit("run", "single_gpu.py", "--steps", "5", "--no-profile", "--no-rehearse", "--", "1", "1",
              out=single_gpu / "out", cwd=single_gpu,
              env={"PYTHONPATH": str(ROOT)})  # (the auditor under test, from the program's directory)
    assert a.returncode == 3, a.stderr[-3000:]
    # a CPU build of torch refuses the device index as no accelerator; a CUDA build (PyPI's Linux
    # wheels) finds no driver or no device: the summary's hint knows each
    message = a.evidence["ending"]["message"]
    assert ("Cannot access accelerator device when none is available" in message if torch.version.cuda is None
            else any(text in message for text in CUDA_BUILD_NO_GPU)), message
    assert "the program asks for a GPU and this machine has none: `audit run --rehearse`" in a.stdout, a.stdout


# Lightning's bug-report template (BoringModel): the Trainer picks the device itself
BORING = '''import os

import torch
from torch.utils.data import DataLoader, Dataset

from lightning.pytorch import LightningModule, Trainer


class RandomDataset(Dataset):
    def __init__(self, size, length):
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return self.len


class BoringModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        loss = self(batch).sum()
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


def run():
    train_data = DataLoader(RandomDataset(32, 64), batch_size=2)
    model = BoringModel()
    trainer = Trainer(
        default_root_dir=os.getcwd(),
        limit_train_batches=10,
        num_sanity_val_steps=0,
        max_epochs=1,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=train_data)


if __name__ == "__main__":
    run()
'''


@pytest.mark.slow  # (Lightning's import and Trainer: ~40 s on two shared cores)
def test_a_lightning_trainer_left_to_pick_its_device_is_rehearsed(tmp_path):
    pytest.importorskip("lightning")
    (tmp_path / "bug_report_model.py").write_text(BORING)
    a = audit("run", "bug_report_model.py", "--no-profile", "--quiet", out=tmp_path / "out", cwd=tmp_path,
              env={"PYTHONPATH": str(ROOT)})
    assert a.returncode == 0, a.stderr[-3000:]
    env = a.findings_doc["environment"]
    assert env["rehearsal"] is True
    assert any("Trainer() (picks a GPU when there is one)" in n for n in env["notes"]), env["notes"]
    assert a.findings_doc["steps"]["count"] == 10
