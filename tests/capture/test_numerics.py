"""The numerics collector and rules (nonfinite, grad-explosion, lr-schedule, amp-unscaled): example
trainers audited for real through the CLI, clean twins that stay silent, weight parity with the
collector installed, and table tests of the rules' thresholds on small evidence."""
from __future__ import annotations

import contextlib
import json
import math
import os
import runpy
import shutil
import subprocess
import sys
import textwrap
import warnings

import msgspec
import pytest

from conftest import EXAMPLES, NUMERICS_STEPS, ONE_THREAD, ROOT, assert_phases, audit, expected_lines, patch_text

from auditor.evidence.model import Evidence, StepRecord
from auditor.evidence.numerics import NumericsStep
from auditor.rules.amp_unscaled import AmpUnscaled
from auditor.rules.grad_explosion import GradExplosion
from auditor.rules.lr_schedule import LrSchedule
from auditor.rules.nonfinite import Nonfinite

NUMERICS_RULES = ("nonfinite", "grad-explosion", "lr-schedule", "amp-unscaled")
# One thread per audited process (ONE_THREAD): two test workers on two busy cores, and torch's
# default of one thread per core would make them fight (10x slower steps), without changing what
# is checked.
STEPS = NUMERICS_STEPS


@pytest.fixture(scope="module")
def run(numerics_audit):
    return numerics_audit


def one(a, rule_id: str, example: str) -> dict:
    """The single finding of `rule_id`, located at the example's `# expect: rule-id` lines."""
    assert a.returncode == 0, a.stderr
    found = a.rule(rule_id)
    assert len(found) == 1, [(f["rule"], f["message"]) for f in a.findings]
    lines = expected_lines(EXAMPLES / f"{example}.py", rule_id)
    assert lines, "example has no # expect marker"
    path = str(EXAMPLES / f"{example}.py")
    assert {(loc["file"], loc["line"]) for loc in found[0]["locations"]} >= {(path, n) for n in lines}
    return found[0]


def audit_trainer(tmp_path, name: str, source: str, steps: int, env: dict | None = None):
    """Write `source` as a trainer and audit it for real (no profiler, one thread, the trainer's
    own variables in `env`): it must end well."""
    trainer = tmp_path / name
    trainer.write_text(source)
    a = audit("run", f"{trainer}:step", "--steps", str(steps), "--no-profile", "--quiet", out=tmp_path / "out",
              env={**ONE_THREAD, **(env or {})})
    assert a.returncode == 0, a.stderr
    return trainer, a


def line_of(source: str, marker: str) -> int:
    """The line of `source` that holds `marker` (a trainer's `# ... LINE` comment), from 1."""
    return next(n for n, text in enumerate(source.splitlines(), 1) if marker in text)


def places(finding: dict) -> set[tuple[str, int]]:
    return {(loc["file"], loc["line"]) for loc in finding["locations"]}


def numerics(a) -> list[dict]:
    return [s["numerics"] for s in a.evidence["steps"]]


def first_bad_loss_step(a) -> int:
    return next(i for i, d in enumerate(numerics(a)) if d["loss_finite"] is False)


@contextlib.contextmanager
def plain_run_here(trainer):
    """`trainer` run plainly in this process (a reference run without a process of its own): its
    globals, and the losses its backward passes start from, as they come. Plain torch here runs
    as the audited child does (one thread, float32 by default); what is changed for the run is set
    back after it."""
    import torch

    assert torch.get_default_dtype() == torch.float32
    losses: list[float] = []
    backward, threads = torch.Tensor.backward, torch.get_num_threads()

    def record(t, *args, **kwargs):
        losses.append(t.item())
        return backward(t, *args, **kwargs)
    torch.Tensor.backward = record
    torch.set_num_threads(1)
    try:
        yield runpy.run_path(str(trainer)), losses
    finally:
        torch.Tensor.backward = backward
        torch.set_num_threads(threads)


# --- nonfinite ----------------------------------------------------------------------------------

def test_nan_starts_in_named_submodule(run):
    a = run("numerics_nan_submodule")
    f = one(a, "nonfinite", "numerics_nan_submodule")
    ev = f["evidence"]
    # the padding row sits in batch 14 (shuffle=False): the first non-finite step, not step 0
    assert ev["first_step"] == first_bad_loss_step(a) == 14
    assert ev["module"] == "encoder.norm" and ev["module_type"] == "RowNorm" and ev["root"] == "Classifier"
    assert ev["op"] == "Tensor.div" and ev["hazard"]["kind"] == "division-by-zero"
    assert ev["inputs"][1]["min"] == 0.0 and ev["inputs"][1]["finite"]  # the norm reached 0, finitely
    # the denominator's smallest value per step, recorded while the steps ran: healthy, then 0
    series = dict((s, v) for s, v in ev["hazard_series"])
    assert series[14] == 0.0 and all(v > 1 for s, v in series.items() if s < 14)
    assert f["severity"] == "error" and "encoder.norm" in f["message"]
    # a user-defined root module: its forward phase is found at its line by walking the stack
    assert_phases(a, EXAMPLES / "numerics_nan_submodule.py", {"Classifier": 56, "CrossEntropyLoss": 56}, {"AdamW": 58})
    edit = f["fix"]["edits"][0]
    # 1e-5, not 1e-12: a flat column's std is rounding noise, and (x - mu) / 1e-12 would be 1e5
    assert ".clamp_min(1e-05)" in edit["lines"][0] and f["fix"]["changes_numerics"] is True


def test_log_of_a_value_that_reaches_zero_mid_run(run):
    a = run("numerics_log_zero")
    f = one(a, "nonfinite", "numerics_log_zero")
    ev = f["evidence"]
    assert 5 <= ev["first_step"] == first_bad_loss_step(a)
    assert ev["op"] == "torch.log" and ev["hazard"]["kind"] == "log-of-zero"
    assert ev["inputs"][0]["min"] == 0.0
    losses = [v for _, v in ev["loss_series"]]
    assert all(isinstance(v, float) for v in losses[:-2]) and "nan" in losses
    assert "torch.log((1 - p).clamp_min(1e-12))" in f["fix"]["edits"][0]["lines"][0]


def test_lr_blowup_overflows_and_the_norm_explodes(run):
    a = run("numerics_lr_blowup")
    f = one(a, "nonfinite", "numerics_lr_blowup")
    ev = f["evidence"]
    assert ev["first_step"] >= 10 and ev["hazard"]["kind"] == "overflow" and ev["nonfinite"][0] == "loss"
    assert all(r["finite"] for r in ev["inputs"]) and ev["outputs"][0]["max"] == "inf"
    g = one(a, "grad-explosion", "numerics_lr_blowup")
    recorded = [r["grad_norm"] for d in numerics(a) for r in d["opt_steps"]]
    assert [v for _, v in g["evidence"]["series"]] == recorded
    # the loss overflows, but no gradient element does in these steps: only their float32 norm
    # would (from step 20), and the norm is taken again in float64 then
    assert g["evidence"]["growth"]["per_step"] > 3 and not g["evidence"]["went_nonfinite"]
    assert all(math.isfinite(v) for v in recorded)
    # tenfold a step from the first: one healthy step, too few to derive a clipping value from
    assert g["evidence"]["suggested_max_norm"] is None and g["evidence"]["healthy_steps"] == 1
    assert g["fix"]["edits"] == [] and g["fix"]["config"] == {"lr": 0.4}
    assert "too few to derive a clipping max_norm" in g["fix"]["summary"]
    assert g["fix"]["changes_numerics"] is True
    assert g["evidence"]["top_layers"][0][0] == "model"  # the root module, a global, owns both parameters


DIVERGING = """
import torch
from torch import nn

torch.manual_seed(1)
model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.8, momentum=0.9)
X = torch.randn(512, 20) * 3
Y = (X ** 2).sum(1, keepdim=True)


def step(i):
    idx = torch.arange(i * 64, (i + 1) * 64) % 512
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(X[idx]), Y[idx])
    loss.backward()
    opt.step()
"""

def plain_diverging(trainer, steps: int) -> list[dict]:
    """DIVERGING's plain run: per step, whether its loss, gradients and weights are finite, whether
    the gradients' float32 norm is, and their norm in float64."""
    import torch

    out = []
    with plain_run_here(trainer) as (g, losses):
        for i in range(steps):
            g["step"](i)
            grads = [p.grad for p in g["model"].parameters()]
            out.append({"loss_finite": math.isfinite(losses[-1]),
                        "grads_finite": all(bool(torch.isfinite(t).all()) for t in grads),
                        "params_finite": all(bool(torch.isfinite(p).all()) for p in g["model"].parameters()),
                        "norm32_finite": math.isfinite(sum(float(n) for n in torch._foreach_norm(grads, 2))),
                        "norm64": math.hypot(*[float(torch.linalg.vector_norm(t, dtype=torch.float64)) for t in grads])})
    return out


@pytest.fixture(scope="module")
def diverging(tmp_path_factory):
    """DIVERGING audited for 20 steps, and its plain run's per-step record (plain_diverging): both
    tests of it read one audit (the 20 steps pass the growth and the step its values turn inf)."""
    trainer, a = audit_trainer(tmp_path_factory.mktemp("diverging"), "diverging.py", DIVERGING, 20)
    return a, plain_diverging(trainer, 20)


def test_a_gradient_whose_float32_norm_overflows_is_still_finite(diverging):
    """Diverging SGD: from some step the gradients' float32 norm is inf (its sum of squares passes
    3.4e38) while every gradient element is still finite; values turn inf only steps later. The
    gradient was reported non-finite at the first of those steps, and its norm was lost. The first
    non-finite step is the plain run's, and the norm there is the float64 one."""
    a, plain = diverging
    overflowed = [i for i, s in enumerate(plain) if not s["norm32_finite"] and s["grads_finite"]]
    assert overflowed, "the trainer no longer overflows the float32 norm before its values: the test is void"
    first_bad = next(i for i, s in enumerate(plain) if not (s["loss_finite"] and s["grads_finite"] and s["params_finite"]))
    assert overflowed[0] < first_bad
    (f,) = a.rule("nonfinite")
    assert f["evidence"]["first_step"] == first_bad
    recorded = [r["grad_norm"] for d in numerics(a) for r in d["opt_steps"]]
    for i in overflowed:
        assert recorded[i] == pytest.approx(plain[i]["norm64"], rel=1e-6)
    (g,) = a.rule("grad-explosion")
    went = next(i for i, s in enumerate(plain) if not s["grads_finite"])
    assert f"non-finite at step {went}" in g["message"]


