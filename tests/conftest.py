"""Shared helpers: run the real `audit` CLI (its entry point in the worker, the audited program a
process of its own) and read what it wrote."""
from __future__ import annotations

import compileall
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

# A suite started in the background by a script (`cmd &`) inherits SIGINT ignored, and so would
# every audit it runs: the Ctrl-C tests would then test nothing (and hang). Give it back its
# default, which children get too (a caught signal is reset to the default across exec).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The suite describes a machine without a GPU: CUDA programs are rehearsed on the CPU, step times
# are CPU times, a CPU tensor's `.item()` is the only sync there is. On a CUDA machine it hides the
# devices from itself and from every process it starts (they inherit the environment), so each
# runs there as it runs on a CPU machine. Set before anything asks torch for CUDA: the driver reads
# the variable once, when CUDA first starts in a process.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The suite runs as many workers as the machine has cores (`pytest -n 2` on two), and each starts
# programs: torch's intra-op threads in each would spin against the other worker's for the same
# cores (a plain and an audited run of a small program: 28 s of CPU in 14 s of wall time with
# torch's default threads), and step timings (so the timing rules) would swing with the load.
# Every process the suite starts runs torch on one thread unless its test asks for more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
# The test folders mirror the package (capture/, evidence/, rules/, reports/; the commands here).
# Test modules share helpers by module name (make_case, the session's rehearsed GPU audits), so
# every folder is importable from every other; module names are unique across them.
for _folder in ("capture", "evidence", "rules", "reports"):
    sys.path.insert(0, str(ROOT / "tests" / _folder))
EXAMPLES = ROOT / "examples"
FIXTURES = ROOT / "tests" / "fixtures"  # the recordings the suite reads (tests/fixtures/README.md)
MARKER = re.compile(r"#\s*expect:\s*([a-z0-9-]+)")


@dataclass
class Audit:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    @property
    def findings_doc(self) -> dict:
        return json.loads((self.out / "findings.json").read_text())

    @property
    def findings(self) -> list[dict]:
        return self.findings_doc["findings"]

    def rule(self, rule_id: str) -> list[dict]:
        return [f for f in self.findings if f["rule"] == rule_id]

    @property
    def evidence(self) -> dict:
        return json.loads((self.out / "evidence.json").read_text())


def audit(*args: str, out: Path, cwd: Path | None = None, env: dict | None = None, timeout: float = 240,
          process: bool = False) -> Audit:
    """`audit ARGS --out OUT` as a user would run it: the audited program in its own process, as
    `audit` starts it. `audit` itself runs in this worker (see `_audit_here`) unless `process` asks
    for `python -m auditor` as a process of its own (a test of the entry point, of signals sent to
    it, of what its own interpreter loads at start) or the environment sets AUDIT_TESTS_IN_PROCESSES=1
    (all of them)."""
    argv = list(args)
    if args and args[0] in ("run", "analyze") and "--out" not in args:
        at = argv.index("--") if "--" in argv else len(argv)  # (after "--": the script's own arguments)
        argv[at:at] = ["--out", str(out)]
    # (a command started from a thread of the test runs as a process: the worker has one working
    # directory, one set of file descriptors, and signal handlers only its main thread may set)
    here = threading.current_thread() is threading.main_thread()
    if here and not process and os.environ.get("AUDIT_TESTS_IN_PROCESSES") != "1":
        code, stdout, stderr = _audit_here(argv, cwd or ROOT, env or {}, timeout)
        return Audit(code, stdout, stderr, out)
    # (one intra-op thread per audited process, from the environment set above, unless `env` says)
    p = subprocess.run([sys.executable, "-m", "auditor", *argv], capture_output=True, text=True, cwd=cwd or ROOT,
                       timeout=timeout, env={**os.environ, **env} if env else None)
    return Audit(p.returncode, p.stdout, p.stderr, out)


