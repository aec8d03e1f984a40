"""Wall time and the driver's peak RSS of `audit analyze` on a job of many ranks, per engine.

Makes a job of --ranks per-rank traces (default 64) from the recorded 2-rank DDP fixture, each tiled
to about --mb MB (bench/tile_trace.py), its distributedInfo rewritten, one rank slowed
1.5x (tests/evidence/rank_jobs.py), then runs, each in a fresh process:

  serial   `audit analyze DIR --workers 1`: every rank reduced in the driver, one after another
  before   `audit analyze DIR` of the code at --before REF (a `git archive` of it): before the
           engines, every trace was parsed in turn in the driver (ranks.traces.merge_traces)
  local    `audit analyze DIR --engine local`: a process pool, one worker per core
  dask     `audit analyze DIR --engine dask`: a LocalCluster of one worker process per core

and reports wall time, the driver's peak RSS (VmHWM of that process alone, polled; beside it the largest
peak of a process it started: a worker, the process the rules run in) and its own CPU
time (the work left in the driver; the machine's load average beside it), the rank
each names as the straggler, and the reduction's cost per GB of trace on one core (reduce_trace in
this process, over a few ranks: CPU time, and wall time under the machine's load).

    python bench/bench_ranks.py [--ranks 64] [--mb 8] [--engines serial,before,local,dask] [--keep DIR]
                                [--before REF]   # default 0b59cae, the last commit before the engines
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "evidence"))
TILE = ROOT / "bench" / "tile_trace.py"

import rank_jobs  # noqa: E402



OLD_TREE = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in "
            "getattr(f, '__module__', '')]; sys.path.insert(0, {tree!r}); import auditor; "
            "assert auditor.__file__.startswith({tree!r}), auditor.__file__; "
            "from auditor.cli import main; main(sys.argv[1:])")

OLD_SITE = ("import sys\nsys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in "
            "getattr(f, '__module__', '')]\nsys.path.insert(0, {tree!r})\n")


def make_job(directory: Path, ranks: int, mb: float, slow: int) -> list[Path]:
    """`directory/rank-K.pt.trace.json`, each the fixture tiled to ~mb MB; rank `slow` stretched."""
    doc = rank_jobs.load_fixture()
    tiles = {}
    for kind, d in (("fast", rank_jobs.waiting(doc, 1.5)), ("slow", rank_jobs.stretched(doc, 1.5))):
        src = directory / f"_{kind}.json"
        src.write_text(json.dumps(d))
        tiled = directory / f"_{kind}.tiled.json"
        subprocess.run([sys.executable, str(TILE), str(src), str(tiled), "--mb", str(mb)], check=True,
                       capture_output=True)
        data = tiled.read_bytes()
        at = data.index(b'"traceEvents": [')
        tiles[kind] = (json.loads(data[:at].rstrip().rstrip(b",") + b"}"), data[at:])
        src.unlink()
        tiled.unlink()
    paths = []
    for r in range(ranks):
        header, body = tiles["slow" if r == slow else "fast"]
        header = {**header, "distributedInfo": {**header["distributedInfo"], "rank": r, "world_size": ranks},
                  "hostname": f"node-{r // 8}"}
        p = directory / f"rank-{r}.pt.trace.json"
        with open(p, "wb") as fh:
            fh.write(json.dumps(header)[:-1].encode() + b", " + body)
        paths.append(p)
    return paths


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                kids = [int(c) for c in (task / "children").read_text().split()]
                out += kids
                todo += kids
        except (OSError, ValueError):
            pass
    return out


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_measured(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[float, int, float, str, int, int]:
    """(wall s, peak RSS of that process alone in bytes, its own CPU s, stdout, return code, the
    largest peak RSS of a process it started: a pool's worker, the process the rules run in)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    peak = child = 0
    cpu = 0.0
    status, stat = Path(f"/proc/{proc.pid}/status"), Path(f"/proc/{proc.pid}/stat")
    tick = os.sysconf("SC_CLK_TCK")
    while proc.poll() is None:
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cpu = max(cpu, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime of the driver alone
        except (OSError, IndexError, ValueError):
            pass
        child = max([child] + [_hwm(c) for c in _descendants(proc.pid)])
        time.sleep(0.02)
    out, err = proc.communicate()
    if proc.returncode not in (0, 1):
        print(err, file=sys.stderr)
    return time.perf_counter() - started, peak, cpu, out, proc.returncode, child


def per_gb(paths: list[Path], n: int = 4) -> tuple[float, float, int]:
    """CPU seconds and wall seconds per GB to reduce a rank's trace in one process (the CPU time is
    what a worker on an idle core takes; the wall time here includes the machine's other load), and
    a summary's size in bytes."""
    import msgspec

    from auditor.evidence.ranks.summary import reduce_trace

    reduce_trace(str(paths[-1]))  # (the first call imports the reader: not counted)
    cpu = wall = size = 0.0
    encoded = 0
    for p in paths[:n]:
        c0 = time.process_time()
        s = reduce_trace(str(p))
        cpu += time.process_time() - c0
        wall += s.seconds
        size += s.bytes
        encoded = max(encoded, len(msgspec.msgpack.encode(s)))
    return cpu / (size / 1e9), wall / (size / 1e9), encoded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--mb", type=float, default=8.0, help="size of each rank's trace (MB)")
    ap.add_argument("--engines", default="serial,before,local,dask")
    ap.add_argument("--keep", type=Path, default=None, help="make (or reuse) the job here")
    ap.add_argument("--before", default="0b59cae", help="the git revision `before` runs")
    a = ap.parse_args()
    base = a.keep or Path(tempfile.mkdtemp(prefix="bench-ranks-"))
    work = base / "job"  # the traces alone (outputs and the `before` tree beside it)
    work.mkdir(parents=True, exist_ok=True)
    paths = sorted(work.glob("rank-*.pt.trace.json"), key=lambda p: int(p.name.split("-")[1].split(".")[0]))
    if len(paths) != a.ranks:
        t = time.perf_counter()
        paths = make_job(work, a.ranks, a.mb, slow=a.ranks // 3)
        print(f"made {a.ranks} ranks in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    total = sum(p.stat().st_size for p in paths)
    print(f"job: {a.ranks} ranks, {total / 1e6:,.0f} MB ({total / len(paths) / 1e6:.1f} MB each), rank "
          f"{a.ranks // 3} slowed 1.5x; {len(os.sched_getaffinity(0))} cores")
    cpu_rate, wall_rate, summary_bytes = per_gb(paths)
    print(f"reduction: {cpu_rate:.1f} CPU s per GB ({wall_rate:.1f} s of wall time per GB on this machine as loaded); "
          f"a summary is {summary_bytes:,} bytes (msgpack)")
    for engine in filter(None, a.engines.split(",")):
        out = base / f"out-{engine}"
        if engine == "before":
            tree = base / f"before-{a.before}"
            if not tree.is_dir():
                tree.mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.before], check=True,
                                         capture_output=True).stdout
                subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
            opts = []
        else:
            opts = ["--workers", "1"] if engine == "serial" else ["--engine", engine]
        cmd = [sys.executable, "-m", "auditor", "analyze", str(work), *opts, "--quiet", "--out", str(out)]
        env = None
        if engine == "before":  # that tree's auditor, not the one installed (an editable install's finder wins
            # over PYTHONPATH: it is taken off the import system first), also in the processes it starts
            # (a pool's fork server and workers: a sitecustomize does it in every interpreter)
            cmd[1:3] = ["-c", OLD_TREE.format(tree=str(tree))]
            site = tree / "_site"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(OLD_SITE.format(tree=str(tree)))
            env = {"PYTHONPATH": str(site)}
        # (run outside the repository: a worker started there would import its auditor, not `before`'s)
        wall, peak, cpu, stdout, rc, child = run_measured(cmd, env, cwd=base)
        named = stdout.strip()
        if (out / "findings.json").is_file():
            doc = json.loads((out / "findings.json").read_text())
            named = [f["evidence"]["stragglers"] for f in doc["findings"] if f["rule"] == "rank-straggler"]
        print(f"{engine:7s} wall {wall:6.1f} s   driver: peak RSS {peak / 2**20:5.0f} MiB, CPU {cpu:5.1f} s   "
              f"largest process it started: {child / 2**20:5.0f} MiB   straggler {named}   "
              f"(load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
