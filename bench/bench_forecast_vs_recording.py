"""The OOM forecast of a rehearsed program against a real recording of the same program.

    python bench/bench_forecast_vs_recording.py [--batch 4 --context 128] [--write]

The recording: tests/fixtures/snapshots/transformer_fullstep_with_history.pickle, one full
training step (forward, loss, backward, AdamW step) of Stanford CS336's 2.7B-shaped Transformer LM
(d_model 2560, d_ff 10240, 32 layers, 32 heads, vocab 10000, batch 4, context 128, fp32) on an 80 GB
GPU. The program: tests/data/cs336_transformer.py, a re-implementation of it, run by `audit run` in
CUDA rehearsal (this machine has no GPU and 23 GB of RAM: the 54 GB step cannot be rehearsed whole)
at 1 and then 2 layers, each in its own process, at the recorded width, batch and context. The
figures compared are the forecast's own (the snapshot each rehearsed `_dump_snapshot` writes, read
by auditor.evidence.allocator.analysis as `audit analyze` reads it) and the recording's replay:

  (a) the requests alive when the step ends, by phase (parameters made before the history, gradients,
      optimizer state), per layer (2 layers - 1 layer) and for 32 layers, against the recording's;
  (b) every request of the step, by phase: what the rehearsal does not see;
  (c) the peaks of 32 layers extrapolated, peak(1) + 31 * (peak(2) - peak(1)), against the
      recording's allocated and reserved peaks: the error in percent.

--write copies the two rehearsed snapshots to tests/data/forecast/, which
tests/evidence/allocator/test_forecast_vs_recording.py reads.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "data"))

from forecast_compare import RECORDED_LAYERS, SHAPE, difference, extrapolate, phases, whole_model  # noqa: E402

from auditor.evidence.allocator.analysis import analyze  # noqa: E402
from auditor.evidence.snapshot import GiB, load_snapshot  # noqa: E402

RECORDING = ROOT / "tests" / "fixtures" / "snapshots" / "transformer_fullstep_with_history.pickle"
PROGRAM = ROOT / "tests" / "data" / "cs336_transformer.py"
STORED = ROOT / "tests" / "data" / "forecast"


def rehearse(layers: int, batch: int, context: int, out: Path) -> tuple[Path, float]:
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "auditor", "run", str(PROGRAM), "--to-end", "--no-profile", "--quiet",
           "--device-memory", "80", "--out", str(out / f"run{layers}"), "--",
           "--layers", str(layers), "--batch", str(batch), "--context", str(context), "--out-dir", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"audit run failed ({p.returncode}): {p.stderr[-2000:]}")
    return out / f"fullstep_L{layers}.pickle", time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=SHAPE["batch"])
    ap.add_argument("--context", type=int, default=SHAPE["context"])
    ap.add_argument("--write", action="store_true", help="store the rehearsed snapshots for the test")
    a = ap.parse_args()
    rec = load_snapshot(RECORDING)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        (p1, t1), (p2, t2) = rehearse(1, a.batch, a.context, out), rehearse(2, a.batch, a.context, out)
        s1, s2 = load_snapshot(p1), load_snapshot(p2)
        if a.write:
            STORED.mkdir(exist_ok=True)
            shutil.copy(p1, STORED / p1.name)
            shutil.copy(p2, STORED / p2.name)
    print(f"rehearsals at batch {a.batch}, context {a.context}: 1 layer {t1:.0f} s, 2 layers {t2:.0f} s")
    same = (a.batch, a.context) == (SHAPE["batch"], SHAPE["context"])
    print("\n(a) requests alive when the step ends, whole model (recording - forecast | forecast - recording):")
    R, F1, F2 = phases(rec, True), phases(s1, True), phases(s2, True)
    for ph in ("before", "backward", "step") + (("forward",) if same else ()):
        more, fewer = difference(R[ph], whole_model(F1[ph], F2[ph], RECORDED_LAYERS))
        print(f"  {ph:9s} recorded {sum(R[ph].values()):5d} requests: {more or 'none'} | {fewer or 'none'}")
    if same:
        print("\n(b) every request of the step (recording - forecast; the forecast has none the recording lacks):")
        R, F1, F2 = phases(rec, False), phases(s1, False), phases(s2, False)
        for ph in ("before", "forward", "backward", "step"):
            more, fewer = difference(R[ph], whole_model(F1[ph], F2[ph], RECORDED_LAYERS))
            print(f"  {ph:9s} recorded {sum(R[ph].values()):5d}, forecast {sum(R[ph].values()) - sum(more.values()):5d}: "
                  f"missing {more or 'none'}" + (f"; extra {fewer}" if fewer else ""))
    r0, r1, r2 = analyze(rec, 0), analyze(s1, 0), analyze(s2, 0)
    print(f"\n(c) peaks of {RECORDED_LAYERS} layers: peak(1) + {RECORDED_LAYERS - 1} * (peak(2) - peak(1))")
    print(f"  {'':22s} {'1 layer':>15s} {'2 layers':>15s} {'forecast':>15s} {'recorded':>15s} {'error':>8s}")
    for k in ("allocated_peak_bytes", "reserved_peak_bytes"):
        one, two, got = getattr(r1.recorded, k), getattr(r2.recorded, k), getattr(r0.recorded, k)
        f = extrapolate(one, two, RECORDED_LAYERS)
        print(f"  {k:22s} {one:15,d} {two:15,d} {f:15,d} {got:15,d} {(f - got) / got * 100:+7.2f}%"
              f"  ({f / GiB:.2f} vs {got / GiB:.2f} GiB)")


if __name__ == "__main__":
    main()