def _audit_here(argv: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str, str]:
    """`audit ARGV` run by the CLI's own entry point (`auditor.cli.main`) in this worker, as its
    process would run it: in `cwd`, with `env` added to the environment, its standard output and
    error (file descriptors 1 and 2, which the audited program it starts inherits) captured, its
    exit status the one `python -m auditor` exits with. The suite starts the command a few hundred
    times, and a process of its own costs ~0.4 s of CPU each (its interpreter and the imports of the
    report's libraries): a minute or two of the suite on two cores. What one command leaves in the
    worker is set back before the next: the environment, the working directory, sys.path and
    sys.modules' user entries, the signal handlers, --out locks, the source lines and per-file
    parses read (a later test may rewrite a file at the same path), the source roots."""
    from auditor import app, cli

    _zygote()
    _forget_per_file_reads()
    saved_env, saved_cwd, saved_path = dict(os.environ), os.getcwd(), list(sys.path)
    saved_modules = set(sys.modules)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    saved_streams = sys.stdout, sys.stderr
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        code = 0
        try:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
            os.environ.update(env)
            os.chdir(cwd)

            def too_long(signum, frame):
                raise subprocess.TimeoutExpired(["audit", *argv], timeout)

            signal.signal(signal.SIGALRM, too_long)
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                cli.main(argv)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except SystemExit as x:  # (as the interpreter turns it into an exit status)
            if x.code is None or isinstance(x.code, int):
                code = x.code or 0
            else:
                print(x.code, file=sys.stderr)
                code = 1
        except subprocess.TimeoutExpired:
            raise
        except Exception:  # (what an uncaught exception does to a process: its traceback, status 1)
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            app._release_all()
            for s, handler in saved_signals.items():
                signal.signal(s, handler)
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            sys.path[:] = saved_path
            for name in set(sys.modules) - saved_modules:  # (a user's module a command imported)
                f = getattr(sys.modules[name], "__file__", None) or ""
                if f and not f.startswith((sys.prefix, sys.base_prefix, str(ROOT / "auditor"))):
                    del sys.modules[name]
            _forget_per_file_reads()
        o.seek(0)
        e.seek(0)
        return code, o.read().decode("utf-8", "replace"), e.read().decode("utf-8", "replace")


_ZYGOTE: list = []


def _zygote():
    """The worker's zygote (tests/zygote.py): the audited processes of the commands run in this
    worker are forked from a process that has imported what the child imports, with the
    environment run_child gives a child (the worker's as it is now, with the audit's own variables
    for torch's logging): each audit is then spared ~2 s of CPU of imports (over half of the
    suite's CPU time). The child runs the same code from the same state; a test that adds its own
    variables for one command, or AUDIT_TESTS_FRESH_CHILDREN=1, gets a fresh process as `audit`
    starts one. A variable a library sets in the worker for good as a test imports it (Lightning's
    PYTORCH_NVML_BASED_CUDA_CHECK, dask.distributed's thread limits) restarts the zygote."""
    from auditor.capture import runner

    env, _ = runner.child_environment(dict(os.environ), profile=True)
    if not _ZYGOTE:
        from zygote import Zygotes

        _ZYGOTE.append(Zygotes(env, enabled=os.environ.get("AUDIT_TESTS_FRESH_CHILDREN") != "1"))
        runner.start_child = _ZYGOTE[0].start_child
    _ZYGOTE[0].serve(env)
    return _ZYGOTE[0]


def pytest_unconfigure(config):
    for z in _ZYGOTE:
        z.stop()
        # (AUDIT_TESTS_ZYGOTE_STATS=DIR: each worker writes how many audits it forked, and why not)
        if os.environ.get("AUDIT_TESTS_ZYGOTE_STATS"):
            Path(os.environ["AUDIT_TESTS_ZYGOTE_STATS"], f"{os.getpid()}.json").write_text(json.dumps(z.stats()))


def _forget_per_file_reads() -> None:
    """Empty what the auditor's modules keep for the life of a process per file, directory or
    command (functools caches with arguments: parses, git roots, suppression spans; the output
    directories a command made; the allocator's replays per snapshot) and Python's cache of source
    lines. The process-wide ones (maxsize 1: the rule table, the report's templates) stay."""
    import functools
    import linecache

    linecache.clearcache()
    for name, module in list(sys.modules.items()):
        if name == "auditor" or name.startswith("auditor."):
            for value in list(vars(module).values()):
                if isinstance(value, functools._lru_cache_wrapper) and value.cache_parameters()["maxsize"] != 1:
                    value.cache_clear()
    if "auditor.app" in sys.modules:
        sys.modules["auditor.app"]._MADE.clear()
    if "auditor.evidence.allocator.analysis" in sys.modules:
        sys.modules["auditor.evidence.allocator.analysis"]._CACHE.clear()


