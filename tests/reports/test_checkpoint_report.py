"""`audit checkpoint`'s reports say what was audited: a checkpoint's tensors, not a training run's
steps (no "0 step(s)", no median-step tile or step plots), and a tensor with no finite value has no
largest |value| (null), not 0.0, which would read as a zero tensor. Checkpoints are written here
with torch.save and audited through the real CLI entry point (`auditor.cli.main`), as in
test_checkpoint.py; runs keep their step summary (checked on test_reporters' shared case)."""
from __future__ import annotations

import json
import pathlib
import re
from html import unescape

import pytest
import torch
from torch import nn

from conftest import Audit

from auditor.cli import main


@pytest.fixture
def check(tmp_path, capsys):
    """`audit checkpoint CKPT --out DIR ARGS` (not quiet: the summary is what is checked)."""
    def run(ckpt: pathlib.Path, *extra: str) -> Audit:
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            main(["checkpoint", str(ckpt), "--out", str(tmp_path / "out"), *extra])
        out = capsys.readouterr()
        return Audit(int(done.value.code or 0), out.out, out.err, tmp_path / "out")

    return run


def adam_bundle() -> dict:
    """A model (Linear(8, 16) -> Linear(16, 2): 4 tensors, 178 values) after 2 AdamW steps
    (exp_avg and exp_avg_sq per parameter: 8 optimizer tensors, 356 values), with an epoch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict(),
            "epoch": 2}


def page_text(html: str) -> str:
    """The report's visible text: no scripts or styles, tags as spaces, whitespace collapsed."""
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html)))


def test_checkpoint_summary_counts_tensors_not_steps(tmp_path, check):
    b = adam_bundle()
    b["model"]["2.weight"][0, 0] = float("nan")
    torch.save(b, tmp_path / "ckpt.pt")
    a = check(tmp_path / "ckpt.pt")
    assert a.returncode == 0, a.stderr
    head = a.stdout.splitlines()[0]
    assert head == (f"audit of checkpoint {tmp_path / 'ckpt.pt'} (bundle): 12 tensors checked (4 model, "
                    "8 optimizer), 534 values; 1 tensor holds NaN/inf")
    assert (a.out / "summary.txt").read_text().splitlines()[0] == head
    assert "step(s)" not in a.stdout and "ms/step" not in a.stdout

    torch.save({k: v for k, v in adam_bundle()["model"].items()}, tmp_path / "ok.pt")
    head = check(tmp_path / "ok.pt").stdout.splitlines()[0]
    assert head == f"audit of checkpoint {tmp_path / 'ok.pt'} (state_dict): 4 tensors checked (4 model), " \
                   "178 values; none holds NaN/inf"


def test_checkpoint_html_has_no_step_tiles_or_run_sections(tmp_path, check):
    b = adam_bundle()
    b["optimizer"]["state"][1]["exp_avg_sq"][:] = float("inf")
    torch.save(b, tmp_path / "ckpt.pt")
    a = check(tmp_path / "ckpt.pt")
    html = (a.out / "report.html").read_text()
    text = page_text(html)
    assert "Checkpoint audit" in text and "Training-step audit" not in text
    for run_only in ("Median step", "steps run", "Recoverable per step", "Peak memory", "No step data to plot",
                     "How the run ended", "No profiler trace", "cost not measured"):
        assert run_only not in text, run_only
    assert not re.search(r'id="(plots|traces|ending)"|href="#(plots|traces|ending)"', html)
    assert "Tensors checked 12 4 model + 8 optimizer tensors, 534 values" in text
    assert "Non-finite 1 tensor holds NaN/inf" in text
    assert "Checkpoint bundle" in text and "1 optimizer(s), 0 scheduler(s); epoch 2" in text


def test_run_reports_keep_their_step_summary(tmp_path):
    from test_reporters import make_case

    from auditor.reports.html import HtmlReport
    from auditor.reports.terminal import summary_lines

    case = make_case(tmp_path)
    assert re.match(r"audit of .+: \d+ step\(s\), [\d.]+ ms/step over the run, median ",
                    summary_lines(case.evidence, case.results, None)[0].plain)
    text = page_text(HtmlReport().render(case.evidence, case.results, case.out_dir))
    assert "Training-step audit" in text and "Median step" in text and "How the run ended" in text


