"""`audit checkpoint`: checkpoints written here (healthy, NaN-poisoned, another run's lr, Lightning
layout, a plain state_dict, one that would run code when unpickled), audited through the real CLI:
the refusal as `python -m auditor` in a subprocess, the rest through the same entry point
(`auditor.cli.main`) in this process, which saves a torch import per case."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
from torch import nn

from conftest import Audit, audit

from auditor.cli import main
from auditor.evidence.checkpoint import _mini_yaml, normalise_config

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


class TrainingNote:
    """A custom class instance, as a trainer might save next to its weights."""

    def __init__(self, text: str) -> None:
        self.text = text


class RunsCodeWhenLoaded:
    """Unpickling calls pathlib.Path.touch(marker): what a malicious checkpoint could do."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def trained(lr: float = 0.1, steps: int = 3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def bundle(lr: float = 0.1) -> dict:
    model, opt, sched = trained(lr)
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(), "epoch": 3}


def config(tmp_path: pathlib.Path, text: str, name: str = "train.yaml") -> pathlib.Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.fixture
def check(tmp_path, capsys):
    """`audit checkpoint CKPT --out DIR --quiet ARGS` through auditor.cli.main; exit code and output."""
    def run(ckpt: pathlib.Path, *extra: str) -> Audit:
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            main(["checkpoint", str(ckpt), "--out", str(tmp_path / "out"), "--quiet", *extra])
        out = capsys.readouterr()
        return Audit(int(done.value.code or 0), out.out, out.err, tmp_path / "out")

    return run


def test_healthy_checkpoint_matching_its_config_is_silent(tmp_path, check):
    torch.save(bundle(lr=1e-3), tmp_path / "ok.pt")
    cfg = config(tmp_path, "optimizer:\n  lr: 1e-3   # YAML 1.1 reads this as a string\n  weight_decay: 0.01\n"
                           "scheduler:\n  type: StepLR\n  step_size: 10\n  gamma: 0.5\n")
    a = check(tmp_path / "ok.pt", "--against", str(cfg), "--fail-on", "info")
    assert a.returncode == 0, a.stderr
    assert a.findings == []
    doc = a.findings_doc
    assert doc["source"] == "checkpoint"
    ck = a.evidence["extra"]["checkpoint"]
    assert ck["layout"] == "bundle" and ck["config"] == {"lr": 1e-3, "weight_decay": 0.01,
                                                         "scheduler": {"type": "StepLR", "step_size": 10, "gamma": 0.5}}
    assert {t["name"] for t in ck["tensors"] if t["section"] == "model"} == {"model.0.weight", "model.0.bias",
                                                                             "model.2.weight", "model.2.bias"}
    assert ck["optimizers"][0]["params"] == ck["optimizers"][0]["params_with_state"] == 4


def test_nan_poisoned_weights_and_optimizer_state(tmp_path, check):
    b = bundle()
    b["model"]["2.weight"][0, :3] = float("nan")
    b["optimizer"]["state"][0]["exp_avg_sq"][1, 2] = float("inf")
    torch.save(b, tmp_path / "nan.pt")
    a = check(tmp_path / "nan.pt", "--fail-on", "error")
    assert a.returncode == 1, a.stderr  # --fail-on error, and a NaN is an error
    f = a.rule("nonfinite")[0]
    bad = {t["name"]: t for t in f["evidence"]["tensors"]}
    assert set(bad) == {"model.2.weight", "optimizer.state.0.exp_avg_sq"}
    assert bad["model.2.weight"]["nan"] == 3 and bad["optimizer.state.0.exp_avg_sq"]["posinf"] == 1
    assert f["evidence"]["nonfinite_values"] == 4 and f["severity"] == "error"
    assert "model.2.weight (3 NaN of 32)" in f["message"]


def test_stored_lr_differs_from_the_config(tmp_path, check):
    torch.save(bundle(lr=0.1), tmp_path / "old.pt")
    cfg = config(tmp_path, json.dumps({"training": {"learning_rate": 0.001}}), "cfg.json")
    a = check(tmp_path / "old.pt", "--against", str(cfg))
    assert a.returncode == 0, a.stderr
    f = a.rule("lr-schedule")[0]
    where = {m["where"]: m["stored"] for m in f["evidence"]["mismatches"]}
    assert where == {"optimizer[0].param_groups[0].initial_lr": 0.1, "scheduler[0].base_lrs[0]": 0.1}
    assert f["evidence"]["reproduces_config"] is False and f["fix"]["config"] == {"lr": 0.001}