@pytest.fixture(autouse=True)
def _source_roots_set_back():
    """The source roots a command run in this worker sets (source_access.allow) are set back after
    each test, as `audit`'s entry point does: a test that ran `analyze --source-root` in-process
    would otherwise restrict what every later test in the worker reads and edits."""
    from auditor.evidence import source_access

    with source_access.kept():
        yield


def patch_text(path: Path) -> str:
    """A patch file's text, '' where the audit wrote none (it writes one only when it holds a patch)."""
    return path.read_text() if path.exists() else ""


def printed_figures(pattern: str, message: str) -> list[float]:
    """The figures a message prints where `pattern`'s groups stand. A rule prints figures it took
    from unrounded timings, and the evidence holds each timing rounded, so a test compares a printed
    figure with its recomputation to within the last printed digit, not as a string."""
    m = re.search(pattern, message)
    assert m, message
    return [float(g) for g in m.groups()]


def expected_lines(path: Path, rule_id: str) -> list[int]:
    """Lines of an example marked `# expect: rule-id`."""
    return [i for i, line in enumerate(path.read_text().splitlines(), 1)
            if (m := MARKER.search(line)) and m.group(1) == rule_id]


def session_root(tmp_path_factory) -> Path:
    """The folder the test session's workers share (without workers, the session's own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared(tmp_path_factory, key: str, make: Callable[[Path], Audit]) -> Audit:
    """`make(FOLDER)` run once per test session under `key`, even across xdist workers: the first
    worker runs it under a file lock, the others read what it returned. FOLDER (the shared folder's
    `key`) is `make`'s to write; the Audit it returns says where its outputs are."""
    root = session_root(tmp_path_factory)
    done = root / f"{key}.json"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            a = make(root / key)
            done.write_text(json.dumps({**a.__dict__, "out": str(a.out)}))
    saved = json.loads(done.read_text())
    return Audit(**{**saved, "out": Path(saved["out"])})


def shared_audit(tmp_path_factory, key: str, *args: str, env: dict | None = None) -> Audit:
    """`audit ARGS` run once per test session under `key`, even across xdist workers (`shared`)."""
    return shared(tmp_path_factory, f"audit-{key}", lambda out: audit(*args, out=out, env=env))


@pytest.fixture(scope="session")
def example_audit(tmp_path_factory):
    """Audit each example once per test session (30 steps) and share the result."""
    def get(name: str, steps: int = 30) -> Audit:
        return shared_audit(tmp_path_factory, f"{name}-{steps}", "run", f"examples/{name}.py:step",
                            "--steps", str(steps), "--quiet")

    return get


ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Steps per numerics example: enough to pass the step where it goes wrong, few enough to stay fast.
NUMERICS_STEPS = {"numerics_nan_submodule": 18, "numerics_log_zero": 14, "numerics_lr_blowup": 22,
                  "numerics_amp_unscaled": 5, "numerics_lr_warmup": 24, "numerics_lr_resume": 5,
                  "numerics_clean": 6, "clean": 8, "numerics_zero_grad": 12}


@pytest.fixture(scope="session")
def numerics_audit(tmp_path_factory):
    """Audit each numerics example once per test session (NUMERICS_STEPS, unprofiled, one thread)."""
    def get(name: str) -> Audit:
        return shared_audit(tmp_path_factory, f"numerics-{name}", "run", f"examples/{name}.py:step",
                            "--steps", str(NUMERICS_STEPS[name]), "--no-profile", "--quiet", env=ONE_THREAD)

    return get


