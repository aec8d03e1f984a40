"""`audit checkpoint`: checkpoints written here (healthy, NaN-poisoned, another run's lr, Lightning
layout, a plain state_dict, one that would run code when unpickled), audited through the real CLI:
the refusal as `python -m auditor` in a subprocess, the rest through the same entry point
(`auditor.cli.main`) in this process, which saves a torch import per case."""
from __future__ import annotations

import json
import pathlib
import pickle

import pytest
import torch
from torch import nn

from conftest import FIXTURES, Audit, audit

from auditor.cli import main
from auditor.evidence.checkpoint import normalise_config, read_config

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
    ck = a.evidence["checkpoint"]
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
    ck = a.evidence["checkpoint"]
    assert ck["layout"] == "lightning" and ck["meta"]["global_step"] == 3
    assert [t["name"] for t in a.rule("nonfinite")[0]["evidence"]["tensors"]] == ["model.0.weight"]
    mism = a.rule("lr-schedule")[0]["evidence"]["mismatches"]
    assert mism == [{"key": "scheduler.step_size", "config": 5, "stored": 10, "where": "scheduler[0].step_size"}]

    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "plain.pt")
    a = check(tmp_path / "plain.pt")
    assert a.returncode == 0 and a.findings == [] and a.evidence["checkpoint"]["layout"] == "state_dict"


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


def test_yaml_config_reader(tmp_path):
    text = "# run config\noptimizer:\n  name: adamw\n  lr: 3e-4\n  betas: [0.9, 0.95]\nlr_scheduler:\n  T_max: 100\n"
    (tmp_path / "c.yaml").write_text(text)
    data = read_config(tmp_path / "c.yaml")
    assert data == {"optimizer": {"name": "adamw", "lr": "3e-4", "betas": [0.9, 0.95]}, "lr_scheduler": {"T_max": 100}}
    assert normalise_config(data, pathlib.Path("c.yaml")) == {"lr": 3e-4, "betas": [0.9, 0.95],
                                                              "scheduler": {"T_max": 100}}


# --- safetensors files and Hugging Face Trainer checkpoint directories ---------------------------

ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
             torch.float8_e4m3fn: "F8_E4M3"}


