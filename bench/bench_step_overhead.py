"""Steady-state per-step overhead of an audit, measured in one process so machine drift cancels.

Why in one process: this VM's speed drifts by 20-40% between identical runs minutes apart, far
more than the 10% this measures, so two separate runs (bench_overhead.py) cannot resolve it. Here
two copies of examples/clean.py (same seed: same weights, same batches) step in turns:

  * copy A is audited exactly as the child process does it outside the profiled window: probes
    and collectors (numerics) on, step_begin / step_end, the line sampler resumed for the step and
    paused after it, the step record with its tallies (the sampler's per-line times among them) and
    extras sent over a pipe to another process, which reads it as `audit` does;
  * copy B runs plain, with every probe wrapper, global module/optimizer hook and collector hook
    taken out for its step (they are put back for A's).

Each pair of steps is timed back to back; the overhead is the median over pairs of
(A's interval - B's step time) / B's step time. At the end both copies' weights must be equal:
the audit did not change what the training computed.

    python bench/bench_step_overhead.py [--steps 600] [--threads N] [--step-ms 10 | --batch B]

The step is examples/clean.py's. The overhead target is for a step of about 10 ms, and this
machine's speed drifts (the same batch of 384 rows can take 6.6 ms one hour and 9.9 ms another), so
by default the batch is chosen at the start to make the plain step take `--step-ms` (10) here and
now: plain steps are timed at 384 rows and the batch scaled to match (an MLP's step time is close
to linear in its batch). `--batch B` fixes the batch instead (256 is the example as it is).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


READER = """\
import os
from auditor.capture.stream import read_chunks

class Bench:  # read_chunks watches the writing process for its exit: the bench, our parent
    pid = os.getppid()

    def poll(self):
        return None

for _ in read_chunks(0, Bench()):
    pass