def assert_phases(a, file, forward: dict[str, int], optimizer: dict[str, int]) -> None:
    """Every step has one forward tally per outermost module call and one optimizer tally per
    optimizer step, at the user's lines, each timed within the step."""
    for s in a.evidence["steps"]:
        got = {(t["kind"], t["what"]): t for t in s["tallies"] if t["kind"] in ("forward", "optimizer")}
        want = {**{("forward", k): v for k, v in forward.items()}, **{("optimizer", k): v for k, v in optimizer.items()}}
        assert set(got) == set(want), (s["index"], sorted(got))
        for key, line in want.items():
            t = got[key]
            assert t["count"] == 1 and t["where"]["file"] == str(file) and t["where"]["line"] == line, t
            assert 0 < t["ms"] < s["ms"], t
        assert sum(t["ms"] for t in got.values()) < s["ms"]


def shared_run(tmp_path_factory, name: str, run: Callable[[Path], Audit]) -> tuple[Path, str]:
    """Run an audit (a 2-rank job, say) once per test session, even across xdist workers (each has
    its own module scope; `shared`), which must succeed: (its folder, its standard output)."""
    a = shared(tmp_path_factory, f"dist-{name}", run)
    assert a.returncode == 0, a.stderr[-4000:]
    return a.out, a.stdout


RECORDED_TRAINER = ROOT / "tests" / "data" / "recorded_trainer.py"


@dataclass(frozen=True)
class Recording:
    """What tests/data/recorded_trainer.py wrote, run as `python train.py` in `root`."""
    root: Path  # its working directory: train.py and every trace it wrote (listed in its docstring)
    source: Path  # root / "train.py", the copy that ran: the file the traces' Python frames name


@pytest.fixture(scope="session")
def recording(tmp_path_factory) -> Recording:
    """Record the CPU trainer's traces once per test session, even across xdist workers (`shared`)."""
    def record(root: Path) -> Audit:
        root.mkdir()
        (root / "train.py").write_text(RECORDED_TRAINER.read_text())
        p = subprocess.run([sys.executable, "train.py"], cwd=root, capture_output=True, text=True, timeout=240)
        return Audit(p.returncode, p.stdout, p.stderr, root)

    r = shared(tmp_path_factory, "recording", record)
    assert r.returncode == 0, r.stderr
    return Recording(r.out, r.out / "train.py")


def launch(example: str, out: Path, steps: int, *extra: str) -> Audit:
    """`audit run EXAMPLE --nproc-per-node 2`: the auditor starts torch.distributed.run itself."""
    return audit("run", f"examples/{example}.py:step", "--nproc-per-node", "2", "--steps", str(steps), "--quiet",
                 *extra, out=out, timeout=150)


def plain_run(tmp_path_factory, name: str) -> Audit:
    """examples/NAME.py as a plain 5-step run, unprofiled: one run serves every test file that asks
    (its folder is read, never written: a test that changes an audit's folder copies it first)."""
    return shared_audit(tmp_path_factory, f"plain-{name}-5", "run", f"examples/{name}.py:step", "--steps", "5",
                        "--no-profile", "--quiet")


def balanced_ddp_run(tmp_path_factory) -> Path:
    """examples/ddp_balanced.py as a 2-rank job of 10 steps, unprofiled: DIR/rank-0/, DIR/rank-1/ and
    the merged report in DIR/; one run serves every test file that asks."""
    return shared_run(tmp_path_factory, "balanced", lambda out: launch("ddp_balanced", out, 10, "--no-profile"))[0]


def straggler_ddp_run(tmp_path_factory) -> Path:
    """examples/ddp_straggler.py as a 2-rank job of 12 steps, profiled (its per-rank traces are
    analysed on their own too); one run serves every test file that asks."""
    return shared_run(tmp_path_factory, "straggler", lambda out: launch("ddp_straggler", out, 12))[0]


def user_torchrun(example: str, out: Path, steps: int) -> subprocess.CompletedProcess:
    """What a user types on one node: torchrun starts the auditor on every rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "auditor",
           "run", f"examples/{example}.py:step", "--steps", str(steps), "--no-profile", "--quiet", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=150)


def metric_ddp_run(tmp_path_factory) -> tuple[Path, str]:
    """examples/ddp_metric_allreduce.py under the user's own torchrun, 8 steps: (DIR, stdout)."""
    def run(out: Path) -> Audit:
        p = user_torchrun("ddp_metric_allreduce", out, 8)
        return Audit(p.returncode, p.stdout, p.stderr, out)
    return shared_run(tmp_path_factory, "metric", run)


