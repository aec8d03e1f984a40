"""Predicted against measured savings: `audit run EXAMPLE --verify` over the examples, one table.

    python bench/bench_verify.py [--steps S] [--repeat N] [--out DIR] [EXAMPLE ...]

Each example (default: EXAMPLES; an argument is a TARGET as `audit run` takes it, e.g.
examples/demo.py:step) is audited with `--verify`, which re-runs the program with fixes applied
(auditor.verify) and writes verify-table.json: per re-run the fixes it held, the saving per step
the audit predicted for them together (in a rehearsal, of this machine's time: a GPU estimate is
named apart, not measured here), the one measured (the median step before less the re-run's),
their ratio, and the measured saving on the process's CPU clock (steadier on a loaded machine; a
fix that moves work to other processes, DataLoader workers, saves more of it); and a row for every
fix together where that is a re-run of its own. With --repeat N each example is audited N times
and a row shows the medians of its figures. This prints those rows for every example, with whether the prediction is
within GOAL of the measured saving, and the device the runs used (the CPU, or the GPU where one is
at hand: the examples are GPU code that a CPU rehearses, and a rehearsal's timings are CPU timings).

On a loaded machine the medians move with the load: compare a row's ratio only with rows of the
same run, and repeat a run whose 'every fix together' row disagrees with its fixes' rows.
"""
from __future__ import annotations

import argparse
import json
import statistics
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


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*", default=list(EXAMPLES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=1, help="audits per example; a row's figures are their medians")
    ap.add_argument("--out", type=Path, default=None, help="where the audits' output directories go")
    args = ap.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="bench-verify-"))
    print(f"device: {device()}; {args.steps} steps per audit, {args.repeat} audit(s) per example (medians); "
          f"outputs in {base}")
    print(f"{'example':<34}{'predicted':>10}{'measured':>10}{'ratio':>8}{'cpu time':>10}  within {GOAL:.0%}  "
          "fixes the re-run held (run)")
    held = total = 0
    for i, target in enumerate(args.targets):
        rows: dict[str, list[dict]] = {}
        for r in range(args.repeat):
            for row in audit(target, args.steps, base / f"{i}-{Path(target.split(':')[0]).stem}-{r}"):
                rows.setdefault(row["fix"], []).append(row)
        for name, same in rows.items():
            pred = median([x["predicted_ms"] for x in same if x.get("predicted_ms") is not None])
            meas = median([x["measured_ms"] for x in same if x.get("measured_ms") is not None])
            cpu = median([x["measured_cpu_ms"] for x in same if x.get("measured_cpu_ms") is not None])
            ok = pred is not None and meas is not None and meas > 0 and abs(pred - meas) <= GOAL * meas
            if pred is not None and meas is not None:
                total += 1
                held += ok
            ratio = pred / meas if pred is not None and meas else None
            first = same[0]
            apart = "; ".join(f"{u['fix']}: {u['why'][:60]}" for u in first.get("unpredicted", []))
            print(f"{target:<34}{fmt(pred):>10}{fmt(meas):>10}{fmt(ratio):>8}{fmt(cpu):>10}  "
                  f"{('yes' if ok else 'no') if pred is not None and meas is not None else '-':<10}  {' + '.join(first.get('fixes', [name]))} ({first.get('run', '')}"
                  f"{', n=%d' % len(same) if args.repeat > 1 else ''})" + (f" [not predicted: {apart}]" if apart else ""))
    print(f"{held} of {total} predictions within {GOAL:.0%} of the measured saving")


if __name__ == "__main__":
    main()
