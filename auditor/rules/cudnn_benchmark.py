"""cudnn-benchmark: a fixed-shape convnet on the GPU with cuDNN's autotuner left off.

Two halves. The run half reads the profiler window of `audit run` on a CUDA machine: its trace's
cuDNN convolutions (`aten::cudnn_convolution`, recorded with their input shapes) beside the
`torch.backends.cudnn.benchmark` the run recorded (`environment.backend_flags`). The rehearsal half
judges a CUDA rehearsal on the CPU, which tallies every convolution of GPU tensors with its input
shape and the flag in force (`device-matmul`). A trace analysed on its own records no flag: the
rule is skipped there, and the skip says what the trace shows.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

from auditor.evidence import model as m
from auditor.evidence.trace.efficiency import kernel_ops, op_shapes
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.queries import frame_location_parts, sites
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules._support.places import by_place, locations, on_accelerator, steps_run
from auditor.rules._support.text import line_ref, per_step, sites_text
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed

# The share of cuDNN convolution kernel time the autotuner's choice commonly saves on repeated
# shapes (10-30% in PyTorch's and NVIDIA's guidance): the middle of that range
AUTOTUNE_SHARE = 0.2
COUNTED = "counted, not timed: rehearsed on the CPU, where cuDNN does not run"
# The forward convolutions cuDNN (MIOpen on ROCm) runs, whose algorithm the benchmark flag picks.
CUDNN_CONVS = ("aten::cudnn_convolution", "aten::miopen_convolution")
FLAG = "cudnn.benchmark"


def conv_shapes_by_step(ev: m.Evidence) -> dict[int, frozenset]:
    """{step: the (what, file, line, input shape) of every GPU convolution it ran}."""
    out: dict[int, set] = {}
    for step, t in ev.tallies(m.DEVICE_MATMUL):
        if t.data.get("conv"):
            out.setdefault(step, set()).add((t.what, t.where.file if t.where else None,
                                             t.where.line if t.where else None, tuple(t.data.get("shape") or ())))
    return {k: frozenset(v) for k, v in out.items()}


class CudnnBenchmark(Rule):
    """
    What it detects:
        A program that runs GPU convolutions of the same input shapes step after step with
        `torch.backends.cudnn.benchmark` off (its default). Seen in CUDA rehearsal: every
        `conv1d/2d/3d` and `conv_transpose1d/2d/3d` (a GAN's generator) of GPU tensors is counted
        at the user's line with its input shape and the flag in force when it ran.

        On a GPU, `audit run` reads the flag the program left (after its setup, and at its end)
        and the cuDNN convolutions of its profiler window (`aten::cudnn_convolution` with their
        input and weight shapes, per profiled step), with their kernel time; not when the program
        asked for reproducible results (`cudnn.deterministic`, `torch.use_deterministic_algorithms`),
        which keeps the flag off on purpose.

    Why it costs:
        With the flag off cuDNN picks a convolution algorithm by a heuristic; with it on, it times
        the candidates once per input shape and keeps the fastest. For a network whose shapes do
        not change (fixed image size, `drop_last=True`) that one search pays off on every later
        step, often by 10-30% of the convolution time. (With shapes that change every step, each new
        shape pays a search: leave it off there; this rule stays silent then.)

    Example:
        model = ResNet().cuda()                  # 224x224 images, batch 64, every step
        for x, y in loader: ...                  # cudnn.benchmark never set

    Fix:
        `torch.backends.cudnn.benchmark = True` once, before the training loop.

    Evidence needed:
        `audit run` on a CUDA machine (the run records the flag, its profiler window the
        convolutions and their shapes), or a CUDA rehearsal (`audit run` of CUDA code on a machine
        without a GPU, or `--rehearse`). A profiler trace analysed on its own (`audit analyze
        TRACE`) is not enough, and the rule is skipped there: no trace records the flag, and a
        program that set it looks the same in its steady steps (the search runs once per shape,
        before the profiled steps), so a finding there would accuse the programs that set it as
        often as those that did not. The skip reason says what the trace shows (how many cuDNN
        convolutions a step, with the same shapes in how many steps), for the reader to check
        the flag in the program.
    """

    id = "cudnn-benchmark"
    reads = frozenset({"record_shapes"})  # (the convolutions' input shapes)
    saves_on = "device"
    title = "cuDNN autotuner off for fixed-shape convolutions"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run", "trace"})
    needs_text = ("needs `audit run` on a GPU (the flag beside its profiler window's convolutions), or a CUDA "
                  "rehearsal (`audit run --rehearse`)")
    options = (
        Option("min-share-of-steps", 0.5, "Report when GPU convolutions run in at least this share of steps."),
        Option("min-fixed-share", 0.9,
               "... and at least this share of those steps runs exactly the convolution shapes of the most "
               "common step (a last, smaller batch of an epoch is allowed for)."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        """Judged in CUDA rehearsal, and on a run's own trace beside the flag it recorded. A trace
        on its own: skipped, saying what its convolutions show."""
        if ev.environment.rehearsal or (ev.source == "run" and ev.trace_data
                                        and isinstance(ev.environment.backend_flags.get(FLAG), bool)):
            return None
        if ev.source == "run" or not ev.trace_data:
            return self.needs_text
        seen = [s for s in (fixed_shapes(t) for t in ev.trace_data) if s is not None]
        shown = (f"; the trace shows {per_step(seen[0][0])} cuDNN convolutions per step, with the same "
                 f"{seen[0][1]} input shape(s) in {seen[0][2]} of {seen[0][3]} steps: if the program leaves the "
                 "flag off, setting it would let the autotuner pick their algorithms") if seen else \
            " (and shows no cuDNN convolutions of the same shapes over two steps or more)"
        return (f"a profiler trace does not record torch.backends.cudnn.benchmark; `audit run` of the program on "
                f"the GPU reads it{shown}")

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        flags = ev.environment.backend_flags
        # (a program that asked for reproducible results keeps the flag off on purpose: the autotuner's
        # choice may differ from run to run)
        if ev.source == "run" and flags.get(FLAG) is False and not (flags.get("cudnn.deterministic")
                                                                    or flags.get("deterministic_algorithms")):
            yield from self.trace_findings(ev, options)
        yield from self.rehearsal_findings(ev, options)

    def check_trace(self, trace: Trace, options: Options) -> Finding | None:
        """One finding when the trace's cuDNN convolutions keep the same shapes step after step (the
        caller has checked that the run recorded the flag off)."""
        rows = conv_rows(trace)
        if not len(rows):
            return None
        steps = trace.step_count()
        per = _signatures(trace, rows)
        # (one step shows no shape repeating: a window of 2 profiled steps at least)
        if len(per) < max(2, options.min_share_of_steps * steps):
            return None
        common, seen = Counter(per.values()).most_common(1)[0]
        if seen < options.min_fixed_share * len(per):
            return None
        charged = kernel_ops(trace)
        kernels = np.flatnonzero((trace.col("cat") == CAT["kernel"]) & np.isin(charged, rows))
        kernel_ms = float(trace.col("dur")[kernels].sum()) / 1000.0
        inputs = sorted({shape for (shape, _), _ in common})
        where = sites(trace, rows)
        at = sites_text(where, steps)
        return self.finding(
            "Fixed input shapes: set cudnn.benchmark = True. "
            f"The GPU ran {per_step(len(rows) / steps)} cuDNN convolutions per step in {trace.label} with "
            f"torch.backends.cudnn.benchmark off (as the run recorded it), with the same {len(inputs)} input "
            f"shape(s) in {seen} of {len(per)} profiled steps; their kernels took {kernel_ms / steps:.2f} ms per "
            f"step. The autotuner would time each shape's algorithms once and keep the fastest{at}. Its likely "
            f"saving: about {AUTOTUNE_SHARE * kernel_ms / steps:.2f} ms per step of device time (an estimate, "
            f"{AUTOTUNE_SHARE:.0%} of those kernels).",
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "convolutions_per_step": round(len(rows) / steps, 2), "steps": steps,
                      "steps_with_convs": len(per), "steps_with_common_shapes": seen,
                      "input_shapes": [list(s) for s in inputs], "kernel_ms_per_step": round(kernel_ms / steps, 3),
                      "benchmark": False,
                      "sites": [{"file": f.file, "line": f.line, "count": n} for f, n, _ in where]},
            cost=Cost(ms_per_step=round(AUTOTUNE_SHARE * kernel_ms / steps, 3), share_of_step=None, measured=False,
                      note=f"estimate: {AUTOTUNE_SHARE:.0%} of the convolutions' {kernel_ms / steps:.2f} ms/step of "
                           "kernels, device time (what the autotuner saves is known only once it has run: often "
                           "10-30%)"),
            fix=_FIX,
        )

    def rehearsal_findings(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        """One finding for a CUDA rehearsal whose GPU convolutions keep their shapes with the flag off."""
        if not ev.steps or not ev.environment.rehearsal or on_accelerator(ev):
            return
        n = steps_run(ev)
        places = [p for p in by_place([(s, t) for s, t in ev.tallies(m.DEVICE_MATMUL)
                                       if t.data.get("conv") and not t.data.get("benchmark")])]
        places = unsuppressed(self.id, places, lambda p: p.where)
        steps_with = set().union(*(p.steps for p in places)) if places else set()
        if not places or len(steps_with) < options.min_share_of_steps * n:
            return
        by_step = conv_shapes_by_step(ev)
        common, seen = Counter(by_step.values()).most_common(1)[0]
        if seen < options.min_fixed_share * len(by_step):
            return
        calls = sum(p.count for p in places)
        shapes = sorted({shape for *_, shape in common})
        first = places[0].where.file if places[0].where else None
        yield self.finding(
            "Fixed input shapes: set cudnn.benchmark = True. "
            f"On the GPU these convolutions run with torch.backends.cudnn.benchmark off: {per_step(calls / n)} "
            f"convolutions per step at {len(places)} place(s) ("
            + "; ".join(f"{p.what} x{per_step(p.count / n)}/step at "
                        f"{line_ref(p.where.file if p.where else None, p.where.line if p.where else None, first)}"
                        for p in places[:5])
            + f"), with the same {len(shapes)} input shape(s) in {seen} of {len(by_step)} steps: the autotuner "
              "would pick each convolution's fastest algorithm once and reuse it.",
            locations=locations(places),
            evidence={"convolutions_per_step": round(calls / n, 2), "steps": n, "steps_with_convs": len(steps_with),
                      "steps_with_common_shapes": seen, "input_shapes": [list(s) for s in shapes],
                      "sites": [{"what": p.what, "file": p.where.file if p.where else None,
                                 "line": p.where.line if p.where else None, "count": p.count} for p in places]},
            cost=Cost(ms_per_step=None, share_of_step=None, measured=False, note=COUNTED),
            fix=_FIX,
        )


_FIX = Fix(summary="Set torch.backends.cudnn.benchmark = True once before the training loop (the "
                   "input shapes do not change, so the algorithm search runs once per shape).",
           config={"torch.backends.cudnn.benchmark": True})


def conv_rows(trace: Trace) -> np.ndarray:
    """Rows of the trace's cuDNN forward convolutions recorded with shapes (not the auditor's)."""
    shapes = op_shapes(trace)
    codes = {trace.symbols.id(n) for n in CUDNN_CONVS} - {-1}
    if not codes or not shapes:
        return np.empty(0, dtype=np.int64)
    names = trace.col("name")
    rows = np.array(sorted(r for r in shapes if int(names[r]) in codes), dtype=np.int64)
    if len(rows) and len(trace.auditor_ranges()):
        rows = rows[~trace.auditor_rows()[rows]]
    return rows


def _signatures(trace: Trace, rows: np.ndarray) -> dict[int, frozenset]:
    """{step: the (input shape, weight shape) of its convolutions, with their counts}."""
    shapes = op_shapes(trace)
    step = trace.col("step")
    per: dict[int, Counter] = {}
    for r in rows.tolist():
        dims = shapes[r][0]
        key = tuple(tuple(d) if isinstance(d, list) else () for d in dims[:2])
        if len(key) == 2:
            per.setdefault(int(step[r]), Counter())[key] += 1
    return {s: frozenset(c.items()) for s, c in per.items()}


def fixed_shapes(trace: Trace) -> tuple[float, int, int, int] | None:
    """(cuDNN convolutions per step, input shapes, steps with the most common shapes, steps with
    convolutions) of a trace whose convolutions keep their shapes in most steps; None otherwise."""
    rows = conv_rows(trace)
    per = _signatures(trace, rows) if len(rows) else {}
    if len(per) < 2:
        return None
    common, seen = Counter(per.values()).most_common(1)[0]
    if seen < 0.9 * len(per):
        return None
    return len(rows) / trace.step_count(), len({shape for (shape, _), _ in common}), seen, len(per)
