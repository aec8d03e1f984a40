"""Benchmark the trace parser + trace rules on a large tiled trace, against a bare msgspec decode and
HolisticTraceAnalysis.

    python bench/bench_trace.py --mb 500            # writes bench/out/bench_trace.json

Each measurement runs in its own Python process, so its peak RSS (ru_maxrss) is its own:
  bare  - read the file and decode it with a typed msgspec Struct (args left raw): the floor any
          Python-side parser of this file pays;
  ours  - what `audit analyze FILE` does, end to end: auditor.evidence.load.load_paths, every rule
          (run_rules, each rule's time reported: per_rule_seconds, and over the load's time:
          per_rule_over_load, so a rule that reads the trace again shows) and every report
          (write_reports: findings.json, report.html, SARIF, patch);
          on a multi-core Linux machine the trace is decoded by worker processes (evidence/trace/parallel.py),
          whose largest peak RSS is reported too (children_peak_rss_mb);
  ours_1 - the same in one process, as on a single core or for a gzip trace;
  hta   - HolisticTraceAnalysis' TraceAnalysis(trace_dir=...) in its own venv (bench/out/hta-venv),
          when `pip install holistictraceanalysis` works here.
Times are wall seconds measured inside the child after its imports; RSS is the child's peak.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TILE = ROOT / "bench" / "tile_trace.py"
SOURCE = ROOT / "tests" / "fixtures" / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"

_PRELUDE = """
import json, resource, sys, time
def cpu():
    # user + system seconds of this process and its finished children (the trace's worker processes)
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
def report(**kw):
    kw["cpu_seconds"] = cpu() - CPU0
    kw["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # MB, like file_mb
    # the largest worker process, if it used any (auditor's trace_parallel)
    kw["children_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1e6
    print("RESULT " + json.dumps(kw))
"""

BARE = _PRELUDE + """
import msgspec
class Event(msgspec.Struct, gc=False):
    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: int | str = -1
    tid: int | str = -1
    ts: float = 0.0
    dur: float = 0.0
    id: int | str | None = None
    args: msgspec.Raw = msgspec.Raw(b"{}")
class TraceFile(msgspec.Struct):
    traceEvents: list[Event]
path = sys.argv[1]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
t, CPU0 = time.perf_counter(), cpu()
with open(path, "rb") as f:
    data = f.read()
doc = msgspec.json.decode(data, type=TraceFile)
report(seconds=time.perf_counter() - t, events=len(doc.traceEvents), base_rss_mb=base)
"""

OURS = _PRELUDE + """
import inspect, tempfile
from pathlib import Path
from auditor.evidence.load import load_paths
from auditor.reports import write_reports
from auditor.reports.html import prewarm
from auditor.rules.engine import run_rules
from auditor.rules.registry import all_rules
from auditor.evidence.trace import parallel as trace_parallel
if sys.argv[2] == "1":  # one process: what a 1-core machine (or a gzip trace) gets
    trace_parallel.worker_count = lambda path: 0
all_rules()
# what the rules import once they build an edit (libcst), and pandas (which the trace's frames are
# made with, imported by the auditor's own import before 94f6420): imports, not work on the trace
for name in ("auditor.cst_edits", "auditor.rules._support.sdpa_patch", "pandas"):
    try:
        __import__(name)
    except ImportError:  # (an older checkout without it)
        pass
prewarm()  # imports and the page template: what `audit` loads before it reads anything
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
t, CPU0 = time.perf_counter(), cpu()
ev = load_paths([Path(sys.argv[1])])
t_load = time.perf_counter() - t
load_cpu = cpu() - CPU0
timings = {}
if "timings" in inspect.signature(run_rules).parameters:
    results = run_rules(ev, timings=timings)
else:  # an older checkout (--tree): each rule's skip_reason and check timed from outside
    from auditor.rules import engine
    plain_skip = engine.skip_reason
    def add(rule_id, started):
        got = timings.setdefault(rule_id, {"seconds": 0.0, "cpu_seconds": 0.0})
        got["seconds"] += time.perf_counter() - started[0]
        got["cpu_seconds"] += time.process_time() - started[1]
    def timed_skip(rule, evidence):
        started = time.perf_counter(), time.process_time()
        try:
            return plain_skip(rule, evidence)
        finally:
            add(rule.id, started)
    def timed(check):
        def run(self, *a, **k):
            started = time.perf_counter(), time.process_time()
            try:
                return list(check(self, *a, **k))
            finally:
                add(self.id, started)
        return run
    engine.skip_reason = timed_skip
    for cls in all_rules().values():
        cls.check = timed(cls.check)
    results = run_rules(ev)
t_rules = time.perf_counter() - t - t_load
with tempfile.TemporaryDirectory() as out:
    write_reports(Path(out), ev, results)
    report_mb = (Path(out) / "report.html").stat().st_size / 1e6
t_report = time.perf_counter() - t - t_load - t_rules
found = {}
for f in results.findings:
    found[f.rule] = found.get(f.rule, 0) + 1
trace = ev.trace_data[0]
per_rule = {k: round(v["seconds"], 3) for k, v in sorted(timings.items(), key=lambda kv: -kv[1]["seconds"])}
per_rule_cpu = {k: round(v["cpu_seconds"], 3) for k, v in sorted(timings.items(), key=lambda kv: -kv[1]["cpu_seconds"])}
report(seconds=time.perf_counter() - t, load_seconds=t_load, rules_seconds=t_rules, report_seconds=t_report,
       per_rule_seconds=per_rule, per_rule_cpu_seconds=per_rule_cpu, load_cpu_seconds=load_cpu,
       per_rule_over_load={k: round(v / t_load, 3) for k, v in per_rule.items()},
       report_mb=round(report_mb, 2), events=int(len(trace.events) + len(trace.flows)), findings=found,
       base_rss_mb=base, workers=trace.workers)
"""

HTA = _PRELUDE + """
from hta.trace_analysis import TraceAnalysis
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6
t, CPU0 = time.perf_counter(), cpu()
analysis = TraceAnalysis(trace_dir=sys.argv[1])
trace = analysis.t.get_trace(next(iter(analysis.t.traces)))
report(seconds=time.perf_counter() - t, events=int(len(trace)), base_rss_mb=base)
"""


def run_child(python: str, code: str, arg: str, timeout: float, env: dict | None = None, *more: str) -> dict:
    """Run `code` in `python`; in the checkout env's PYTHONPATH names (`-c` puts the working directory first
    on sys.path)."""
    started = time.perf_counter()
    cwd = (env or {}).get("PYTHONPATH") or None
    proc = subprocess.run([python, "-c", textwrap.dedent(code), arg, *more], capture_output=True, text=True, check=False,
                          timeout=timeout, env=env, cwd=cwd)
    wall = time.perf_counter() - started
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[7:])
            out["process_seconds"] = wall
            return out
    raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def ensure_tiled(mb: float, source: Path) -> Path:
    path = OUT / f"tiled_{int(mb)}mb.pt.trace.json"
    if path.exists() and abs(path.stat().st_size / 1e6 - mb) < mb * 0.2:
        return path
    OUT.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(TILE), str(source), str(path), "--mb", str(mb)], check=True)
    return path


def ensure_hta() -> str | None:
    venv = OUT / "hta-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    check = subprocess.run([str(python), "-c", "import hta"], capture_output=True, check=False)
    if check.returncode != 0:
        got = subprocess.run([str(python), "-m", "pip", "install", "-q", "holistictraceanalysis"],
                             capture_output=True, text=True, check=False)
        if got.returncode != 0:
            print(f"HTA install failed: {got.stderr.strip()[-500:]}", file=sys.stderr)
            return None
    return str(python)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=500.0, help="size of the tiled trace in MB")
    ap.add_argument("--source", type=Path, default=SOURCE, help="recorded trace to tile")
    ap.add_argument("--trace", type=Path, help="an already tiled trace to read (default: tile one under bench/out)")
    ap.add_argument("--tree", type=Path,
                    help="another checkout of auditor (e.g. a `git worktree` of an older commit) measured the same "
                         "way in the same rounds: 'before' and 'before_1'")
    ap.add_argument("--no-hta", action="store_true", help="skip HolisticTraceAnalysis")
    ap.add_argument("--hta-python", help="a Python that imports hta (default: a venv made under bench/out)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per measurement")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of bare and ours (the fastest is kept: the machine may be shared)")
    a = ap.parse_args()
    path = a.trace.resolve() if a.trace else ensure_tiled(a.mb, a.source)
    size_mb = path.stat().st_size / 1e6
    results: dict = {"file": str(path), "file_mb": round(size_mb, 1), "source": a.source.name,
                     "cpu_count": os.cpu_count()}
    print(f"{path.name}: {size_mb:.0f} MB", flush=True)
    # bare and ours alternate, so both see the same background load; each round gives a paired ratio
    # ours: as `audit analyze` runs here (worker processes on a multi-core machine); ours_1: in one
    # process, as on a single core or for a gzip trace
    here = {**os.environ, "PYTHONPATH": str(ROOT)}
    kinds = [("bare", BARE, "bare msgspec decode", "-", here), ("ours", OURS, "auditor load + rules", "default", here),
             ("ours_1", OURS, "auditor load + rules, one process", "1", here)]
    if a.tree:
        there = {**os.environ, "PYTHONPATH": str(a.tree.resolve())}
        kinds += [("before", OURS, f"{a.tree} load + rules", "default", there),
                  ("before_1", OURS, f"{a.tree} load + rules, one process", "1", there)]
    runs: dict[str, list[dict]] = {k[0]: [] for k in kinds}
    for _ in range(max(1, a.repeat)):
        for key, code, label, mode, env in kinds:
            got = run_child(sys.executable, code, str(path), a.timeout, env, mode)
            got["load_average"] = round(os.getloadavg()[0], 2)
            runs[key].append(got)
            print(f"{label}:", got, flush=True)
    for key, measured in runs.items():
        results[key] = dict(min(measured, key=lambda r: r["seconds"]))
        results[key]["all_seconds"] = [round(r["seconds"], 2) for r in measured]
    paired = sorted(o["seconds"] / b["seconds"] for b, o in zip(runs["bare"], runs["ours"]))
    paired_1 = sorted(o["seconds"] / b["seconds"] for b, o in zip(runs["bare"], runs["ours_1"]))
    results["paired_ours_over_bare"] = [round(x, 2) for x in paired]
    results["paired_ours_1_over_bare"] = [round(x, 2) for x in paired_1]
    if not a.no_hta:
        python = a.hta_python or ensure_hta()
        if python:
            hta_dir = OUT / f"hta_{int(a.mb)}mb"
            hta_dir.mkdir(exist_ok=True)
            link = hta_dir / path.name
            if not link.exists():
                link.symlink_to(path)
            try:
                results["hta"] = run_child(python, HTA, str(hta_dir), a.timeout)
                results["hta"]["load_average"] = round(os.getloadavg()[0], 2)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                results["hta"] = {"error": str(e)[-500:]}
            print("HolisticTraceAnalysis:", results["hta"], flush=True)
    bare, ours = results["bare"], results["ours"]
    results["ratios"] = {
        "ours_over_bare_time": round(ours["seconds"] / bare["seconds"], 2),
        "ours_over_bare_paired_median": round(paired[len(paired) // 2], 2),
        "ours_peak_minus_file_mb": round(ours["peak_rss_mb"] - size_mb, 1),
        "ours_workers": ours.get("workers"),
        "ours_worker_peak_mb": round(ours["children_peak_rss_mb"], 1),
        "ours_1_over_bare_time": round(results["ours_1"]["seconds"] / bare["seconds"], 2),
        "ours_1_over_bare_paired_median": round(paired_1[len(paired_1) // 2], 2),
        "ours_1_peak_minus_file_mb": round(results["ours_1"]["peak_rss_mb"] - size_mb, 1),
        # CPU time (user + system, workers included) varies less than wall time on a shared machine
        "ours_over_bare_cpu": round(ours["cpu_seconds"] / bare["cpu_seconds"], 2),
        "ours_1_over_bare_cpu": round(results["ours_1"]["cpu_seconds"] / bare["cpu_seconds"], 2),
    }
    for key in ("before", "before_1"):
        if key in results:
            results["ratios"][f"{key}_over_bare_time"] = round(results[key]["seconds"] / bare["seconds"], 2)
            results["ratios"][f"{key}_over_bare_cpu"] = round(results[key]["cpu_seconds"] / bare["cpu_seconds"], 2)
    if "seconds" in results.get("hta", {}):
        results["ratios"]["hta_over_ours_time"] = round(results["hta"]["seconds"] / ours["seconds"], 1)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_trace.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["ratios"], indent=2))
    # per rule: CPU seconds in the one-process runs (the fastest), which a shared machine disturbs least
    one, old = results["ours_1"], results.get("before_1", {})
    print(f"{'':28s} {'cpu s':>8s} {'x load':>8s}" + (f" {'before':>8s}" if old else ""))
    rows = [("load (parse)", one["load_cpu_seconds"], old.get("load_cpu_seconds"))]
    rows += [(r, x, old.get("per_rule_cpu_seconds", {}).get(r)) for r, x in one["per_rule_cpu_seconds"].items()][:12]
    rows += [("end to end", one["cpu_seconds"], old.get("cpu_seconds"))]
    for label, x, was in rows:
        print(f"{label:28s} {x:8.3f} {x / one['load_cpu_seconds']:8.3f}" + (f" {was:8.3f}" if was is not None else ""))

if __name__ == "__main__":
    main()