def save_safetensors(tensors: dict, path: pathlib.Path, meta: dict | None = None) -> None:
    """The safetensors layout, written here from its spec (8-byte little-endian header length, a
    JSON header of dtype/shape/data_offsets, the raw bytes), independently of the reader."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if meta:
        header["__metadata__"] = meta
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def test_a_safetensors_file_is_read_without_unpickling(tmp_path, check):
    model, _, _ = trained()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["0.weight"][1, 2:4] = float("nan")
    sd["emb.half"] = torch.full((4, 4), 70000.0).to(torch.bfloat16)  # bfloat16 holds what float16 cannot
    sd["emb.half"][0, 0] = float("inf")
    sd["pos.ids"] = torch.arange(6)
    sd["fp8.w"] = torch.tensor([[1.0, -2.0], [float("nan"), 0.5]]).to(torch.float8_e4m3fn)  # an FP8 release
    save_safetensors(sd, tmp_path / "model.safetensors", {"format": "pt"})
    a = check(tmp_path / "model.safetensors")
    assert a.returncode == 0, a.stderr
    ck = a.evidence["checkpoint"]
    assert ck["layout"] == "state_dict" and ck["meta"]["__metadata__.format"] == "pt"
    stats = {t["name"]: t for t in ck["tensors"]}
    assert stats["0.weight"]["shape"] == [16, 8] and stats["pos.ids"]["dtype"] == "int64"
    assert stats["2.bias"]["max_abs"] == pytest.approx(float(sd["2.bias"].abs().max()))
    bad = {t["name"]: t for t in a.rule("nonfinite")[0]["evidence"]["tensors"]}
    assert set(bad) == {"0.weight", "emb.half", "fp8.w"}
    assert bad["0.weight"]["nan"] == 2 and bad["emb.half"]["posinf"] == 1 and bad["emb.half"]["dtype"] == "bfloat16"
    assert (bad["fp8.w"]["nan"], bad["fp8.w"]["max_abs"], bad["fp8.w"]["negative"]) == (1, 2.0, 1)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:-10], "truncated"),
    (lambda b: (4 << 40).to_bytes(8, "little") + b[8:], "no valid header"),
    (lambda b: b[:8] + b"!" + b[9:], "header is not JSON"),
])
def test_a_damaged_safetensors_file_is_one_line_exit_2(tmp_path, check, damage, message):
    save_safetensors({"w": torch.ones(4, 4)}, tmp_path / "ok.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(damage((tmp_path / "ok.safetensors").read_bytes()))
    a = check(tmp_path / "bad.safetensors")
    assert a.returncode == 2 and len(a.stderr.strip().splitlines()) == 1 and message in a.stderr, a.stderr


def hf_checkpoint(root: pathlib.Path, *, nan_weight: bool, nan_log: bool, sharded: bool = False) -> pathlib.Path:
    """A Hugging Face Trainer checkpoint directory, as transformers writes one: weights in
    safetensors (one file, or shards and an index), optimizer.pt, scheduler.pt, trainer_state.json,
    and a training_args.bin that pickles a class (here: one that runs code when unpickled)."""
    d = root / "checkpoint-500"
    d.mkdir()
    model, opt, sched = trained()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if nan_weight:
        sd["2.weight"][0, 0] = float("nan")
    if sharded:
        first = {k: v for k, v in sd.items() if k.startswith("0.")}
        save_safetensors(first, d / "model-00001-of-00002.safetensors")
        save_safetensors({k: v for k, v in sd.items() if k not in first}, d / "model-00002-of-00002.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
            k: f"model-0000{1 if k in first else 2}-of-00002.safetensors" for k in sd}}))
    else:
        save_safetensors(sd, d / "model.safetensors")
    torch.save(opt.state_dict(), d / "optimizer.pt")
    torch.save(sched.state_dict(), d / "scheduler.pt")
    history = [{"loss": 2.0 - 0.1 * i, "grad_norm": 1.0 + i, "learning_rate": 0.1, "epoch": i / 10,
                "step": 50 * (i + 1)} for i in range(8)]
    if nan_log:
        history.append({"loss": float("nan"), "grad_norm": float("inf"), "learning_rate": 0.1, "epoch": 0.9,
                        "step": 450})
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 500, "epoch": 1.0, "log_history": history}))
    torch.save(RunsCodeWhenLoaded(root / "code-ran"), d / "training_args.bin")
    return d


@pytest.mark.parametrize("sharded", [False, True])
def test_a_hugging_face_trainer_checkpoint_directory(tmp_path, check, sharded):
    d = hf_checkpoint(tmp_path, nan_weight=True, nan_log=True, sharded=sharded)
    a = check(d)
    assert a.returncode == 0, a.stderr
    assert not (tmp_path / "code-ran").exists()  # training_args.bin is never unpickled
    ck = a.evidence["checkpoint"]
    assert ck["layout"] == "hf-trainer"
    assert {t["name"] for t in ck["tensors"] if t["section"] == "model"} == {
        "model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"}
    assert ck["optimizers"][0]["params_with_state"] == 4 and ck["schedulers"][0]["step_size"] == 10
    assert ck["training_log"]["global_step"] == 500 and ck["training_log"]["entries"] == 9
    [f] = a.rule("nonfinite")
    assert f["severity"] == "error" and [t["name"] for t in f["evidence"]["tensors"]] == ["model.2.weight"]
    assert ("loss=nan first at step 450" in f["message"]
            and "the last finite values were loss 1.3, grad_norm 8 at step 400" in f["message"])


def test_finite_weights_after_a_logged_nan_are_still_reported(tmp_path, check):
    """The weights were saved finite (a skipped step, a reload), but trainer_state.json logged a
    NaN loss before the save: training had diverged, and resuming from here repeats it."""
    a = check(hf_checkpoint(tmp_path, nan_weight=False, nan_log=True))
    [f] = a.rule("nonfinite")
    assert f["severity"] == "warning" and "Every tensor" in f["message"] and "step 450" in f["message"]
    (tmp_path / "healthy").mkdir()
    a = check(hf_checkpoint(tmp_path / "healthy", nan_weight=False, nan_log=False))
    assert a.returncode == 0 and a.findings == []


def test_a_directory_that_is_not_a_checkpoint(tmp_path, check):
    (tmp_path / "empty").mkdir()
    a = check(tmp_path / "empty")
    assert a.returncode == 2 and "not a checkpoint directory" in a.stderr


class _System:
    """Pickles as a call of os.system: what a malicious checkpoint does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("protocol", [2, 4])
