"""cudnn-benchmark: a fixed-shape convnet on the GPU with cuDNN's autotuner left off."""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from auditor.evidence import model as m
from auditor.findings import Cost, Finding, Fix
from auditor.rules._support.places import by_place, locations, on_accelerator, steps_run
from auditor.rules._support.text import line_ref, per_step
from auditor.rules.base import Option, Options, Rule
from auditor.rules.suppression import unsuppressed

COUNTED = "counted, not timed: rehearsed on the CPU, where cuDNN does not run"


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
        `conv1d/2d/3d` of GPU tensors is counted at the user's line with its input shape and the
        flag in force when it ran.

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
        A CUDA rehearsal (`audit run` of CUDA code on a machine without a GPU, or `--rehearse`).
    """

    id = "cudnn-benchmark"
    title = "cuDNN autotuner off for fixed-shape convolutions"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run"})
    options = (
        Option("min-share-of-steps", 0.5, "Report when GPU convolutions run in at least this share of steps."),
        Option("min-fixed-share", 0.9,
               "... and at least this share of those steps runs exactly the convolution shapes of the most "
               "common step (a last, smaller batch of an epoch is allowed for)."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        return None if ev.environment.rehearsal else "needs a CUDA rehearsal (GPU convolutions are counted there)"

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        if not ev.steps or on_accelerator(ev):
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
            fix=Fix(summary="Set torch.backends.cudnn.benchmark = True once before the training loop (the "
                            "input shapes do not change, so the algorithm search runs once per shape).",
                    config={"torch.backends.cudnn.benchmark": True}),
        )