def test_an_all_nan_tensor_has_no_largest_value(tmp_path, check):
    b = adam_bundle()
    b["model"]["0.bias"][:] = float("nan")  # no finite value at all
    b["model"]["2.bias"][:] = float("nan")
    b["model"]["2.bias"][1] = 0.0  # one finite value, and it is 0: max |value| is 0 here
    b["model"]["0.weight"][0, 0] = 3e5  # extreme, so checkpoint-health reads every max_abs too
    torch.save(b, tmp_path / "nan.pt")
    a = check(tmp_path / "nan.pt")
    assert a.returncode == 0, a.stderr
    assert "rule checkpoint-health failed" not in a.stdout
    stats = {t["name"]: t for t in a.evidence["checkpoint"]["tensors"]}
    assert stats["model.0.bias"]["max_abs"] is None  # null in evidence.json
    assert stats["model.2.bias"]["max_abs"] == 0.0
    bad = {t["name"]: t for t in a.rule("nonfinite")[0]["evidence"]["tensors"]}
    assert bad["model.0.bias"]["max_abs"] is None and bad["model.0.bias"]["nan"] == 16
    assert json.loads((a.out / "findings.json").read_text()) == a.findings_doc  # (valid JSON: null, not NaN)
    assert '"max_abs": null' in page_text((a.out / "report.html").read_text())
    health = a.rule("checkpoint-health")[0]
    assert [t["name"] for t in health["evidence"]["extreme"]] == ["model.0.weight"]


def test_a_meta_tensor_is_read_but_not_said_to_be_checked(tmp_path, check):
    """A meta tensor has no values: "1 tensor checked" claimed a check that never happened."""
    torch.save({"w": torch.empty(3, 4, device="meta"), "b": torch.zeros(4)}, tmp_path / "meta.pt")
    a = check(tmp_path / "meta.pt")
    assert a.returncode == 0, a.stderr
    head = a.stdout.splitlines()[0]
    assert head.startswith(f"audit of checkpoint {tmp_path / 'meta.pt'} (state_dict): 2 tensors (2 model), "
                           "1 with floating-point values checked, 16 values;"), head
    torch.save({"w": torch.empty(3, 4, device="meta")}, tmp_path / "meta1.pt")
    assert "1 tensor (1 model), none with floating-point values to check" in check(tmp_path / "meta1.pt").stdout