def test_a_checkpoint_calling_os_system_is_refused_by_name(tmp_path, check, protocol):
    import pickle

    marker = tmp_path / "code-ran"
    torch.save({"w": torch.ones(2), "x": _System(marker)}, tmp_path / "evil.pt")
    with open(tmp_path / "evil.pkl", "wb") as fh:  # a plain pickle, not a torch.save file
        pickle.dump({"x": _System(marker)}, fh, protocol=protocol)
    a = check(tmp_path / "evil.pt")
    assert a.returncode == 2 and not marker.exists()
    lines = a.stderr.strip().splitlines()
    # torch's own message would advise weights_only=False and cut off its warning: ours says why not
    assert len(lines) == 1 and "refused" in lines[0] and "`posix.system`" in lines[0] and "can run code" in lines[0]
    a = check(tmp_path / "evil.pkl")
    assert a.returncode == 2 and not marker.exists() and len(a.stderr.strip().splitlines()) == 1


def test_a_text_file_is_not_a_checkpoint(tmp_path, check):
    (tmp_path / "notes.pt").write_text("hello world\n")
    a = check(tmp_path / "notes.pt")
    assert a.returncode == 2 and len(a.stderr.strip().splitlines()) == 1
    assert "not a readable torch checkpoint" in a.stderr


@pytest.mark.parametrize("nan_weight", [True, False])
def test_a_checkpoint_directory_finding_is_placed_at_a_file_for_code_scanning(tmp_path, check, nan_weight):
    """A directory is not a SARIF artifact: a checkpoint directory's finding had no location, and
    GitHub code scanning rejects the whole file for one such result. Non-finite weights are placed
    at the weights file; a NaN only in the training log, at trainer_state.json."""
    from test_sarif import _validate

    d = hf_checkpoint(tmp_path, nan_weight=nan_weight, nan_log=True, sharded=True)
    a = check(d)
    held = "model-00002-of-00002.safetensors" if nan_weight else "trainer_state.json"  # (2.weight: 2nd shard)
    doc = json.loads((a.out / "findings.sarif").read_text())
    _validate(doc)
    [r] = doc["runs"][0]["results"]
    assert [loc["physicalLocation"]["artifactLocation"]["uri"].split("/")[-2:] for loc in r.get("locations", [])] \
        == [["checkpoint-500", held]]
    assert r["locations"][0]["physicalLocation"]["region"] == {"startLine": 1}
    [f] = a.rule("nonfinite")
    assert [pathlib.Path(p).name for p in f["evidence"]["files"]] == [held]


SNAPSHOT = FIXTURES / "snapshots" / "llama_mostly_free_segments.pickle"
TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"


@pytest.mark.parametrize("given", ["snapshot", "trace"])
def test_a_recording_given_as_a_checkpoint_is_named_with_the_command_that_reads_it(tmp_path, check, capsys, given):
    """A CUDA memory snapshot or a profiler trace given to `audit checkpoint`: the line said
    'not a readable torch checkpoint (Unsupported operand 149)' (31 for the gzip trace). It now
    says what the file is and the command that audits it, and that command does."""
    path = SNAPSHOT if given == "snapshot" else TRACE
    a = check(path)
    [line] = a.stderr.strip().splitlines()
    kind = "a CUDA memory snapshot (torch.cuda.memory._dump_snapshot)" if given == "snapshot" else \
        "a PyTorch profiler trace"
    assert a.returncode == 2 and line == f"audit: error: {path}: {kind}, not a checkpoint: `audit analyze {path}` audits it"
    assert "Unsupported operand" not in line
    with pytest.raises(SystemExit) as done:
        main(["analyze", str(path), "--out", str(tmp_path / "analyzed"), "--quiet"])
    assert done.value.code in (0, None) and (tmp_path / "analyzed" / "findings.json").is_file()
    assert json.loads((tmp_path / "analyzed" / "findings.json").read_text())["source"] == given


@pytest.mark.parametrize("content, said", [
    (b"", "not a readable torch checkpoint (an empty file: 0 bytes)"),
    (pickle.dumps({"lr": 0.1}, protocol=4), "not a readable torch checkpoint (a pickle written by pickle.dump, not "
                                             "torch.save)"),
])
def test_files_torch_load_cannot_read_say_what_they_are(tmp_path, check, content, said):
    """An empty file read '(EOFError)', a plain pickle '(Unsupported operand 149)'."""
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    a = check(path)
    assert a.returncode == 2 and a.stderr.strip().splitlines() == [f"audit: error: {path}: {said}"]


