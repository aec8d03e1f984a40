"""How many findings carry a patch that `--verify` proves, on the CPU stand-ins of the public programs
of issue #35 (tests/data/public_shapes: x-transformers train_enwik8, pytorch/examples
time_sequence_prediction, gat, actor_critic, reinforce, makemore).

    python bench/bench_public_patches.py [--steps N] [NAME ...]

Each program is copied into its own scratch git repository and audited there as a user would run it
(`audit run NAME.py --no-profile --verify`), with the auditor the interpreter imports (point
PYTHONPATH at another checkout to measure it). Per program: the audit's exit code, its findings
(rule:line), those whose fix holds code edits, those --verify proved (`improved`), and whether the
patch files written are non-empty and `git apply --check` takes them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = Path(__file__).resolve().parent.parent / "tests" / "data" / "public_shapes"


def audit_one(program: Path, steps: int | None) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-public-"))
    try:
        shutil.copy(program, work / program.name)
        subprocess.run(["git", "init", "-q"], cwd=work, check=True)
        cmd = [sys.executable, "-m", "auditor", "run", program.name, "--no-profile", "--verify", "--quiet",
               "--out", "out"] + (["--steps", str(steps)] if steps else [])
        p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            doc = json.loads((work / "out" / "findings.json").read_text())
        except (OSError, ValueError):
            doc = {"findings": []}
        findings = doc["findings"]
        patches = {}
        for name in ("fixes.patch", "numerics-fixes.patch"):
            f = work / "out" / name
            if f.exists():
                check = subprocess.run(["git", "apply", "--check", str(f)], cwd=work, capture_output=True, text=True)
                patches[name] = "applies" if f.stat().st_size and check.returncode == 0 else (
                    f"empty ({check.stderr.strip()})" if not f.stat().st_size else f"refused: {check.stderr.strip()}")
        fixes = [f for f in findings if f.get("fix")]
        return {
            "program": program.name, "exit": p.returncode,
            "findings": [f"{f['rule']}:{(f['locations'] or [{}])[0].get('line')}" for f in findings],
            "with_edits": [f["rule"] for f in fixes if f["fix"]["edits"]],
            "verified": [f["rule"] for f in fixes if (f["fix"].get("verified") or {}).get("status") == "improved"],
            "patch_files": patches,
            "verify_lines": [ln.strip() for ln in p.stdout.splitlines() if ln.startswith(("verify", "  "))],
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    programs = [SHAPES / f"{n}.py" for n in args.names] or sorted(SHAPES.glob("*.py"))
    total = verified = 0
    for prog in programs:
        r = audit_one(prog, args.steps)
        total += len(r["findings"])
        verified += len(r["verified"])
        print(f"{r['program']}: exit {r['exit']}; {len(r['findings'])} finding(s) {', '.join(r['findings'])}; "
              f"with edits: {', '.join(r['with_edits']) or '-'}; verified: {', '.join(r['verified']) or '-'}; "
              f"patch files: {r['patch_files'] or '-'}")
        for ln in r["verify_lines"]:
            print(f"    {ln}")
    print(f"all: {verified} of {total} findings carry a patch --verify proves")


if __name__ == "__main__":
    main()
