"""Predicted against measured savings: `audit run EXAMPLE --verify` over the examples, one table.

    python bench/bench_verify.py [--steps S] [--out DIR] [EXAMPLE ...]

Each example (default: EXAMPLES; an argument is a TARGET as `audit run` takes it, e.g.
examples/demo.py:step) is audited with `--verify`, which re-runs the program with each fix applied
(auditor.verify) and writes verify-table.json: per fix the saving per step the audit predicted (the
finding's cost), the one measured (the median step before less the re-run's), their ratio and the
re-run it comes from, and the measured saving on the process's CPU clock (steadier on a loaded
machine; a fix that moves work to other processes, DataLoader workers, saves more of it); and a row for every fix together (the headline's figure against the re-run
with all of them). This prints those rows for every example, with whether the prediction is
within GOAL of the measured saving, and the device the runs used (the CPU, or the GPU where one is
at hand: the examples are GPU code that a CPU rehearses, and a rehearsal's timings are CPU timings).
A fix verified inside fixes.patch shares that re-run's saving with the others in it.

On a loaded machine the medians move with the load: compare a row's ratio only with rows of the
same run, and repeat a run whose 'every fix together' row disagrees with its fixes' rows.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("examples/demo.py:step", "examples/anomaly_mode.py:step", "examples/peak_stats_reset.py:step",
            "examples/host_sync.py:step", "examples/dataloader_bound.py:step", "examples/graph_leak.py:step")
GOAL = 0.25  # a prediction within this share of the measured saving


def device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu"


def audit(target: str, steps: int, out: Path) -> list[dict]:
    """The example audited with --verify; its verify-table.json rows (none when it could not run)."""
    cmd = [sys.executable, "-m", "auditor", "run", target, "--steps", str(steps), "--out", str(out), "--verify",
           "--quiet"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    table = out / "verify-table.json"
    if p.returncode not in (0, 1) or not table.is_file():
        last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        print(f"{target}: no table ({last})", file=sys.stderr)
        return []
    return json.loads(table.read_text())


def fmt(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*", default=list(EXAMPLES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="where the audits' output directories go")
    args = ap.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="bench-verify-"))
    print(f"device: {device()}; {args.steps} steps per audit; outputs in {base}")
    print(f"{'example':<34}{'fix':<24}{'predicted':>10}{'measured':>10}{'ratio':>8}{'cpu time':>10}  "
          f"within {GOAL:.0%}  run")
    held = total = 0
    for i, target in enumerate(args.targets):
        for row in audit(target, args.steps, base / f"{i}-{Path(target.split(':')[0]).stem}"):
            pred, meas = row.get("predicted_ms"), row.get("measured_ms")
            ok = pred is not None and meas is not None and meas > 0 and abs(pred - meas) <= GOAL * meas
            if pred is not None and meas is not None:
                total += 1
                held += ok
            print(f"{target:<34}{row['fix']:<24}{fmt(pred):>10}{fmt(meas):>10}{fmt(row.get('ratio')):>8}"
                  f"{fmt(row.get('measured_cpu_ms')):>10}  "
                  f"{'yes' if ok else 'no':<10}  {row.get('run', '')}")
    print(f"{held} of {total} predictions within {GOAL:.0%} of the measured saving")


if __name__ == "__main__":
    main()