def test_a_run_that_diverges_from_its_start_gets_no_clip_value_from_one_healthy_step(diverging):
    """SGD at lr 0.8 grows its gradient norm ~800x a step from the first: grad-explosion printed the
    growth as 'x827.62' (3 significant digits, as its other numbers) and derived max_norm from the
    one or two norms before the growth (87000, a value nothing in the run supports). It says there
    were too few healthy steps to derive one, offers no clipping edit, and names the learning rate."""
    a, _ = diverging
    (g,) = a.rule("grad-explosion")
    recorded = [r["grad_norm"] for d in numerics(a) for r in d["opt_steps"]]
    fin = [v for v in recorded[:next((i for i, v in enumerate(recorded) if not isinstance(v, float)), None)]]
    per = math.exp((math.log(fin[-1]) - math.log(fin[0])) / (len(fin) - 1))
    assert per > 10, "the trainer no longer diverges from its start: the test is void"  # (then .2f shows 4+ digits)
    assert f"about x{per:.3g} per step" in g["message"] and f"x{per:.2f}" not in g["message"], g["message"]
    healthy = [v for v in fin if v <= 3 * fin[0]]
    assert len(healthy) < 3
    ev, fix = g["evidence"], g["fix"]
    assert ev["suggested_max_norm"] is None and ev["healthy_steps"] == len(healthy), ev
    assert fix["edits"] == [] and fix["config"] == {"lr": 0.08}, fix
    assert fix["summary"].startswith(f"Lower the learning rate (now 0.8): the run had {len(healthy)} healthy step")
    assert "too few to derive a clipping max_norm from (3 are needed)" in fix["summary"], fix["summary"]
    assert "max_norm=" not in fix["summary"]


# --- amp-unscaled, lr-schedule ------------------------------------------------------------------

def test_fp16_autocast_without_a_scaler(run):
    a = run("numerics_amp_unscaled")
    f = one(a, "amp-unscaled", "numerics_amp_unscaled")
    assert f["evidence"]["steps"] == STEPS["numerics_amp_unscaled"] == f["evidence"]["backward_calls"]
    assert f["evidence"]["grad_scalers"] == 0
    assert "torch.bfloat16" in f["fix"]["edits"][0]["lines"][0]


def test_runaway_warmup(run):
    a = run("numerics_lr_warmup")
    f = one(a, "lr-schedule", "numerics_lr_warmup")
    recorded = [r["lrs"][0] for d in numerics(a) for r in d["opt_steps"]]
    assert [v for _, v in f["evidence"]["series"]] == recorded
    assert f["evidence"]["ratio"] == pytest.approx(max(recorded) / 1e-3, rel=1e-3) and f["evidence"]["ratio"] >= 4
    assert "min(1.0, (s + 1) / WARMUP)" in f["fix"]["edits"][0]["lines"][0]


def test_resumed_optimizer_state_overrides_the_configured_lr(run):
    a = run("numerics_lr_resume")
    f = one(a, "lr-schedule", "numerics_lr_resume")
    assert f["evidence"]["configured_lr"] == 1e-3 and f["evidence"]["lr_after"] == [3e-2]
    assert {v for _, v in f["evidence"]["observed"]} == {3e-2}
    assert any(loc["file"].endswith("_common.py") for loc in f["locations"])  # where lr=1e-3 was set


@pytest.mark.parametrize("example", ["clean", "numerics_clean"])
def test_clean_controls_stay_silent(run, example):
    a = run(example)
    assert a.returncode == 0, a.stderr
    assert [f for f in a.findings if f["rule"] in NUMERICS_RULES] == []
    steps = numerics(a)
    assert all(d["loss_finite"] and d["ops"] > 0 for d in steps)  # checked, and found healthy
    if example == "numerics_clean":
        assert all(d["scaler_scale_calls"] == 1 for d in steps)


# --- the collector never changes the training ---------------------------------------------------

PARITY = textwrap.dedent("""
    import hashlib, importlib.util, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from auditor.capture import probes
    from auditor.capture.numerics.collector import Numerics

    def train(path, steps, col):
        spec = importlib.util.spec_from_file_location("ex", path)  # a fresh module: it seeds itself
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        for i in range(steps):
            if col: col.step_begin(i)
            mod.step(i)
            if col: col.step_end(i)
        h = hashlib.sha256()
        for m in [v for v in vars(mod).values() if isinstance(v, torch.nn.Module)]:
            for k, v in m.state_dict().items():
                h.update(k.encode()); h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    runs = [(p, int(n)) for p, n in (a.split("=") for a in sys.argv[2:])]
    plain = [train(p, n, None) for p, n in runs]
    probes.install(); col = Numerics(); col.install()  # as the audit's child process does
    audited = [train(p, n, col) for p, n in runs]
    assert col.errors == 0, col.error_text
    for (p, _), a, b in zip(runs, plain, audited):
        print(p, a, b)
""")


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """PARITY over every program a test here holds to it, in one process: {name: (plain, audited)}
    weight digests. Each program is checked in every step it runs, as it would be alone: all run
    fewer steps than the dense start, where a step is checked whether or not an earlier program's
    NaN alarmed the collector (schedule.checked), and each file's call sites are its own."""
    tmp = tmp_path_factory.mktemp("parity")
    programs = {"numerics_nan_submodule": (EXAMPLES / "numerics_nan_submodule.py", STEPS["numerics_nan_submodule"]),
                "numerics_clean": (EXAMPLES / "numerics_clean.py", STEPS["numerics_clean"]),
                "lbfgs_nan": (tmp / "lbfgs_nan.py", 3),  # (the steps before its NaN)
                "l2norm": (tmp / "l2norm.py", 6), "l2norm_ok": (tmp / "l2norm_ok.py", 6)}
    for name, source in (("lbfgs_nan", LBFGS_NAN), ("l2norm", CUSTOM_BACKWARD), ("l2norm_ok", CUSTOM_BACKWARD_OK)):
        programs[name][0].write_text(source)
    p = subprocess.run([sys.executable, "-c", PARITY, str(EXAMPLES), *(f"{path}={n}" for path, n in programs.values())],
                       capture_output=True, text=True, cwd=ROOT, timeout=240, env={**os.environ, **ONE_THREAD})
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines()]
    assert [path for path, _, _ in rows] == [str(path) for path, _ in programs.values()], rows
    return {name: (plain, audited) for name, (_, plain, audited) in zip(programs, rows)}


def test_weights_match_a_plain_run(parity):
    """Same weights, bit for bit, with and without the collector: through a NaN (submodule) and
    through float16 autocast with a GradScaler, clipping and a scheduler (clean twin)."""
    for name in ("numerics_nan_submodule", "numerics_clean"):
        plain, audited = parity[name]
        assert plain == audited, name


# --- rule thresholds on small evidence ----------------------------------------------------------

def evidence_of(per_step: list[dict], events: list[dict] | None = None) -> Evidence:
    if per_step and events:
        per_step[0]["events"] = events
    steps = [StepRecord(index=i, start_s=float(i), ms=10.0, numerics=msgspec.convert(d, NumericsStep))
             for i, d in enumerate(per_step)]
    return Evidence(source="run", steps=steps)


def norms_evidence(norms: list[float]) -> Evidence:
    return evidence_of([{"opt_steps": [{"opt": 0, "site": 0, "lrs": [0.1], "grad_norm": n,
                                        "top_layers": [["fc", n, 1.0]]}]} for n in norms])


@pytest.mark.parametrize("norms, expect", [
    ([1.0] * 20, None),
    ([1.0, 1.1, 0.9, 1.2, 1.0, 9.0, 1.0, 1.1], None),  # 9x: under spike-ratio 10
    ([1.0, 1.1, 0.9, 1.2, 1.0, 50.0, 1.0, 1.1], "spike"),
    ([5.0, 3.0, 2.0, 1.5, 1.2, 1.0, 0.9, 0.8, 0.8, 0.7], None),  # falling: healthy
    ([1.5 ** k for k in range(12)], "growth"),
    # one jump, then level (a recorded run's norms: a std clamped at 1e-12 blew up at step 18): ranked,
    # they climb (rank correlation 0.89), but the jump is all of it; it was "grew steadily, x2.10 per step"
    ([1.2517, 0.9544, 1.6414, 1.3962, 1.312, 1.7771, 1.5882, 1.7158, 1.382, 1.7833, 1.5934, 2.2363, 2.3144, 2.1618, 2.016, 2.7786, 2.462, 2.5428, 10690000000.0, 7881000000.0, 5270000000.0, 2537000000.0, 26920000.0, 2067000000.0, 3517000000.0, 4375000000.0, 4511000000.0, 4057000000.0, 3558000000.0, 2834000000.0], "jump"),
    ([1.0, 2.0, 4.0, "inf", "nan"], None),  # too short to judge; nonfinite's to report
])
def test_grad_explosion_thresholds(norms, expect):
    found = list(GradExplosion().check(norms_evidence(norms), GradExplosion.default_options()))
    assert len(found) == (0 if expect is None else 1)
    if expect:
        ev = found[0].evidence
        assert (ev["spike"] is not None) == (expect in ("spike", "jump")) and (ev["growth"] is not None) == (expect == "growth")
        if expect == "jump":
            assert ev["spike"]["step"] == 18 and ev["growth"] is None, ev
            assert "jumped to 1.07e+10 at step 18, 4.34e+09x the median 2.46" in found[0].message
        elif expect == "spike":
            assert ev["spike"]["step"] == 5 and ev["spike"]["ratio"] == pytest.approx(50.0 / 1.0)
            assert ev["suggested_max_norm"] == pytest.approx(1.2, rel=0.1)


