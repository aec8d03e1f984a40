"""Compare what `audit analyze` writes for the recorded traces under tests/fixtures (and any
other paths given) between two checkouts of auditor: findings.json and evidence.json must be
byte-identical once timing fields are dropped. A speed change to the parser or the rules runs this
before it is committed.

    python bench/compare_findings.py /work/main . [--also /path/to/tiled.pt.trace.json]

Exit 0 when every input gives the same output in both trees; 1 with the first differences.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
# keys whose values measure the analysis itself, not the recording (the allocator replay's time)
TIMING_KEYS = ("seconds", "elapsed", "timing", "replay_ms")


def inputs() -> list[Path]:
    out = sorted((FIXTURES / "traces").glob("*.json.gz"))
    out += sorted((FIXTURES / "h100" / "plain").glob("*.json.gz"))
    out += sorted(p for p in (FIXTURES / "h100" / "audited").iterdir() if p.is_dir())
    return out


def strip(o: object, out: str = "") -> object:
    """`o` without timing fields, the output directory named `<out>` (each tree writes to its own)."""
    if isinstance(o, dict):
        return {k: strip(v, out) for k, v in o.items() if not any(t in k.lower() for t in TIMING_KEYS)}
    if isinstance(o, list):
        return [strip(v, out) for v in o]
    if isinstance(o, str) and out:
        return o.replace(out, "<out>")
    return o


def differences(a: object, b: object, at: str = "") -> list[str]:
    """Paths where two decoded JSON documents differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys(), key=str) for d in differences(a.get(k), b.get(k), f"{at}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{at}[{i}]")]
    return [] if a == b else [f"{at}: {json.dumps(a)[:150]} vs {json.dumps(b)[:150]}"]


def analyze(tree: Path, path: Path, out: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-c", "from auditor.cli import main; main()", "analyze", str(path),
                           "--out", str(out), "-q"], env=env, capture_output=True, text=True, check=False)
    got: dict[str, object] = {"exit": proc.returncode}
    for name in ("findings.json", "evidence.json"):
        f = out / name
        got[name] = strip(json.loads(f.read_text()), str(out)) if f.exists() else None
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--also", type=Path, action="append", default=[], help="more traces or directories")
    a = ap.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate([*inputs(), *a.also]):
            b = analyze(a.before.resolve(), path, Path(tmp) / f"b{i}")
            c = analyze(a.after.resolve(), path, Path(tmp) / f"a{i}")
            same = b == c
            n = len(b["findings.json"]["findings"]) if isinstance(b["findings.json"], dict) else "-"
            print(f"{'same' if same else 'DIFFERENT':9s} {n!s:>3s} findings  {path}", flush=True)
            if not same:
                bad += 1
                for d in differences(b, c)[:10]:
                    print(f"    {d}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