def test_a_damaged_torch_save_file_keeps_torchs_reason(tmp_path, check):
    """The clean case: a torch.save file cut short is torch's format, and torch's reason stands."""
    torch.save({"w": torch.ones(64)}, tmp_path / "ok.pt", _use_new_zipfile_serialization=False)
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:300])
    a = check(tmp_path / "cut.pt")
    [line] = a.stderr.strip().splitlines()
    assert a.returncode == 2 and line.startswith(f"audit: error: {tmp_path / 'cut.pt'}: not a readable torch checkpoint (")
    assert "pickle.dump" not in line and "snapshot" not in line and "empty" not in line


# --- hostile inputs: one line and exit 2, or judged, in bounded time and memory --------------------

def _evidence(path: pathlib.Path):
    from auditor.evidence.checkpoint import checkpoint_evidence

    return checkpoint_evidence(path).checkpoint


def test_an_expanded_view_is_reduced_by_its_storage(tmp_path: pathlib.Path) -> None:
    """2**60 elements over one stored value: reducing the view never finished."""
    p = tmp_path / "x.pt"
    torch.save({"w": torch.full((1,), float("nan")).expand(2**40, 2**20)}, p)
    (t,) = _evidence(p).tensors
    assert t.numel == 2**60 and t.nan == 1 and t.max_abs is None


def test_a_counter_too_large_for_a_schedule_is_left_out(tmp_path: pathlib.Path) -> None:
    """MultiStepLR milestones {5: 10**10} were expanded into a list (MemoryError)."""
    p = tmp_path / "x.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "scheduler": {"milestones": {5: 10**10}, "gamma": 0.1},
                "lr_scheduler": {"milestones": {5: 2, 3: 1}}}, p)
    s = {d["name"]: d for d in _evidence(p).schedulers}
    assert "milestones" not in s["scheduler"] and s["scheduler"]["gamma"] == 0.1
    assert s["lr_scheduler"]["milestones"] == [3, 5, 5]


@pytest.mark.parametrize("obj", [
    {"w": torch.empty(3, device="meta")},
    {"model": {"w": torch.zeros(2)}, "optimizer": {"state": 5, "param_groups": [{"lr": 1, "params": [0]}]}},
    {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}, "param_groups": 5}},
    {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}, "param_groups": [{"lr": 1, "params": 5}]}},
    {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {}, "param_groups": [5]}},
    {"state_dict": {"w": torch.zeros(2)}, "optimizer_states": 5, "lr_schedulers": 5},
], ids=["meta", "state-int", "param-groups-int", "params-int", "group-int", "lightning-int"])
def test_parts_of_the_wrong_type_are_judged(tmp_path: pathlib.Path, obj) -> None:
    """Each exited 4 (internal error); a meta tensor has no data, so it is left unchecked."""
    p = tmp_path / "x.pt"
    torch.save(obj, p)
    summary = _evidence(p)
    assert all(t.checked is False for t in summary.tensors if t.dtype == "float32" and t.numel == 3)


def _safetensors(p: pathlib.Path, header: dict, data: bytes = b"") -> None:
    h = json.dumps(header).encode()
    p.write_bytes(len(h).to_bytes(8, "little") + h + data)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]},
    {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]},
    {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
], ids=["dim-2**63", "zero-numel-huge", "dtype-list"])
def test_impossible_safetensors_entries_are_refused(tmp_path: pathlib.Path, entry, check) -> None:
    """Each exited 4 (shape [0, 2**63]: a 12-line C++ trace)."""
    p = tmp_path / "x.safetensors"
    _safetensors(p, {"w": entry}, b"\0" * 4)
    a = check(p)
    assert a.returncode == 2 and "\n" not in a.stderr.strip() and "not a readable safetensors file" in a.stderr


@pytest.mark.parametrize("shard", ["../../x.safetensors", "/etc/passwd", "sub/../../y.safetensors"])
def test_an_index_naming_files_outside_the_directory_is_refused(tmp_path: pathlib.Path, shard, check) -> None:
    """The index's names were read wherever they led (`/etc/passwd`)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    _safetensors(tmp_path / "x.safetensors", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    a = check(d)
    assert a.returncode == 2 and "\n" not in a.stderr.strip() and "outside the checkpoint directory" in a.stderr


def test_non_regular_files_are_refused(tmp_path: pathlib.Path, check) -> None:
    """A FIFO hung; /dev/zero was "an empty file"."""
    import os

    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    for p in (fifo, pathlib.Path("/dev/zero")):
        a = check(p)
        assert a.returncode == 2 and "\n" not in a.stderr.strip() and "not a regular file" in a.stderr