def test_a_default_lightning_checkpoint_is_clean(tmp_path, check, monkeypatch):
    """Lightning's ModelCheckpoint starts `kth_value`/`best_model_score` at +inf (mode="min"): every
    default `.ckpt` was an error ("kth_value (1 +inf of 1)") and failed a `--fail-on error` gate. A
    callback's ±inf score is a sentinel; a NaN weight beside it is still found."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    trainer = L.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=16))
    ckpt = pathlib.Path(trainer.checkpoint_callback.best_model_path)
    raw = torch.load(ckpt, weights_only=False)
    assert any(torch.isinf(v).any() for c in raw["callbacks"].values() for v in c.values()
               if isinstance(v, torch.Tensor))  # the sentinel is there
    a = check(ckpt, "--fail-on", "error")
    assert a.returncode == 0, a.stdout + a.stderr
    assert "none holds NaN/inf but a callback score at a starting ±inf" in a.stdout.splitlines()[0]
    assert not json.loads((a.out / "findings.json").read_text())["findings"]
    raw["state_dict"]["lin.weight"][0, 0] = float("nan")
    torch.save(raw, tmp_path / "bad.ckpt")
    bad = check(tmp_path / "bad.ckpt", "--fail-on", "error")
    assert bad.returncode == 1
    tensors = json.loads((bad.out / "findings.json").read_text())["findings"][0]["evidence"]["tensors"]
    assert [t["name"] for t in tensors] == ["lin.weight"]


class _Monitored:
    """A Lightning module whose validation logs val_loss (NaN from epoch `nan_from` on)."""

    @staticmethod
    def make(nan_from: int | None = None):
        import lightning as L

        class Monitored(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 1)

            def training_step(self, batch, i):
                x, y = batch
                return nn.functional.mse_loss(self.lin(x), y)

            def validation_step(self, batch, i):
                x, y = batch
                loss = nn.functional.mse_loss(self.lin(x), y)
                self.log("val_loss", loss * float("nan") if nan_from is not None and self.current_epoch >= nan_from
                         else loss)

            def configure_optimizers(self):
                opt = torch.optim.Adam(self.parameters(), lr=1e-2)
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min")  # its `best` starts at inf
                return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}

        return Monitored()


def _fit(tmp_path, module, epochs: int, callbacks: list) -> "object":
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
    trainer = L.Trainer(max_epochs=epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(module, data, data)
    return trainer


def test_lightning_monitored_scores_are_judged_as_lightning_means_them(tmp_path, check, monkeypatch):
    """ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=3) before its top 3 fill keeps
    `kth_value = tensor(inf)` (and `best_model_score = None` before the first validation), and
    EarlyStopping's `best_score` starts at tensor(inf): no finding, exit 0 under --fail-on error.
    A NaN weight is still an error. A val_loss that went NaN is kept by ModelCheckpoint as +inf: that
    is a metric gone bad, not a starting value, and checkpoint-health names it (it was called a
    sentinel, silently)."""
    from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint

    class SaveBeforeValidation(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 1:
                trainer.save_checkpoint(tmp_path / "early.ckpt")

    monkeypatch.chdir(tmp_path)
    best = ModelCheckpoint(dirpath=tmp_path / "top", monitor="val_loss", mode="min", save_top_k=3)
    _fit(tmp_path, _Monitored.make(), 2, [best, EarlyStopping(monitor="val_loss", mode="min"), SaveBeforeValidation()])
    early = torch.load(tmp_path / "early.ckpt", weights_only=True)
    state = next(v for k, v in early["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["best_model_score"] is None and torch.isinf(state["kth_value"])  # what Lightning wrote
    assert len(best.best_k_models) == 2 and torch.isinf(best.kth_value)  # 2 of the top 3 kept
    for ckpt in (tmp_path / "early.ckpt", pathlib.Path(best.best_model_path)):
        a = check(ckpt, "--fail-on", "error")
        assert a.returncode == 0, a.stdout + a.stderr
        assert json.loads((a.out / "findings.json").read_text())["findings"] == [], ckpt
    assert "none holds NaN/inf but 2 callback scores at a starting ±inf" in check(tmp_path / "early.ckpt").stdout

    early["state_dict"]["lin.weight"][0, 0] = float("nan")
    torch.save(early, tmp_path / "bad.ckpt")
    bad = check(tmp_path / "bad.ckpt", "--fail-on", "error")
    assert bad.returncode == 1
    [nonfinite] = json.loads((bad.out / "findings.json").read_text())["findings"]
    assert nonfinite["rule"] == "nonfinite" and [t["name"] for t in nonfinite["evidence"]["tensors"]] == ["lin.weight"]

    gone = ModelCheckpoint(dirpath=tmp_path / "gone", monitor="val_loss", mode="min", save_top_k=3)
    _fit(tmp_path / "gone", _Monitored.make(nan_from=1), 2, [gone])
    a = check(pathlib.Path(gone.best_model_path).parent / "epoch=1-step=4.ckpt", "--fail-on", "error")
    assert a.returncode == 0, a.stdout + a.stderr  # a warning
    [f] = json.loads((a.out / "findings.json").read_text())["findings"]
    assert (f["rule"], f["severity"]) == ("checkpoint-health", "warning")
    assert f["message"].startswith("A monitored metric was NaN or inf: find where it broke. "
                                   "ModelCheckpoint for val_loss in ") and \
        "kept +inf as current_score, 1 of best_k_models: val_loss was NaN or inf when it was checked" in f["message"]
    assert f["evidence"]["scores"] == ["current_score", f"best_k_models.{tmp_path / 'gone' / 'epoch=1-step=4.ckpt'}"]