def test_lightning_layout_and_plain_state_dict(tmp_path, check):
    model, opt, sched = trained()
    sd = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    sd["model.0.weight"][0, 0] = float("-inf")
    torch.save({"state_dict": sd, "optimizer_states": [opt.state_dict()], "lr_schedulers": [sched.state_dict()],
                "global_step": 3, "epoch": 0, "pytorch-lightning_version": "2.2.0"}, tmp_path / "l.ckpt")
    cfg = config(tmp_path, "lr = 0.1\n[scheduler]\nstep_size = 5\n", "cfg.toml")
    a = check(tmp_path / "l.ckpt", "--against", str(cfg))
    assert a.returncode == 0, a.stderr
    ck = a.evidence["extra"]["checkpoint"]
    assert ck["layout"] == "lightning" and ck["meta"]["global_step"] == 3
    assert [t["name"] for t in a.rule("nonfinite")[0]["evidence"]["tensors"]] == ["model.0.weight"]
    mism = a.rule("lr-schedule")[0]["evidence"]["mismatches"]
    assert mism == [{"key": "scheduler.step_size", "config": 5, "stored": 10, "where": "scheduler[0].step_size"}]

    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "plain.pt")
    a = check(tmp_path / "plain.pt")
    assert a.returncode == 0 and a.findings == [] and a.evidence["extra"]["checkpoint"]["layout"] == "state_dict"


def test_extreme_and_impossible_state(tmp_path, check):
    b = bundle()
    b["model"]["0.weight"][3, 3] = 2.5e5
    b["optimizer"]["state"][2]["exp_avg_sq"][0, 0] = -1.0
    torch.save(b, tmp_path / "odd.pt")
    a = check(tmp_path / "odd.pt")
    found = {(f["title"], f["severity"]): f for f in a.rule("checkpoint-health")}
    extreme = found[("Checkpoint weights or optimizer state are out of range", "warning")]
    assert extreme["evidence"]["largest_abs"] == 2.5e5 and extreme["evidence"]["extreme"][0]["name"] == "model.0.weight"
    impossible = found[("Optimizer state is impossible", "error")]
    assert impossible["evidence"]["tensors"][0]["name"] == "optimizer.state.2.exp_avg_sq"
    assert impossible["evidence"]["tensors"][0]["negative"] == 1


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"model": {"w": torch.ones(2)}, "note": TrainingNote("lr sweep 3"),
                "extra": RunsCodeWhenLoaded(marker)}, tmp_path / "evil.pt")
    a = audit("checkpoint", str(tmp_path / "evil.pt"), "--out", str(tmp_path / "out"), out=tmp_path / "out",
              env=ONE_THREAD)
    assert a.returncode == 2
    assert not marker.exists()  # nothing from the file ran
    lines = a.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused" in lines[0] and "weights_only=True" in lines[0]
    assert f"{TrainingNote.__module__}.TrainingNote`" in lines[0]  # names the class it asked for


@pytest.mark.parametrize("files, message", [
    (("missing.pt", None), "no such file"),
    (("ok.pt", "missing.yaml"), "no such config file"),
    (("ok.pt", "bad.yaml"), "none of the accepted keys"),
    (("junk.pt", None), "not a readable torch checkpoint"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, check, files, message):
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "bad.yaml").write_text("batch_size: 32\n")
    ckpt, cfg = files
    a = check(tmp_path / ckpt, *(("--against", str(tmp_path / cfg)) if cfg else ()))
    assert a.returncode == 2 and len(a.stderr.strip().splitlines()) == 1 and message in a.stderr


def test_config_reader_without_pyyaml():
    text = "# run config\noptimizer:\n  name: adamw\n  lr: 3e-4\n  betas: [0.9, 0.95]\nlr_scheduler:\n  T_max: 100\n"
    data = _mini_yaml(text)
    assert data == {"optimizer": {"name": "adamw", "lr": 3e-4, "betas": [0.9, 0.95]}, "lr_scheduler": {"T_max": 100}}
    assert normalise_config(data, pathlib.Path("c.yaml")) == {"lr": 3e-4, "betas": [0.9, 0.95],
                                                              "scheduler": {"T_max": 100}}