"""


def load_copy(name: str, trainer: Path = EXAMPLES / "clean.py"):
    spec = importlib.util.spec_from_file_location(name, trainer)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Swap:
    """Everything the audit installs, as (owner, attribute) -> (plain value, audited value), plus
    the global hook dicts: `plain()` takes it all out, `audited()` puts it back."""

    HOOK_DICTS = (("torch.nn.modules.module", ("_global_forward_pre_hooks", "_global_forward_hooks",
                                                "_global_forward_hooks_always_called", "_global_backward_hooks",
                                                "_global_backward_pre_hooks")),
                  ("torch.optim.optimizer", ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")))

    def __init__(self, install) -> None:
        before = self._attrs()
        install()
        after = self._attrs()
        self.attrs = {k: (before.get(k), v) for k, v in after.items() if before.get(k) is not v}
        self.hooks = []
        for mod, names in self.HOOK_DICTS:
            m = sys.modules[mod]
            for n in names:
                d = getattr(m, n, None)
                if d is not None:
                    self.hooks.append((d, dict(d)))

    @staticmethod
    def _attrs() -> dict:
        import gc
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated torch attributes

        out = {}
        owners = [gc]
        for name, mod in list(sys.modules.items()):
            if not (name == "torch" or name.startswith("torch.")) or mod is None:
                continue
            owners.append(mod)
            for v in list(vars(mod).values()):
                if isinstance(v, type) and v.__module__ == name:
                    owners.append(v)
        for o in owners:
            for k, v in list(vars(o).items()):
                out[(id(o), o, k)] = v
        return out

    def plain(self) -> None:
        for (_, owner, name), (orig, _) in self.attrs.items():
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        for d, _ in self.hooks:
            d.clear()

    def audited(self) -> None:
        for (_, owner, name), (_, new) in self.attrs.items():
            setattr(owner, name, new)
        for d, saved in self.hooks:
            d.update(saved)


def calibrated_batch(step_ms: float, probe_batch: int = 384) -> int:
    """The batch that makes examples/clean.py's plain step take about `step_ms` on this machine
    now: the median of 60 plain steps at `probe_batch` rows, scaled, then timed and scaled again
    at that batch until a round lands within 15% of the target (at most five rounds; before
    anything is installed)."""
    import _common

    make = _common.make
    batch = probe_batch
    # at least twice (the time per row shrinks a little as the batch grows), and again while a
    # round lands far from the target: a burst of load from another process during one round can
    # choose a batch whose plain step takes 1.1 ms
    for round_ in range(5):
        _common.make = functools.partial(make, batch=batch)
        try:
            probe = load_copy("clean_calibration")
        finally:
            _common.make = make
        times = []
        for i in range(80):
            t0 = time.perf_counter()
            probe.step(i)
            if i >= 20:
                times.append((time.perf_counter() - t0) * 1e3)
        took = statistics.median(times)
        batch = max(16, round(batch * step_ms / took))
        if round_ >= 1 and 0.85 < took / step_ms < 1.15:
            break
    return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-numerics", action="store_true", help="audit without the numerics checks (to split the cost)")
    ap.add_argument("--step-ms", type=float, default=10.0,
                    help="choose the batch so that the plain step takes about this long here (clean.py only)")
    ap.add_argument("--batch", type=int, default=None,
                    help="rows a batch instead of --step-ms (examples/clean.py uses 256)")
    ap.add_argument("--block", type=int, default=1,
                    help="steps each copy takes in turn (1: alternate every step; more: the later steps of "
                         "each block run with warm caches, as one model's loop does; the first is not counted)")
    ap.add_argument("--program", action="store_true",
                    help="audit copy A as `audit run script.py` does: its steps found by capture.steps.StepFinder "
                         "(at its DataLoader fetches and optimizer steps), not begun and ended around the call. "
                         "Use with --no-numerics: A's step stays open until its next fetch, so with the numerics "
                         "checks on, B's turn would run inside A's open step, under the checks' mode")
    ap.add_argument("--trainer", type=Path, default=EXAMPLES / "clean.py",
                    help="another trainer (a module with step(i) and a `model`), e.g. bench/many_calls.py")
    args = ap.parse_args()
    if args.program and not args.no_numerics:
        ap.error("--program measures with --no-numerics only (see its help)")
    sys.path.insert(0, str(EXAMPLES))
    import torch

    import _common

    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = args.trainer.resolve()
    calibrated = args.batch is None and trainer == (EXAMPLES / "clean.py").resolve()  # (see calibrated_batch)
    if calibrated:
        args.batch = calibrated_batch(args.step_ms)
    elif args.batch is None:  # (another trainer: _common.make is not what it calls)
        args.batch = 384
    _common.make = functools.partial(_common.make, batch=args.batch)  # (what clean.py imports)
    from auditor.capture import lines, probes, session, wire
    from auditor.capture.collectors import load_collectors
    from auditor.capture.stream import Writer, widen_pipe

    collectors = []
    finder = []

    def install():
        probes.install()
        # as the child does: --no-numerics loads no numerics collector (no hooks at all)
        collectors.extend(load_collectors(skip=("numerics",) if args.no_numerics else ()))
        for c in collectors:
            c.install()
        if args.program:  # (its wrappers and hooks are swapped out for the plain copy with the rest)
            import tempfile

            from auditor.capture.child import Profiler
            from auditor.capture.steps import StepFinder

            steps = session.StepSession(out, probes.REC, Profiler(tempfile.mkdtemp(), "bench", 1, False),
                                        collectors, set(), lambda: (None, None, None))
            finder.append(StepFinder(steps, probes.REC, out.send, 10 ** 9, 0, True, lambda: None))
            finder[0].install()

    # the records go to a process that reads them as `audit` does (auditor.capture.stream.read_chunks:
    # a read, then a pause, so that the writer seldom wakes it); a reader blocked in read() (`cat`)
    # would be woken by every record, on a core the step's second thread wants
    reader = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, cwd=ROOT)
    widen_pipe(reader.stdin.fileno())  # (as runner.run does)
    out = Writer(reader.stdin.fileno())
    # the copies are made with everything installed, as the child makes the user's objects
    swap = Swap(install)
    rec = probes.REC
    a, b = load_copy("clean_a", trainer), load_copy("clean_b", trainer)
    # the line sampler the child runs in each step (session.StepSession: resumed as the step begins,
    # paused as it ends, its per-line times sent with the tallies); AUDITOR_LINE_SAMPLING=0 turns it
    # off there and here alike
    sampler = lines.LineSampler() if lines.ENABLED else None
    looks = [0]  # the sampler's looks at the audited steps, all told

    def sampled() -> list:
        taken = sampler.take() if sampler is not None else []
        looks[0] += sum(t["count"] for t in taken)
        return taken
    ratios, a_ms, b_ms, parts = [], [], [], []
    warm = 20
    block = max(1, args.block)

    def program_step(i: int) -> tuple[float, tuple]:
        """Copy A's step as a program's: its boundary (the record) is crossed inside, at its fetch."""
        t0 = time.perf_counter()
        a.step(i)
        t1 = time.perf_counter()
        return (t1 - t0) * 1e3, (0.0, (t1 - t0) * 1e3, 0.0)

    def audited_step(i: int) -> tuple[float, tuple]:
        """The child's steady-state step (session.StepSession), up to the next step's start."""
        t0 = time.perf_counter()
        anomaly = torch.is_anomaly_enabled()
        for c in collectors:
            c.step_begin(i)
        c0, s0 = time.process_time(), time.perf_counter()
        if sampler is not None:
            sampler.resume()
        a.step(i)
        s1, c1 = time.perf_counter(), time.process_time()
        if sampler is not None:
            sampler.pause()
        allocated, reserved = session.device_memory()
        out.send(wire.Step(index=i, start_s=s0, ms=(s1 - s0) * 1e3, cpu_ms=(c1 - c0) * 1e3, profiled=False,
                           rss_bytes=session.rss_bytes(), device_allocated=allocated, device_reserved=reserved,
                           anomaly_enabled=anomaly,
                           tallies=rec.drain() + sampled(),
                           collected=session.collected(collectors, i),
                           dataloaders=session.new_loaders(rec)))
        t1 = time.perf_counter()
        return (t1 - t0) * 1e3, ((s0 - t0) * 1e3, (s1 - s0) * 1e3, (t1 - s1) * 1e3)

    def plain_step(i: int) -> float:
        t2 = time.perf_counter()
        b.step(i)
        return (time.perf_counter() - t2) * 1e3

    total = args.steps + warm
    for first in range(0, total, block):
        idx = range(first, min(first + block, total))
        # the audited copy takes `block` steps, then the plain one the same steps: with --block 1
        # each step finds the caches as the other copy left them, with more the later steps of a
        # block find them warm, as in a loop of one model
        got_a = [(program_step if args.program else audited_step)(i) for i in idx]
        swap.plain()
        got_b = [plain_step(i) for i in idx]
        swap.audited()
        for k, i in enumerate(idx):
            if i >= warm and (block == 1 or k > 0):
                a_ms.append(got_a[k][0])
                b_ms.append(got_b[k])
                ratios.append(got_a[k][0] / got_b[k] - 1)
                parts.append(got_a[k][1])
    if finder:
        print(f"program mode: {finder[0].recorded} steps recorded, found by {finder[0].found()[1]}")
    reader.stdin.close()
    reader.wait()
    same = all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    q = statistics.quantiles(ratios, n=4)
    on_clean = trainer == (EXAMPLES / "clean.py").resolve()
    print(f"threads {torch.get_num_threads()}, {len(ratios)} step pairs of {trainer.name}"
          + (f" (blocks of {block} steps each, the first of each block not counted)" if block > 1 else "")
          + (f", batch {args.batch}" if on_clean else "")
          + (f" (chosen for a {args.step_ms:g} ms plain step)" if calibrated else ""))
    print(f"plain step    median {statistics.median(b_ms):.2f} ms")
    print(f"audited step  median {statistics.median(a_ms):.2f} ms (interval between step starts)")
    print(f"overhead      median {100 * statistics.median(ratios):+.1f}% per step "
          f"(quartiles {100 * q[0]:+.1f}% .. {100 * q[2]:+.1f}%), "
          f"{statistics.median(x - y for x, y in zip(a_ms, b_ms)):+.2f} ms")
    print("audited step's parts, medians: before %.3f ms, step %.3f ms, record %.3f ms"
          % tuple(statistics.median(p[k] for p in parts) for k in range(3)))
    print(f"line sampler: {'on, %d looks at the audited steps' % looks[0] if sampler is not None else 'off'}")
    print(f"weights equal after {args.steps + warm} steps: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