# What torchrun sets per rank; the single-process DDP runs match it.
DDP_ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def find_unused_run(tmp_path_factory) -> Audit:
    """examples/ddp_find_unused.py, one process (its own one-process group), 6 steps unprofiled."""
    return shared_audit(tmp_path_factory, "ddp_find_unused", "run", "examples/ddp_find_unused.py:step",
                        "--steps", "6", "--no-profile", "--quiet", env=DDP_ONE_THREAD)


def data_parallel_run(tmp_path_factory) -> Audit:
    """examples/ddp_data_parallel.py, one process, 4 steps unprofiled."""
    return shared_audit(tmp_path_factory, "ddp_data_parallel", "run", "examples/ddp_data_parallel.py:step",
                        "--steps", "4", "--no-profile", "--quiet", env=DDP_ONE_THREAD)


# A trainer whose every step is slower than the last (step-slowdown's tests).
GROWING = """import torch

model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(8, 16), torch.randn(8, 1)
seen = []


def step(i):
    seen.append(i)
    total = 0
    for v in range(30000 * len(seen)):  # rescans everything seen so far: each step slower than the last
        total += v
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


# The modules whose tests take longest (real multi-process and rehearsed runs) are handed to the
# xdist workers first (`--dist loadscope` gives a module's tests to one worker, so its module-scoped
# runs are made once): a long module scheduled last would leave one worker running it alone.
LONGEST_FIRST = (
    "tests/test_distributed.py", "tests/capture/test_rehearsal.py", "tests/test_verify.py",
    "tests/capture/test_failures.py", "tests/capture/test_programs.py", "tests/rules/test_dataloader_kwargs.py",
    "tests/rules/test_rule_table.py", "tests/rules/test_examples.py", "tests/capture/test_module_holders.py",
    "tests/capture/test_numerics.py", "tests/evidence/test_rank_engines.py", "tests/reports/test_fixes_apply.py",
)


def pytest_configure(config):
    """The auditor's and the examples' modules compiled to bytecode once, before the workers start.

    Why: the suite starts ~600 audit processes, and each imports ~150 of the auditor's modules (and
    an example as a module). Where bytecode is not written as modules are imported
    (PYTHONDONTWRITEBYTECODE, as on this project's machines), every one of them compiled those from
    source again: ~0.16 s of CPU per audit's own process, ~0.05 s per audited one. Reading bytecode
    that exists is not switched off by that setting."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # (the controller, or a run without xdist)
        for folder in ("auditor", "examples"):
            compileall.compile_dir(ROOT / folder, quiet=1)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # (stable: the rest keep their order)


def growing_run(tmp_path_factory) -> Audit:
    """GROWING as a plain 18-step audit, unprofiled and without numerics checks: one run serves every
    test file that asks (step-slowdown's cost and confidence are read from the same run)."""
    def make(folder: Path) -> Audit:
        folder.mkdir()
        (folder / "growing.py").write_text(GROWING)
        return audit("run", f"{folder / 'growing.py'}:step", "--steps", "18", "--no-profile", "--no-numerics",
                     "--quiet", out=folder / "out")

    return shared(tmp_path_factory, "growing-18", make)


def graded_severity(f: dict, doc: dict) -> str:
    """A timed performance warning's severity as its cost sets it (auditor.rules.engine.graded):
    info where its fix saves under MIN_WARNING_SHARE of the run's time; an estimated cost of a CUDA
    rehearsal, of the step predicted on the GPU (findings.json `doc`'s steps.clock)."""
    from auditor.rules.engine import MIN_WARNING_SHARE

    cost = f.get("cost") or {}
    share = cost.get("share_of_step")
    clock = (doc.get("steps") or {}).get("clock") or {}
    if (doc["environment"].get("rehearsal") and clock.get("source") == "estimate" and clock.get("issue_floor_ms")
            and clock.get("device_ms") is not None and cost.get("ms_per_step") is not None and not cost.get("measured")):
        share = cost["ms_per_step"] / max(clock["issue_floor_ms"], clock["device_ms"])
    return "warning" if share is not None and share >= MIN_WARNING_SHARE else "info"