def scaler_evidence(scales: list[float]) -> Evidence:
    pairs = list(zip(scales, scales[1:]))
    return evidence_of([{"scaler_updates": [{"scaler": 0, "before": b, "after": a}]} for b, a in pairs],
                       events=[{"event": "grad_scaler", "scaler": 0, "enabled": True, "where": None}])


@pytest.mark.parametrize("scales, collapsed", [
    ([65536.0 / 2 ** k for k in range(6)] + [2048.0] * 20, False),  # calibration, then stable
    ([65536.0 / 2 ** k for k in range(20)], True),  # falls every update, never settles
    ([1024.0, 1024.0, 512.0, 512.0, 256.0, 256.0, 128.0, 128.0, 64.0, 64.0], True),  # every other step
    ([1024.0] * 5 + [512.0] + [512.0] * 10, False),  # one overflow
])
def test_scaler_collapse(scales, collapsed):
    found = list(AmpUnscaled().check(scaler_evidence(scales), AmpUnscaled.default_options()))
    assert len(found) == int(collapsed)
    if collapsed:
        assert found[0].evidence["last_scale"] == scales[-1]


def test_lr_that_a_scheduler_does_not_explain():
    """StepLR(step_size=2, gamma=0.5) from 0.1, but the observed lr stays 0.1: someone else writes it."""
    events = [{"event": "optimizer", "opt": 0, "type": "SGD", "lr": 0.1, "where": None},
              {"event": "scheduler", "sched": 0, "opt": 0, "type": "StepLR", "where": None,
               "attrs": {"step_size": 2, "gamma": 0.5}, "base_lrs": [0.1]}]
    ok = evidence_of([{"opt_steps": [{"opt": 0, "lrs": [0.1 * 0.5 ** (e // 2)], "sched_epochs": {"0": e}}]}
                      for e in range(8)], events)
    bad = evidence_of([{"opt_steps": [{"opt": 0, "lrs": [0.1], "sched_epochs": {"0": e}}]} for e in range(8)],
                      [dict(e) for e in events])
    assert list(LrSchedule().check(ok, LrSchedule.default_options())) == []
    found = list(LrSchedule().check(bad, LrSchedule.default_options()))
    assert len(found) == 1 and found[0].evidence["step"] == 2 and found[0].evidence["expected"] == pytest.approx(0.05)


TWIN_SCHEDULERS = """
import torch
from torch import nn

torch.manual_seed(0)
encoder, decoder = nn.Linear(8, 4), nn.Linear(4, 8)
enc_opt = torch.optim.AdamW(encoder.parameters(), lr=1e-3)
dec_opt = torch.optim.AdamW(decoder.parameters(), lr=2e-3)
enc_sched = torch.optim.lr_scheduler.StepLR(enc_opt, step_size=4, gamma=0.5)  # ENC LINE
dec_sched = torch.optim.lr_scheduler.StepLR(enc_opt, step_size=4, gamma=0.5)  # DEC LINE: the copy still names enc_opt
x = torch.randn(32, 8)

# the clean twin, in the same steps: each optimizer its own StepLR, and the decoder's chained with
# a warm-up (the chaining torch documents: a warm-up and a decay stepped together on one optimizer)
encoder2, decoder2 = nn.Linear(8, 4), nn.Linear(4, 8)
enc_opt2 = torch.optim.AdamW(encoder2.parameters(), lr=1e-3)
dec_opt2 = torch.optim.AdamW(decoder2.parameters(), lr=2e-3)
enc_sched2 = torch.optim.lr_scheduler.StepLR(enc_opt2, step_size=4, gamma=0.5)  # CLEAN ENC LINE
dec_sched2 = torch.optim.lr_scheduler.StepLR(dec_opt2, step_size=4, gamma=0.5)  # CLEAN DEC LINE
warm2 = torch.optim.lr_scheduler.LinearLR(dec_opt2, start_factor=0.5, total_iters=3)  # CLEAN WARM LINE


def step(i):
    loss = nn.functional.mse_loss(decoder(encoder(x)), x)
    enc_opt.zero_grad(); dec_opt.zero_grad()
    loss.backward()
    enc_opt.step(); dec_opt.step()
    enc_sched.step(); dec_sched.step()
    loss2 = nn.functional.mse_loss(decoder2(encoder2(x)), x)
    enc_opt2.zero_grad(); dec_opt2.zero_grad()
    loss2.backward()
    enc_opt2.step(); dec_opt2.step()
    enc_sched2.step(); dec_sched2.step(); warm2.step()
"""


def test_a_scheduler_copied_onto_the_wrong_optimizer(tmp_path):
    """The decoder's StepLR was copied from the encoder's and still names enc_opt: the encoder's lr
    is halved twice at each boundary, the decoder's never. Each scheduler alone explains nothing
    (the closed-form check needs one scheduler per optimizer), and two schedulers may be chained
    on purpose, so this went unreported. Two of one type with the same arguments are named, with
    the lr they make and the optimizer left without; a StepLR each, or a warm-up chained with a
    decay, stays silent (the clean twin trains in the same steps: the one finding is the copy's)."""
    import torch

    source = TWIN_SCHEDULERS
    trainer, a = audit_trainer(tmp_path, "twins.py", source, 6)
    [f] = a.rule("lr-schedule")  # (the clean twin's optimizers: nothing)
    ev = f["evidence"]
    # the truth, from torch itself: the optimizer stepped by both schedulers, and by one
    p = torch.nn.Parameter(torch.zeros(1))
    both, one = torch.optim.AdamW([p], lr=1e-3), torch.optim.AdamW([p], lr=1e-3)
    scheds = [torch.optim.lr_scheduler.StepLR(both, step_size=4, gamma=0.5) for _ in range(2)]
    single = torch.optim.lr_scheduler.StepLR(one, step_size=4, gamma=0.5)
    with warnings.catch_warnings():  # (no optimizer.step() before: only the lr is wanted)
        warnings.simplefilter("ignore")
        for _ in range(ev["step"]):
            for sc in (*scheds, single):
                sc.step()
    assert ev["step"] == 4 and ev["schedulers"] == 2
    assert ev["observed"] == pytest.approx(both.param_groups[0]["lr"]) and ev["one_scheduler"] == pytest.approx(
        one.param_groups[0]["lr"])
    lines = [line_of(source, "# DEC LINE"), line_of(source, "# ENC LINE")]
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(trainer), n) for n in lines]
    assert f"The AdamW at twins.py:{line_of(source, 'dec_opt = ')} has no StepLR" in f["message"], f["message"]
    # the clean twin's schedulers ran and stepped its optimizers (its silence is a check that ran):
    # the chained decoder's lr is the warm-up's factor times the StepLR's
    lrs = [r["lrs"][0] for d in numerics(a) for r in d["opt_steps"]]
    assert len(lrs) == 4 * 6 and lrs[3::4][:3] == pytest.approx([2e-3 * (0.5 + 0.5 * k / 3) for k in range(3)]), lrs


def test_near_miss_hazards_without_a_nan():
    sites = {"0": {"id": 0, "op": "torch.exp", "where": None, "hazard": "exp"},
             "1": {"id": 1, "op": "torch.log", "where": None, "hazard": "log"}}
    steps = [{"loss_finite": True, "hazards": [[0, 80.0 + k], [1, 1e-3]]} for k in range(8)]
    steps[0]["sites"] = sites
    found = list(Nonfinite().check(evidence_of(steps), Nonfinite.default_options()))
    assert [f.evidence["op"] for f in found] == ["torch.exp"]  # 87 is within 2 of exp's limit; 1e-3 is fine
    assert found[0].severity == "warning" and found[0].evidence["worst"] == 87.0
    assert found[0].evidence["steps_near"] == sum(1 for k in range(8) if 80.0 + k >= 88.72 - 2.0)
    assert math.isfinite(found[0].evidence["worst"])


LEAF_OVERFLOW = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        for p, v in ((self.body.weight, 0.0), (self.body.bias, 1.0), (self.head.weight, 1.0), (self.head.bias, 0.0)):
            nn.init.constant_(p, v)

    def forward(self, x, boost):
        h = torch.relu(self.body(x)) * boost
        return self.head(h)  # LEAF LINE


net = Net()
x = torch.randn(16, 8)


def step(i):
    boost = 3e38 if i >= 3 else 1.0  # finite (float32 max 3.4e38), but eight of them sum past it
    net.zero_grad()
    net(x, boost).mean().backward()
'''


def test_origin_inside_a_library_leaf_module(tmp_path):
    """nn.Linear is checked once, by the module hooks with the mode off inside it: its overflow is
    still the origin, named by module, op and the user's line of the module call."""
    trainer, a = audit_trainer(tmp_path, "leaf.py", LEAF_OVERFLOW, 5)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 3
    assert ev["op"] == "torch.nn.Linear" and ev["module"] == "head" and ev["hazard"]["kind"] == "overflow"
    assert ev["inputs"][0]["max"] == pytest.approx(3e38, rel=1e-6) and ev["inputs"][0]["finite"]
    assert ev["outputs"][0]["max"] == "inf"
    assert (str(trainer), line_of(LEAF_OVERFLOW, "# LEAF LINE")) in places(f)
    # body, the user's torch.relu, mul, head, mean: each leaf module is one op
    assert numerics(a)[0]["ops"] == 5


INPLACE_AFTER_LEAF = """
import torch
from torch import nn

torch.manual_seed(0)
body = nn.Linear(8, 8)
head = nn.Linear(8, 1)
x = torch.randn(16, 8)


def step(i):
    body.zero_grad()
    head.zero_grad()
    h = body(x)
    h.mul_(float("inf") if i >= 3 else 1.0)  # SCALE LINE
    head(h).mean().backward()
"""


INPLACE_LEAF_AFTER_LEAF = INPLACE_AFTER_LEAF.replace(
    "x = torch.randn(16, 8)\n", "x = torch.randn(16, 8)\ncut = nn.Threshold(-1e9, float('inf'), inplace=True)\n").replace(
    '    h.mul_(float("inf") if i >= 3 else 1.0)  # SCALE LINE',
    "    cut.threshold = 1e9 if i >= 3 else -1e9\n    h = cut(h)  # SCALE LINE")


INPLACE_VIEW_AFTER_LEAF = INPLACE_AFTER_LEAF.replace("    h.mul_(", "    h[:, :4].mul_(")
INPLACE_BASE_OF_A_VIEW = INPLACE_AFTER_LEAF.replace(
    "x = torch.randn(16, 8)\n", "x = torch.randn(16, 8)\nflat = nn.Flatten(0)\n").replace(
    "    h = body(x)\n", "    h = body(x)\n    v = flat(h)  # a view of h, checked late too\n").replace(
    "    head(h).mean().backward()", "    head(v.view(16, 8)).mean().backward()")


@pytest.mark.parametrize("source,op,ops", [(INPLACE_AFTER_LEAF, "Tensor.mul_", 4),
                                           (INPLACE_VIEW_AFTER_LEAF, "Tensor.mul_", 4),
                                           (INPLACE_BASE_OF_A_VIEW, "Tensor.mul_", 5),
                                           (INPLACE_LEAF_AFTER_LEAF, "torch.nn.Threshold", 4)],
                         ids=["op", "op-on-a-view", "op-on-the-base-of-a-view", "leaf-module"])
def test_an_in_place_write_into_a_leaf_output_is_the_origin(tmp_path, source, op, ops):
    """A CPU leaf call's output is checked late (when the loss shows the step went wrong), so a
    later in-place op or in-place leaf module that overwrites it must have it checked first:
    otherwise the Linear would be blamed for the inf written into its output."""
    trainer, a = audit_trainer(tmp_path, "inplace.py", source, 5)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 3 and ev["op"] == op
    assert ev["inputs"][0]["finite"] and ev["outputs"][0]["max"] == "inf"
    assert (str(trainer), line_of(source, "# SCALE LINE")) in places(f)
    assert [d["ops"] for d in numerics(a)] == [ops] * 5  # body, (flat,) mul_ or cut, head, mean


MASK_BY_DESIGN = """
import torch
from torch import nn

torch.manual_seed(0)
q, k, head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
x = torch.randn(4, 6, 8)
causal = torch.ones(6, 6, dtype=torch.bool).triu(1)


def step(i):
    for m in (q, k, head):
        m.zero_grad()
    scores = q(x) @ k(x).transpose(1, 2)
    scores = scores.masked_fill(causal, float("-inf"))  # MASK LINE: by design, every step
    temperature = 0.0 if i >= 20 else 1.0  # annealed to nothing: -inf * 0 is NaN
    attn = (scores * temperature).softmax(-1)  # TEMPERATURE LINE
    head(attn @ x).mean().backward()
"""


def test_a_masks_minus_inf_is_learned_as_benign_with_deferred_checks(tmp_path):
    """An attention mask's -inf is made in every healthy step. Deferred checks still reduce the
    calls of a few healthy steps, so that site is known to be by design, and the NaN of step 20 is
    traced to the temperature line (the multiply makes -inf in healthy steps too, so the first call
    there that makes a NaN out of by-design values is the softmax), not to the mask that came first."""
    trainer, a = audit_trainer(tmp_path, "mask.py", MASK_BY_DESIGN, 21)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 20 and ev["op"] == "Tensor.softmax", ev
    assert places(f) == {(str(trainer), line_of(MASK_BY_DESIGN, "# TEMPERATURE LINE"))}
    # steps 0-2 and 16 were reduced in full: the mask's -inf counted there; the others were settled by the loss
    assert [k for k, d in enumerate(numerics(a)[:20]) if d["nonfinite_ops"]] == [0, 1, 2, 16]


DEFERRED_VS_EAGER = r"""
import json, sys
import torch
from torch import nn
from auditor.capture import probes
from auditor.capture.numerics import collector as numerics
from auditor.capture.numerics import deferral

probes.install()
col = numerics.Numerics()
col.install()
col.defer_cpu = sys.argv[1] == "defer"
if sys.argv[2] == "tiny":
    deferral.DEFER_MAX_BYTES = 1  # every deferred call is reduced at once
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
nn.init.constant_(net[0].weight, 0.5)
opt = torch.optim.SGD(net.parameters(), lr=0.01)
x = torch.rand(32, 8)
out, sites = [], {}


def name(sid):  # site ids are interned in the order sites are first recorded: compare what they name
    site = sites[str(sid)]
    return [site["op"], site["where"]["line"] if site["where"] else None]


def named(d):
    d = dict(d)
    d["nonfinite_sites"] = sorted(map(name, d["nonfinite_sites"]))
    d["hazards"] = sorted([name(s), v] for s, v in d["hazards"])
    if "origin" in d:
        o = d["origin"] = dict(d["origin"])
        o["hazards"] = sorted([name(s), v] for s, v in o["hazards"])
        # (a weight's range is carried from where it was last measured: in the forward pass when
        # checked eagerly, after the update when the forward's checks were deferred)
        o["inputs"] = [{k: v for k, v in r.items() if "param" not in r or k not in ("min", "max")}
                       for r in o.get("inputs", [])]
        if "site" in o:
            o["site"] = name(o["site"])
    return d


for i in range(6):
    col.step_begin(i)
    opt.zero_grad()
    for half in x.chunk(2):  # two micro-batches: two backward passes a step
        h = net[0](half * (3e38 if i >= 4 else 1.0))  # finite; the first Linear's output is not
        h = net[1:](h)
        (h.mean() + torch.log(h.abs() + 1).mean()).backward()
    opt.step()
    with torch.no_grad():
        net(x).sum()  # after the last backward pass: settled at the step's end
    d = col.step_end(i)
    sites.update(d.get("sites", {}))
    out.append(named({k: d[k] for k in ("ops", "nonfinite_ops", "nonfinite_sites", "loss", "hazards", "origin")
                      if k in d}))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def deferral_records(tmp_path_factory):
    """DEFERRED_VS_EAGER's records for (mode, bound), each run once: the eager records are what
    both modes are compared with."""
    script = tmp_path_factory.mktemp("deferral") / "compare.py"
    script.write_text(DEFERRED_VS_EAGER)
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)}
    made: dict[tuple[str, ...], list] = {}

    def records(*args: str) -> list:
        if args not in made:
            p = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=120)
            assert p.returncode == 0, p.stderr
            made[args] = json.loads(p.stdout)
        return made[args]
    return records


@pytest.mark.parametrize("mode", ["defer", "tiny"])
def test_deferred_leaf_checks_record_what_eager_checks_do(deferral_records, mode):
    """The same steps, checked with CPU leaf calls deferred (settled by the loss, with two backward
    passes a step, an in-place ReLU, and calls after the last backward pass) or with the deferral
    bound forcing each to be reduced at once, give the very records of eager checks, origin included."""
    eager = deferral_records("eager", "-")
    assert eager[3].get("origin") is None
    line = line_of(DEFERRED_VS_EAGER, "h = net[0](")
    assert eager[4]["origin"]["step"] == 4 and eager[4]["origin"]["site"] == ["torch.nn.Linear", line]
    assert deferral_records("defer", "tiny" if mode == "tiny" else "-") == eager


INFERENCE_VALIDATION = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
x, x_val = torch.randn(16, 8), torch.randn(16, 8)


def step(i):
    with torch.inference_mode():  # validation: inference tensors have no version counter
        net(x_val).abs().mean()
    gain = 0.0 if i >= 6 else 1.0
    net.zero_grad()
    loss = torch.log(net(x).abs() * gain).mean()  # LOG LINE
    loss.backward()
"""


def test_inference_mode_inside_the_step_keeps_the_checks_on(tmp_path):
    """Tensors made under torch.inference_mode have no version counter: reading it raised in every
    step, and after a few steps' errors the collector turned itself off, before the NaN at step 6."""
    trainer, a = audit_trainer(tmp_path, "validate.py", INFERENCE_VALIDATION, 8)
    assert [d.get("collector_error") for d in numerics(a)] == [None] * 8
    [f] = a.rule("nonfinite")
    assert f["evidence"]["first_step"] == 6 and f["evidence"]["op"] == "torch.log"
    assert (str(trainer), line_of(INFERENCE_VALIDATION, "# LOG LINE")) in places(f)


def test_no_numerics_turns_the_checks_off(tmp_path):
    """`--no-numerics`: the collector is not even imported, steps carry no numerics evidence, and
    the numerics rules say why they were skipped instead of reporting nothing silently."""
    a = audit("run", "examples/numerics_log_zero.py:step", "--steps", str(STEPS["numerics_log_zero"]),
              "--no-profile", "--no-numerics", "--quiet", out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr
    assert a.rule("nonfinite") == []
    assert all(s["numerics"] is None for s in a.evidence["steps"])
    assert a.findings_doc["steps"]["numerics_check_median_ms"] is None
    skipped = {s["rule"]: s["reason"] for s in a.findings_doc["skipped_rules"]}
    assert "--no-numerics" in skipped["nonfinite"] and "--no-numerics" in skipped["grad-explosion"]
    # the probes' own hooks time the phases when the collector is off
    assert_phases(a, EXAMPLES / "numerics_log_zero.py", {"Sequential": 25}, {"SGD": 30})


LBFGS_NAN = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
x = torch.randn(64, 8)
scale = torch.ones(64, 1)


def closure():
    opt.zero_grad()
    z = model(x)
    loss = (torch.log(scale) * z).pow(2).mean() + z.pow(2).mean()  # LOG LINE
    loss.backward()
    return loss


def step(i):
    if i == 3:
        scale[5] = 0.0  # a zero reaches the log: -inf, then nan
    opt.step(closure)
"""


def test_an_optimizer_closure_is_checked_like_the_step(tmp_path, parity):
    """LBFGS runs the model inside opt.step(closure), where the update's own ops are not checked:
    the closure is the step's forward and backward, and is checked (it was not: no loss, no op,
    no gradient was seen, so a NaN had no origin). It trains exactly as it does plainly."""
    trainer, a = audit_trainer(tmp_path, "lbfgs_nan.py", LBFGS_NAN, 6)
    [f] = a.rule("nonfinite")
    assert f["evidence"]["first_step"] == 3 and f["evidence"]["op"] == "torch.log"
    assert (str(trainer), line_of(LBFGS_NAN, "# LOG LINE")) in places(f)
    healthy = numerics(a)[:3]
    assert all(d["losses"] > 1 for d in healthy)  # every evaluation of the closure in the step
    assert all(d["opt_steps"][0]["grad_norm"] > 0 for d in healthy)  # as the first update saw them
    plain, audited = parity["lbfgs_nan"]
    assert plain == audited


FLOAT64 = """
import torch
from torch import nn

torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 16), torch.randn(64, 1)


def step(i):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


def test_a_float64_model_keeps_the_checks_on(tmp_path):
    """Gradient norms were taken in float32, which torch refuses for float64 gradients: every step
    raised inside the collector until it turned itself off."""
    _, a = audit_trainer(tmp_path, "f64.py", FLOAT64, 4)
    steps = numerics(a)
    assert [d.get("collector_error") for d in steps] == [None] * 4
    assert all(d["opt_steps"][0]["grad_norm"] > 0 and d["loss"] > 0 for d in steps)


HALF_WEIGHTS = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).half()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # OPT LINE
x, y = torch.randn(256, 32).half(), torch.randn(256, 1).half()


def step(i):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()  # (mse_loss: torch 2.4 has no float16 backward of it on a CPU)
    opt.step()
"""


@pytest.fixture(scope="module")
def half_weights(tmp_path_factory):
    """HALF_WEIGHTS audited for 4 steps: the run both tests of float16 weights read."""
    return audit_trainer(tmp_path_factory.mktemp("half"), "half.py", HALF_WEIGHTS, 4)


def test_float16_weights_without_master_weights(half_weights):
    """`model.half()` and Adam: eps=1e-8 is 0 in float16, so the first update divides 0 by 0 where
    a ReLU left a gradient at exactly zero. The weights' ranges are re-measured after every update
    of float16 weights (an update with eps > 0 used to be trusted to keep them finite, and the NaN
    was then blamed on the next forward pass), and amp-unscaled says why."""
    trainer, a = half_weights
    [f] = a.rule("nonfinite")
    assert f["evidence"]["first_step"] == 0 and f["evidence"]["phase"] == "optimizer"
    assert "the Adam update made `0.weight`" in f["message"]
    [h] = a.rule("amp-unscaled")
    assert h["title"] == "float16 weights trained without master weights or loss scaling"
    # three float16 Linears: six parameters, each step
    assert h["evidence"]["fp16_params"] == 6 and h["evidence"]["steps"] == 4 and h["evidence"]["optimizers"] == ["Adam"]
    line = line_of(HALF_WEIGHTS, "# OPT LINE")
    assert [(loc["file"], loc["line"]) for loc in h["locations"]] == [(str(trainer), line)]
    assert "eps (1e-8) is 0 in float16" in h["message"]


SPARSE_GRADS = """
import torch
from torch import nn

torch.manual_seed(0)
emb = nn.Embedding(50, 8, sparse=True)
head = nn.Linear(8, 1)
sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=1e-2)
dense_opt = torch.optim.Adam(head.parameters(), lr=1e-2)
tokens = torch.randint(0, 50, (16, 4))


def step(i):
    e = emb(tokens)
    if i == 4:
        e = e * 0.0  # degenerate embeddings
    norm = torch.sqrt((e ** 2).sum(-1))  # SQRT LINE: sqrt(0) has an infinite derivative
    loss = head(e).pow(2).mean() + norm.mean()
    sparse_opt.zero_grad()
    dense_opt.zero_grad()
    loss.backward()
    sparse_opt.step()
    dense_opt.step()
"""


def test_sparse_gradients_are_checked(tmp_path):
    """An Embedding(sparse=True) gradient is checked like a dense one (it was skipped, and the
    report then called the NaN gradients finite). The suspect is the sqrt alone: x**2 at 0 has a
    finite derivative, so the pow on the same line is no hazard."""
    trainer, a = audit_trainer(tmp_path, "sparse.py", SPARSE_GRADS, 6)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 4 and ev["phase"] == "backward", ev
    assert "the backward pass made the gradients of `emb.weight` non-finite" in f["message"], f["message"]
    assert "torch.sqrt" in f["message"] and "Tensor.pow" not in f["message"]
    assert places(f) == {(str(trainer), line_of(SPARSE_GRADS, "# SQRT LINE"))}
    healthy = numerics(a)[3]["opt_steps"]
    assert [len(r["grad_norms"]) for r in healthy] == [1, 2] and all(r["grad_nonfinite"] == 0 for r in healthy)


UNDERFLOWED_LOG = """
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))


def cross_entropy(z, y):
    p = F.softmax(z, dim=-1)
    return -torch.log(p.gather(1, y[:, None])).mean()  # LOG LINE: a hand-rolled cross-entropy


def step(i):
    z = model(x)
    if i == 3:
        z = z - 95.0 * F.one_hot(y, 3)  # the target's probability underflows to ~1e-42, not to 0
    loss = cross_entropy(z, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_backward_nan_is_traced_to_the_log_whose_derivative_overflowed(tmp_path):
    """-log(softmax) with the probability at ~1e-42: the forward pass is finite (log = -96), but the
    log's derivative 1/p (~1e42) overflows float32 and the backward pass makes NaN. The error names
    the log's line with the clamp for its input (it had no location, a fix about sqrt, and the log
    only as a separate near-miss warning)."""
    trainer, a = audit_trainer(tmp_path, "underflow.py", UNDERFLOWED_LOG, 5)
    [f] = a.rule("nonfinite")
    ev, line = f["evidence"], line_of(UNDERFLOWED_LOG, "# LOG LINE")
    assert f["severity"] == "error" and ev["first_step"] == 3 and ev["phase"] == "backward", ev
    assert places(f) == {(str(trainer), line)}
    [s] = ev["singular_sites"]
    assert s["op"] == "torch.log" and 0 < s["value"] < 1e-38, s
    assert f"torch.log at underflow.py:{line}, whose smallest input was" in f["message"], f["message"]
    assert "overflows float32" in f["message"] and "sqrt" not in f["fix"]["summary"], f
    patch = patch_text(tmp_path / "out" / "fixes.patch")
    assert "+    return -torch.log(p.gather(1, y[:, None]).clamp_min(1e-12)).mean()" in patch, patch
    assert f"#   nonfinite underflow.py:{line} [changes results: review it]" in patch, patch



NAN_IN_COMPILED = """
import os
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        return torch.log(self.lin(x) - x[:, :1])  # the log of a negative value at step 3


net = Net()
with torch.no_grad():
    net.lin.bias.fill_(1.0)
cnet = torch.compile(net)  # a compiled model (inductor)
opt = torch.optim.SGD(net.parameters(), lr=1e-3)
xs = [torch.rand(16, 8) * 0.01 for _ in range(5)]
xs[3][5, 0] = 10.0


def train(x):
    loss = cnet(x).mean()  # MODEL LINE
    loss.backward()
    return loss


if os.environ["WHERE"] == "function":
    train = torch.compile(train)  # a compiled function: the backward pass in it too


def step(i):
    opt.zero_grad()
    train(xs[i])  # FUNCTION LINE
    opt.step()
"""


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("where", ["model", "function"])
def test_a_nan_made_inside_compiled_code_is_traced_to_the_compiled_call(tmp_path, where):
    """torch.compile runs a model's calls as its own kernels (inductor), unseen by the numerics
    checks, and the checks' mode is off the stack for each compiled call (it changed what dynamo
    traced). The NaN is still reported at its step, from the loss, and it is traced to the
    compiled call at the user's line that made it, as one call: `torch.compile(Net)` at the
    model's call, or `torch.compile(train)` for a compiled function that also runs the backward
    pass (its loss is checked there, without the mode). The NaN was blamed on the input data
    ('received an input that was already non-finite ... the input data') or on no call at all,
    and the fix says how to find the call inside: the same audit with torch.compile off."""
    trainer, a = audit_trainer(tmp_path, "compiled_nan.py", NAN_IN_COMPILED, 5, {"WHERE": where})
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert (ev["first_step"], ev["nonfinite"], ev["phase"]) == (3, ["loss"], "forward"), ev
    assert [d["loss_finite"] for d in numerics(a)] == [True, True, True, False, True]
    line = line_of(NAN_IN_COMPILED, "# MODEL LINE" if where == "model" else "# FUNCTION LINE")
    op = "torch.compile(Net)" if where == "model" else "torch.compile(train)"
    assert places(f) == {(str(trainer), line)} and ev["op"] == op, (places(f), ev["op"])
    assert ev["outputs"][0]["min"] == "nan" and all(r["finite"] for r in ev["inputs"]), ev
    assert ev["inputs"][0]["max"] == pytest.approx(10.0)  # (the row that makes the log's input negative)
    call = "`cnet(x)`" if where == "model" else "`train(xs[i])`"
    assert f"{op} ({call}) made non-finite values from finite inputs inside its compiled code" in f["message"], f["message"]
    assert "input data" not in f["message"] and "TORCHDYNAMO_DISABLE=1 audit run" in f["fix"]["summary"]



WRITTEN_IN_COMPILED = """
import torch
from torch import nn

torch.manual_seed(0)
lin = nn.Linear(8, 8)
opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
x, w = torch.randn(16, 8), torch.randn(8, 8)


@torch.compile
def scale_(h, s):
    h.mul_(s)  # a write into its argument, inside compiled code


def step(i):
    h = x @ w  # MATMUL LINE
    scale_(h, float("nan") if i == 3 else 1.0)  # SCALE LINE
    loss = lin(h).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")), reason="inductor needs a C++ compiler")
def test_a_nan_compiled_code_writes_into_its_argument_is_traced_to_the_compiled_call(tmp_path):
    """The output of `x @ w` is kept unreduced on the CPU until the loss settles it; a compiled
    function then wrote NaN into it, unseen by the checks, and the matmul was blamed ('Tensor.matmul
    (`x @ w`) made NaN from finite inputs'). A deferred output passed to compiled code is reduced
    before the call, and an argument the call wrote into counts as its output."""
    trainer, a = audit_trainer(tmp_path, "written.py", WRITTEN_IN_COMPILED, 5)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert (ev["first_step"], ev["nonfinite"], ev["op"]) == (3, ["loss", "gradient", "parameter"], "torch.compile(scale_)"), ev
    assert places(f) == {(str(trainer), line_of(WRITTEN_IN_COMPILED, "# SCALE LINE"))}
    assert [r["finite"] for r in ev["inputs"]] == [True] and ev["outputs"][0]["max"] == "nan", ev
    assert "made non-finite values from finite inputs inside its compiled code" in f["message"], f["message"]
    matmul = line_of(WRITTEN_IN_COMPILED, "# MATMUL LINE")
    assert f":{matmul}:" not in f["message"] and "x @ w" not in f["message"], f["message"]


COMPLEX_NAN = """
import torch
from torch import nn

torch.manual_seed(0)
w = nn.Parameter(torch.randn(16, 16, dtype=torch.cfloat) * 0.1)
lin = nn.Linear(16, 1)
opt = torch.optim.Adam([w, *lin.parameters()], lr=1e-3)
x = torch.randn(64, 16)


def step(i):
    z = torch.fft.fft(x) @ w
    if i == 4:
        z = z / (z - z)  # DIV LINE: complex 0/0
    loss = lin(z.abs()).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_complex_tensors_are_checked(tmp_path):
    """Complex values are checked through their real and imaginary parts: the complex 0/0 is the
    origin (unchecked, the blame went to the `abs` after it, as an overflow it was not), and a
    complex parameter's gradient is in the norms."""
    trainer, a = audit_trainer(tmp_path, "cplx.py", COMPLEX_NAN, 6)
    [f] = a.rule("nonfinite")
    assert f["evidence"]["first_step"] == 4 and f["evidence"]["op"] == "Tensor.div", f["evidence"]
    assert "divided by a value that reached 0" in f["message"], f["message"]
    assert places(f) == {(str(trainer), line_of(COMPLEX_NAN, "# DIV LINE"))}
    [healthy] = numerics(a)[3]["opt_steps"]
    assert len(healthy["grad_norms"]) == 3 and healthy["grad_nonfinite"] == 0


LATE_MASK = """
import torch
from torch import nn

torch.manual_seed(0)
head = nn.Linear(16, 1)
opt = torch.optim.Adam(head.parameters(), lr=1e-3)
x = torch.randn(8, 6, 16)


def step(i):
    pad = torch.zeros(8, 6)
    if i >= 5:
        pad[:, 4:] = float("-inf")  # padding appears late (past the healthy steps that learn)
    scores = (x @ x.transpose(1, 2)) / 4 + pad[:, None, :]  # MASK LINE: -inf by design
    y = head(scores.softmax(-1) @ x)
    scale = y.detach().abs().amax() * {zero}
    y = y / scale  # DIV LINE
    opt.zero_grad()
    y.pow(2).mean().backward()
    opt.step()
"""


@pytest.mark.parametrize("cols, zero, blamed", [("4:", "(0.0 if i == 6 else 1.0)", "# DIV LINE"),
                                                (":", "1.0", "# MASK LINE")])
def test_a_mask_that_appears_late_is_not_blamed_for_a_later_division(tmp_path, cols, zero, blamed):
    """A -inf mask written into a tensor (no checked call made it) first in step 5, past the
    healthy steps that learn what is by design: the division by zero of step 6 is the origin.
    When the mask itself is what breaks the step (every position masked: softmax of all -inf is
    NaN in step 5), the mask's line is named."""
    source = LATE_MASK.replace("{zero}", zero).replace("pad[:, 4:]", f"pad[:, {cols}]")
    trainer, a = audit_trainer(tmp_path, "late_mask.py", source, 8)
    [f] = a.rule("nonfinite")
    assert f["evidence"]["first_step"] == (6 if "DIV" in blamed else 5), f["evidence"]
    assert places(f) == {(str(trainer), line_of(source, blamed))}, f["message"]


def test_series_text_shows_each_step_once():
    from auditor.rules.nonfinite import _series_text

    text = _series_text("max_in", [[i, float(i)] for i in range(6)], 5)
    steps = [int(s) for s in __import__("re").findall(r"\(step (\d+)\)", text)]
    assert steps == [0, 1, 3, 4, 5], text


TWO_BLOCKS = """
import torch
from torch import nn

torch.manual_seed(0)
STATE = {"i": 0}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.l1(x) + (1e6 if STATE["i"] == 5 else 0.0)
        h = torch.exp(h)  # EXP LINE: overflows in the first block at step 5; the second gets NaN
        return x + self.l2(h / (1 + h))


model = nn.Sequential(Block(), Block(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(32, 16)


def step(i):
    STATE["i"] = i
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_origin_steps_value_is_the_origin_calls(tmp_path):
    """The series of the origin's hazard ends with what the origin call saw (1e6 into exp), not
    the NaN a later call at the same line received."""
    trainer, a = audit_trainer(tmp_path, "blocks.py", TWO_BLOCKS, 7)
    [f] = a.rule("nonfinite")
    assert f["evidence"]["first_step"] == 5 and places(f) == {(str(trainer), line_of(TWO_BLOCKS, "# EXP LINE"))}
    assert f["message"].rstrip(".").endswith("→ 1e+06 (step 5)"), f["message"]


FP16_HIDDEN_OVERFLOW = """
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
fc1, fc2 = nn.Linear(64, 32), nn.Linear(32, 4)
with torch.no_grad():
    fc1.weight.fill_(-1.0)
    fc1.bias.zero_()
fc1.requires_grad_(False)  # a frozen layer: no weight gradient of 0 * inf to give it away early
opt = torch.optim.SGD(fc2.parameters(), lr=1e-3)


def step(i):
    x = torch.ones(8, 64) * (1.0 if i == 0 else 7e4)  # past float16's 65504 from step 1
    if i == NAN_STEP:  # past the dense start (the hidden overflow keeps every step checked)
        x[:, ::2] *= -1  # +inf and -inf in one dot product: NaN
    with torch.autocast("cpu", dtype=torch.float16):
        h = F.relu(fc1(x))  # FC1 LINE: -inf from step 1, which the ReLU hides
        loss = fc2(h).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.fixture(scope="module")
def fp16_hidden(tmp_path_factory):
    """FP16_HIDDEN_OVERFLOW audited past the dense start (DENSE_STEPS + 4 healthy steps, each with
    the hidden overflow), then the step of its NaN: (trainer, audit, the NaN's step)."""
    from auditor.capture.numerics.schedule import DENSE_STEPS

    nan_step = DENSE_STEPS + 4
    trainer, a = audit_trainer(tmp_path_factory.mktemp("fp16"), "fp16.py",
                               FP16_HIDDEN_OVERFLOW.replace("NAN_STEP", str(nan_step)), nan_step + 1)
    return trainer, a, nan_step


def test_a_float16_overflow_a_relu_hid_is_not_learned_as_by_design(fp16_hidden):
    """A Linear under float16 autocast overflows to -inf in healthy steps (the ReLU after it hides
    it) and to NaN in a later step. Its site is not learned as non-finite by design (as a mask would
    be): a call with weights that overflows is never that. The origin is the Linear, as a float16
    overflow (its float32 input is finite, past 65504), with the bfloat16 fix; not the ReLU, and
    not "non-finite input data"."""
    trainer, a, nan_step = fp16_hidden
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == nan_step and ev["op"] == "torch.nn.Linear" and ev["hazard"]["kind"] == "fp16-overflow", ev
    assert places(f) == {(str(trainer), line_of(FP16_HIDDEN_OVERFLOW, "# FC1 LINE"))}
    assert f["fix"]["config"] == {"autocast.dtype": "bfloat16"}


HAND_BCE = """
import torch
from torch import nn

torch.manual_seed(0)


class HandBCE(nn.Module):
    def forward(self, p, y):
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # BCE LINE


model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit = HandBCE()
x, y = torch.randn(16, 4), (torch.arange(16) % 2).float()


def step(i):
    p = torch.sigmoid(model(x).squeeze(1).abs() * (1.0 if i < 3 else 1e4))  # from step 3 p reaches 1.0
    loss = crit(p, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_of_two_logs_on_a_line_the_one_that_hit_zero_is_named_and_patched(tmp_path):
    """`torch.log(1 - p)` hit 0, not `torch.log(p)` on the same line: the message shows that call
    and the patch clamps its operand only. The loss module is a root module: its name is said once."""
    trainer, a = audit_trainer(tmp_path, "hand_bce.py", HAND_BCE, 5)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 3 and ev["hazard"]["kind"] == "log-of-zero", ev
    assert places(f) == {(str(trainer), line_of(HAND_BCE, "# BCE LINE"))}
    assert "in `HandBCE.forward`" in f["message"] and "(HandBCE)" not in f["message"], f["message"]
    assert ": `torch.log(1 - p)` took the log of a value that reached 0" in f["message"], f["message"]
    [edit] = f["fix"]["edits"]
    assert edit["lines"] == ["        return -(y * torch.log(p) + (1 - y) * torch.log((1 - p).clamp_min(1e-12))).mean()"
                             "  # BCE LINE"]


DATA_WRITE = """
import torch
from torch import nn

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x, poison):
        h = self.fc1(x)
        if poison:
            h.{alias}[0, 3] = float("nan")  # DATA LINE: written behind autograd's back
        return self.fc2(h)  # FC2 LINE


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 8)


def step(i):
    loss = model(x, poison=(i == 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("alias", ["data", "detach()"])
def test_a_write_through_data_is_not_blamed_on_the_layer_that_made_the_tensor(tmp_path, alias):
    """`h.data[...] = nan` writes into fc1's output after fc1 ran, and `.data` does not even move
    h's version: fc1 made finite values, and fc2 received the NaN; neither "made" it."""
    source = DATA_WRITE.replace("{alias}", alias)
    trainer, a = audit_trainer(tmp_path, "data_write.py", source, 6)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 4 and ev["hazard"]["kind"] == "nonfinite-input", ev
    assert ev["module"] == "fc2" and places(f) == {(str(trainer), line_of(source, "# FC2 LINE"))}
    assert "a write through `.data`" in f["message"]


def test_a_norm_swinging_back_to_where_it_was_is_no_spike():
    """SGD with momentum swings the norm by 100x over tens of steps (a MoCo trainer, seen for
    real): climbing out of a trough to below the run's earlier peak is not an explosion."""
    swing = [0.003, 0.37, 0.67, 0.86, 0.82, 0.62, 0.35, 0.15, 0.06, 0.03, 0.014, 0.011, 0.035, 0.094,
             0.205, 0.382, 0.59, 0.81, 0.96, 1.08]
    assert list(GradExplosion().check(norms_evidence(swing), GradExplosion.default_options())) == []


def test_a_spike_after_a_tiny_first_norm_clips_at_the_typical_norm():
    """The first step's norm can be 100x below the rest: max_norm comes from the typical healthy
    norms (their median's range), not from that first one."""
    norms = [0.003, 0.5, 0.7, 0.55, 0.65, 0.5, 0.6, 0.45, 0.62, 0.5, 40.0]
    [f] = GradExplosion().check(norms_evidence(norms), GradExplosion.default_options())
    assert f.evidence["spike"]["step"] == 10
    assert 0.5 <= f.evidence["suggested_max_norm"] <= 0.7


ONE_LINE_STEP = """
import torch
from torch import nn

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def step(i):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()  # STEP LINE
"""


def test_clipping_goes_between_backward_and_step_on_a_one_line_step(tmp_path):
    """`opt.zero_grad(); loss.backward(); opt.step()` on one line: clipping inserted before the
    line would clip the gradients about to be zeroed. The line is split around the step."""
    from auditor.rules.grad_explosion import clip_edit

    path = tmp_path / "one_line.py"
    path.write_text(ONE_LINE_STEP)
    line = ONE_LINE_STEP.splitlines().index("    opt.zero_grad(); loss.backward(); opt.step()  # STEP LINE") + 1
    edit = clip_edit(str(path), line, 1.0)
    assert edit.lines == ["    opt.zero_grad(); loss.backward()",
                          '    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], max_norm=1)',
                          "    opt.step()  # STEP LINE"]


EMPTY_SEQUENCE = """
import torch
from torch import nn

torch.manual_seed(0)
T, D = 12, 32
emb = nn.Embedding(100, D)
attn = nn.MultiheadAttention(D, 4, batch_first=True)
head = nn.Linear(D, 2)
opt = torch.optim.AdamW([*emb.parameters(), *attn.parameters(), *head.parameters()], lr=1e-3)
g = torch.Generator().manual_seed(0)


def step(i):
    ids = torch.randint(1, 100, (8, T), generator=g)
    lens = torch.randint(1, T + 1, (8,), generator=g)
    if i == 6:
        lens[3] = 0  # an empty sequence: every key of row 3 is padding
    pad = torch.arange(T)[None] >= lens[:, None]
    x = emb(ids)
    h, _ = attn(x, x, x, key_padding_mask=pad)  # ATTN LINE
    loss = nn.functional.cross_entropy(head(h[:, 0]), torch.randint(0, 2, (8,), generator=g))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_row_masked_entirely_is_named_as_such_not_as_bad_input(tmp_path):
    """The -inf of a padding mask is by design; an empty sequence masks a whole row and the
    attention's softmax gives NaN. That is the origin, and repairing the inputs is not the fix."""
    trainer, a = audit_trainer(tmp_path, "empty_seq.py", EMPTY_SEQUENCE, 8)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 6 and ev["hazard"]["kind"] == "masked-row", ev["hazard"]
    assert places(f) == {(str(trainer), line_of(EMPTY_SEQUENCE, "# ATTN LINE"))}
    assert "a row masked entirely" in f["message"] and "nan_to_num" not in f["fix"]["summary"]


CAT_OF_A_LIST_EMPTIED = """
import torch
from torch import nn

torch.manual_seed(0)
head = nn.Linear(16, 1)
clean = torch.randn(4, 8)
dirty = clean.clone()
dirty[0, 0] = float("nan")


def step(i):
    head.zero_grad()
    parts = [clean, dirty if i >= 3 else clean]
    h = torch.cat(parts, dim=1)  # CAT LINE
    parts.clear()
    head(h).mean().backward()
"""


def test_a_deferred_call_keeps_the_inputs_of_a_list_the_user_empties(tmp_path):
    """A deferred call's tensor arguments are taken as they are and tested only if it is ever
    reduced; the tensors of a list argument are taken out of the list at the call, so that
    `parts.clear()` after `torch.cat(parts)` leaves the check its inputs: the NaN came in with
    the data, torch.cat did not make it."""
    trainer, a = audit_trainer(tmp_path, "cat.py", CAT_OF_A_LIST_EMPTIED, 5)
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert ev["first_step"] == 3 and ev["op"] == "torch.cat"
    assert [i["finite"] for i in ev["inputs"]] == [True, False]
    assert "received an input that was already non-finite" in f["message"]
    assert (str(trainer), line_of(CAT_OF_A_LIST_EMPTIED, "# CAT LINE")) in places(f)


CHECKPOINTED = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 8)


def step(i):
    scale = torch.zeros(()) if i == 5 else torch.ones(())
    loss = (model(x) / scale).pow(2).mean()  # DIV LINE: 0/0 at step 5
    opt.zero_grad()
    loss.backward()
    opt.step()
    if i % 2 == 1:
        torch.save(model.state_dict(), f"{CKPT}/step{i}.pt")
"""


def test_checkpoints_saved_after_the_weights_went_bad_are_named(tmp_path):
    """"loss=nan at epoch 29, and the checkpoint is poisoned": the run's torch.save calls are
    set against the step its weights went non-finite (5): step7.pt came after (poisoned), step5.pt
    in that step itself (maybe), and step3.pt is where to resume."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    trainer, a = audit_trainer(tmp_path, "ckpt.py", CHECKPOINTED.replace("{CKPT}", str(ckpt)), 9)
    [f] = a.rule("nonfinite")
    ck = f["evidence"]["checkpoints"]
    assert ck["weights_nonfinite_from_step"] == 5
    assert ck["poisoned"] == [{"step": 7, "path": str(ckpt / "step7.pt")}]
    assert ck["maybe_poisoned"] == [{"step": 5, "path": str(ckpt / "step5.pt")}]
    assert ck["clean"] == {"step": 3, "path": str(ckpt / "step3.pt")}
    assert "after the weights went non-finite (step 5): step7.pt; do not resume from them" in f["message"]
    assert f"Resume from {ckpt / 'step3.pt'} (saved in step 3)." in f["fix"]["summary"]
    assert torch_load_is_nan(ckpt / "step7.pt") and not torch_load_is_nan(ckpt / "step3.pt")


def torch_load_is_nan(path) -> bool:
    import torch

    return any(t.isnan().any().item() for t in torch.load(path, weights_only=True).values())


HOT_LR = """
import torch
from torch import nn

torch.manual_seed(0)
X = torch.randn(4096, 12) * 30.0  # raw, unscaled readings
Y = X[:, :4].sum(1, keepdim=True)
net = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))
sgd = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def step(i):
    idx = slice(i * 64, i * 64 + 64)
    loss = ((net(X[idx]) - Y[idx]) ** 2).mean()
    sgd.zero_grad()
    loss.backward()
    sgd.step()
"""


def plain_hot(trainer, steps: int) -> dict:
    """HOT_LR's plain run: its losses, and the last Linear's weight range as each step's forward
    pass sees it."""
    ranges = []
    with plain_run_here(trainer) as (g, losses):
        for i in range(steps):
            w = g["net"][2].weight  # as the step's forward sees it
            ranges.append([w.min().item(), w.max().item()])
            g["step"](i)
    return {"losses": list(losses), "ranges": ranges}


def test_a_learning_rate_that_overflows_names_it_and_the_weights_as_they_are(tmp_path):
    """Too high a learning rate: the loss climbs 4e3 -> 2e31 in three steps, and at the fourth the
    last Linear overflows in the forward pass. The gradients stay finite until then (only their
    float32 norm overflowed, at step 2, which was taken for a gradient overflow in the backward
    pass). The error names the Linear with the weights it really had at that step (a safe-looking
    update kept the weights' ranges of step 0, 1e23 times too small), says how the loss climbed,
    and the fix names the learning rate and offers a tenth of it."""
    trainer, a = audit_trainer(tmp_path, "hot.py", HOT_LR, 5)
    plain = plain_hot(trainer, 5)
    first = next(i for i, v in enumerate(plain["losses"]) if not math.isfinite(v))
    [f] = a.rule("nonfinite")
    ev = f["evidence"]
    assert (ev["first_step"], ev["phase"], ev["module"], ev["hazard"]["kind"]) == (first, "forward", "2", "overflow"), ev
    assert places(f) == {(str(trainer), line_of(HOT_LR, "loss = "))}
    weight = next(r for r in ev["inputs"] if r.get("param") == "2.weight")
    assert [weight["min"], weight["max"]] == pytest.approx(plain["ranges"][first], rel=1e-6)
    assert "measured_at_step" not in weight
    assert f"The loss had grown from " in f["message"] and f"(step {first - 1})." in f["message"], f["message"]
    assert "lower the learning rate (it is 0.05)" in f["fix"]["summary"]
    assert f["fix"]["config"] == {"lr": pytest.approx(0.005)}


CUSTOM_BACKWARD = """
import torch
from torch import nn

torch.manual_seed(0)


class L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        norm = x.norm(dim=-1, keepdim=True)  # NORM LINE
        y = x / norm.clamp_min(1e-12)
        ctx.save_for_backward(y, norm)
        return y

    @staticmethod
    def backward(ctx, gy):
        y, norm = ctx.saved_tensors
        return (gy - y * (gy * y).sum(-1, keepdim=True)) / norm  # DIV LINE


emb = nn.EmbeddingBag(100, 16, mode="sum")
proj = nn.Linear(16, 16, bias=False)
opt = torch.optim.Adam([*emb.parameters(), *proj.parameters()], lr=1e-3)
ids = torch.randint(0, 100, (64,))
offsets = torch.arange(0, 64, 4)


def step(i):
    weights = torch.ones(64)
    if i >= 4:
        weights[-4:] = 0.0  # the last row is padding from step 4 on: its embedding, and its norm, are 0
    z = L2Normalize.apply(proj(emb(ids, offsets, per_sample_weights=weights)))
    loss = -(z[:8] * z[8:]).sum(-1)[:7].mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
CUSTOM_BACKWARD_OK = CUSTOM_BACKWARD.replace("/ norm  # DIV LINE", "/ norm.clamp_min(1e-12)  # DIV LINE")


def test_a_nan_made_in_a_hand_written_backward_is_named_there(tmp_path):
    """A torch.autograd.Function's own backward divides by a norm that is 0 on a padding row: 0/0.
    Its ops are checked (torch calls it from C++ during loss.backward(), and the checks saw none of
    them), so the error names the division at its line, in that backward, with the clamp for its
    denominator; it blamed the forward's `x.norm` (whose derivative never ran: the Function's
    backward replaces it) with the fix 'norm.clamp_min(eps)' that the forward already applies.
    The two layers, held by two globals and each called on its own, are named by them (both
    gradients were `weight`)."""
    trainer, a = audit_trainer(tmp_path, "l2norm.py", CUSTOM_BACKWARD, 6)
    [f] = a.rule("nonfinite")
    ev, line = f["evidence"], line_of(CUSTOM_BACKWARD, "# DIV LINE")
    assert (ev["first_step"], ev["phase"], ev["function"]) == (4, "backward", "L2Normalize.backward"), ev
    assert ev["hazard"]["kind"] == "division-by-zero" and ev["params"] == ["emb.weight", "proj.weight"], ev
    assert places(f) == {(str(trainer), line)}
    numerator, den = ev["inputs"]
    assert den["min"] == 0.0 and den["max"] > 0 and numerator["finite"], ev["inputs"]
    assert ev["outputs"][0]["finite"] is False
    assert ("the backward pass made the gradients of `emb.weight`, `proj.weight` non-finite. It started in "
            f"`L2Normalize.backward`, a hand-written backward (torch.autograd.Function), at l2norm.py:{line}: ") in f["message"]
    patch = patch_text(tmp_path / "out" / "fixes.patch")
    assert "+        return (gy - y * (gy * y).sum(-1, keepdim=True)) / norm.clamp_min(1e-05)  # DIV LINE" in patch, patch
    names = next(d["param_lists"] for d in numerics(a) if d.get("param_lists"))
    assert list(names.values()) == [{"names": ["emb.weight", "proj.weight"], "layers": ["emb", "proj"]}]


def test_a_hand_written_backward_is_checked_in_healthy_steps_and_changes_nothing(tmp_path, parity):
    """The twin whose backward clamps its norm: no error, and its division is checked in every
    step (its smallest denominator, the clamp's 1e-12 once the padding starts, is recorded per step); with
    the collector on, the weights equal a plain run's, bit for bit, for both twins (NaN or not)."""
    trainer, a = audit_trainer(tmp_path, "l2norm_ok.py", CUSTOM_BACKWARD_OK, 6)
    assert [f for f in a.findings if f["rule"] in NUMERICS_RULES] == []
    steps = numerics(a)
    sites = {int(k): v for d in steps for k, v in (d.get("sites") or {}).items()}
    [div] = [s for s, v in sites.items() if v["where"]["line"] == line_of(CUSTOM_BACKWARD_OK, "# DIV LINE")
             and v.get("hazard") == "div"]
    dens = [next(v for s, v in d["hazards"] if s == div) for d in steps]
    assert len(dens) == 6 and all(v > 1 for v in dens[:4]) and dens[4:] == pytest.approx([1e-12] * 2), dens
    for name in ("l2norm", "l2norm_ok"):
        plain, audited = parity[name]
        assert plain == audited, name


def test_an_update_that_broke_more_than_four_parameters_says_how_many_more(half_weights):
    """Five float16 parameters made non-finite by one Adam update: the message names four and
    said nothing of the fifth (the evidence lists all five)."""
    _, a = half_weights
    [f] = a.rule("nonfinite")
    assert f["evidence"]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight"]
    assert "the Adam update made `0.weight`, `0.bias`, `2.weight`, `2.bias` and 1 more non-finite" in f["message"]



CLIP_SCALED = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.cuda.amp.GradScaler()  # SCALER LINE
# the clean twin, in the same steps: its scaler unscales before clipping
model2 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)).cuda()
opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
scaler2 = torch.cuda.amp.GradScaler()  # CLEAN SCALER LINE
x, y = torch.randn(64, 32).cuda(), torch.randint(0, 4, (64,)).cuda()


def step(i):
    opt.zero_grad(set_to_none=True)
    with torch.cuda.amp.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)  # CLIP LINE
    scaler.step(opt)
    scaler.update()

    opt2.zero_grad(set_to_none=True)
    with torch.cuda.amp.autocast():
        loss2 = nn.functional.cross_entropy(model2(x), y)
    scaler2.scale(loss2).backward()
    scaler2.unscale_(opt2)
    torch.nn.utils.clip_grad_norm_(model2.parameters(), max_norm=0.5)  # CLEAN CLIP LINE
    scaler2.step(opt2)
    scaler2.update()
"""


def test_clipping_before_unscale_is_named_with_its_fix(tmp_path):
    """clip_grad_norm_ between scaler.scale(loss).backward() and scaler.step(opt) with no
    scaler.unscale_(opt) clips the scaled gradients: their norm is 65536 times the true one, so
    the gradients SGD steps with are cut to a norm of 0.5/65536 (every step here). Nothing said so;
    the run looked healthy. The numerics patch inserts the unscale_ call; with it, silence (the
    twin that unscales first trains in the same steps, and nothing is said of its lines)."""
    source = CLIP_SCALED
    trainer, a = audit_trainer(tmp_path, "clip.py", source, 4)
    [f] = a.rule("amp-unscaled")  # (none for the twin that unscales)
    assert f["title"] == "Gradients clipped while still scaled by the GradScaler"
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [
        (str(trainer), line_of(source, "# CLIP LINE")), (str(trainer), line_of(source, "# SCALER LINE"))]
    assert f["evidence"]["scale"] == 65536.0 and f["evidence"]["steps"] == 4 and f["evidence"]["max-norm"] == 0.5
    assert "cut to a norm of at most 7.63e-06 instead of 0.5" in f["message"]  # 0.5 / 65536
    assert f["fix"]["changes_numerics"] is True
    [edit] = f["fix"]["edits"]
    line = line_of(source, "# CLIP LINE")
    assert (edit["start"], edit["end"], edit["lines"]) == (line, line - 1, ["    scaler.unscale_(opt)"])
    patch = patch_text(a.out / "fixes.patch")
    assert "+    scaler.unscale_(opt)\n" in patch and f":{line} [changes results: review it]" in patch
    assert "unscale_(opt2)" not in patch, patch
    # both scalers scaled every step's loss: the twin's silence is a check that ran
    assert [d["scaler_scale_calls"] for d in numerics(a)] == [2] * 4



WARNS = '''
import torch
import torch.nn.functional as F
t = torch.ones(2, 3, 4)

def step():
    a = torch.tensor(t)
    b = torch.tensor(t)
    c = F.softmax(t)
    d = F.softmax(t)
'''


def test_warnings_of_torch_calls_name_the_users_lines_with_the_checks_on(tmp_path):
    """A warning a torch call raises names the user's line, once per line, as in a plain run and
    with --no-numerics (with the checks on it named the auditor's file, and the second line's
    warning was suppressed as a repeat of the first). Unprofiled: every step is checked (a
    profiled step is not), so the first call of each line runs under the checks."""
    (tmp_path / "w.py").write_text(WARNS)
    shown = []
    for flags in ((), ("--no-numerics",)):
        a = audit("run", f"{tmp_path / 'w.py'}:step", "--steps", "3", "--no-profile", "-q", *flags,
                  out=tmp_path / f"o{len(flags)}")
        assert a.returncode == 0, a.stderr
        shown.append(sorted(ln.split(": UserWarning")[0] for ln in a.stderr.splitlines() if "UserWarning" in ln))
    assert shown[0] == shown[1] == sorted(f"{tmp_path / 'w.py'}:{n}" for n in (7, 8, 9, 10)), shown


def test_a_hidden_overflow_of_a_weighted_call_turns_the_checks_on_for_good(fp16_hidden):
    """The float16 Linear overflows to -inf from step 1 and the ReLU hides it (the loss stays
    finite): unlike a mask's -inf, a call with weights that overflows is not by design, so the run
    is alarmed and every step past the dense start is checked, where a healthy run checks one in 32.
    (The steps read here are those before the NaN the run ends with.)"""
    from auditor.capture.numerics.schedule import DENSE_STEPS

    _, a, nan_step = fp16_hidden
    recs = numerics(a)[:nan_step]
    assert len(recs) == DENSE_STEPS + 4
    assert all(d is not None for d in recs), [k for k, d in enumerate(recs) if d is None]
    assert all(d["loss_finite"] is True for d in recs) and recs[1]["nonfinite_ops"]
