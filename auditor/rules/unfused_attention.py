"""unfused-attention: attention computed as batched matmul -> softmax -> batched matmul, which one
fused F.scaled_dot_product_attention kernel would do without writing the score matrix."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.efficiency import efficiency, kernel_ops, op_shapes
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, sites
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules.base import Option, Options, TraceRule

_MATMULS = ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::matmul")
_SOFTMAX = ("aten::_softmax", "aten::softmax")
# Between the scores' matmul and the softmax, and the softmax and the values' matmul, a chain may
# hold a few elementwise ops on the scores (scale, mask, dropout): looked for this many modelled
# operators either side of the softmax on its thread.
_WINDOW = 6
# What a fused attention kernel reaches, as a share of the device's peak for its dtype, for the
# estimate of the time SDPA would take: FlashAttention-2 reports 50-73% of A100 peak forward
# (Dao 2023, arXiv:2307.08691); half of the peak is taken, a conservative figure.
FUSED_PEAK_SHARE = 0.5


def _bmn(dims: Any) -> tuple[int, int, int] | None:
    """(batch elements, rows, columns) of a >= 2-d shape."""
    if not isinstance(dims, list) or len(dims) < 2 or not all(isinstance(d, int) for d in dims):
        return None
    return (math.prod(dims[:-2]) if len(dims) > 2 else 1, dims[-2], dims[-1])


def attention_chains(trace: Trace) -> list[tuple[int, int, int]]:
    """(scores matmul row, softmax row, values matmul row) of each unfused attention in the trace:
    a softmax over a [.., L, S] tensor (L, S > 1) whose input a preceding batched matmul on the same
    thread produced ([.., L, E] x [.., E, S]) and that a following one consumes ([.., L, S] x
    [.., S, E']), within a few operators of it. Needs recorded shapes."""
    shapes = op_shapes(trace)
    if not shapes:
        return []
    names, pid, tid, ts = trace.col("name"), trace.col("pid"), trace.col("tid"), trace.col("ts")
    rows = sorted(shapes, key=lambda r: (int(pid[r]), int(tid[r]), float(ts[r])))
    name_of = {r: trace.symbols[int(names[r])] for r in rows}
    # the innermost softmax only (aten::softmax calls aten::_softmax: one chain, not two)
    has_inner = {int(trace.col("parent")[r]) for r in rows if name_of[r] == "aten::_softmax"}
    out = []
    for i, r in enumerate(rows):
        if name_of[r] not in _SOFTMAX or r in has_inner:
            continue
        s = _bmn(shapes[r][0][0] if shapes[r][0] else None)
        if s is None or s[1] <= 1 or s[2] <= 1:
            continue
        thread = (pid[r], tid[r])
        before = [q for q in rows[max(0, i - _WINDOW):i] if (pid[q], tid[q]) == thread and name_of[q] in _MATMULS]
        after = [q for q in rows[i + 1:i + 1 + _WINDOW] if (pid[q], tid[q]) == thread and name_of[q] in _MATMULS]
        scores = next((q for q in reversed(before) if _produces(shapes[q][0], s)), None)
        values = next((q for q in after if _consumes(shapes[q][0], s)), None)
        if scores is not None and values is not None:
            out.append((scores, r, values))
    return out


def _mats(dims: list) -> list[tuple[int, int, int]]:
    return [m for d in dims if (m := _bmn(d)) is not None]


def _produces(dims: list, s: tuple[int, int, int]) -> bool:
    mats = _mats(dims)[-2:]
    return len(mats) == 2 and mats[0][0] * mats[0][1] * mats[1][2] == s[0] * s[1] * s[2] \
        and mats[0][1] == s[1] and mats[1][2] == s[2] and mats[0][2] == mats[1][1]


def _consumes(dims: list, s: tuple[int, int, int]) -> bool:
    mats = _mats(dims)[:2]
    return len(mats) == 2 and mats[0] == s and mats[1][1] == s[2]


class UnfusedAttention(TraceRule):
    """
    What it detects:
        Attention computed by hand in a profiler trace recorded with shapes: a batched matmul that
        makes the scores ([.., L, E] x [.., E, S]), a softmax over them, and a batched matmul with
        the values ([.., L, S] x [.., S, E]). It reports the share of GPU kernel time these chains
        take, their shapes, the line of the attention code (where the trace has stacks), and what
        one fused kernel would take on the trace's GPU (device model).

    Why it costs:
        The chain writes and reads the whole [L, S] score matrix per head in GPU memory, three
        times: for long sequences the softmax and both matmuls are memory-bound and run at a small
        share of the GPU's peak. scaled_dot_product_attention (FlashAttention, memory-efficient
        attention, cuDNN) keeps the scores on chip and runs the whole chain as one kernel.

    Example:
        scores = torch.bmm(q, k.transpose(1, 2)) * scale   # [16, 5185, 5185]
        out = torch.bmm(scores.softmax(-1), v)

    Fix:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
        dropout_p=p, scale=scale); a Hugging Face model: `from_pretrained(..., attn_implementation="sdpa")`
        (or "flash_attention_2"). The result is the same attention, up to floating-point rounding.

    Evidence needed:
        A profiler trace recorded with `record_shapes=True` (stacks with `with_stack=True` for the
        line).
    """

    id = "unfused-attention"
    title = "attention not fused (bmm + softmax + bmm)"
    severity = "warning"
    category = "performance"
    judged_on_device = True
    options = (
        Option("min-share", 0.1, "Report when the chains take at least this share of GPU kernel time."),
        Option("min-ms-per-step", 1.0, "... and at least this many ms of kernel time per step."),
    )

    def check_trace(self, trace: Trace, options: Options, chosen: str = "") -> Finding | None:
        chains = attention_chains(trace)
        if not chains:
            return None
        cat, dur = trace.col("cat"), trace.col("dur")
        kernels = np.flatnonzero(cat == CAT["kernel"])
        total_us = float(dur[kernels].sum())
        charged = kernel_ops(trace)
        per_op = np.bincount(np.maximum(charged[kernels], 0), weights=dur[kernels] * (charged[kernels] >= 0),
                             minlength=len(cat))
        parts = {"scores matmul": 0.0, "softmax": 0.0, "values matmul": 0.0}
        chain_us = []
        for q, s, v in chains:
            t = (float(per_op[q]), float(per_op[s]), float(per_op[v]))
            for k, x in zip(parts, t):
                parts[k] += x
            chain_us.append(sum(t))
        attention_us = sum(chain_us)
        steps = trace.step_count()
        share = attention_us / total_us if total_us else 0.0
        if share < options.min_share or attention_us / 1e3 / steps < options.min_ms_per_step:
            return None
        shapes = op_shapes(trace)
        eff = efficiency(trace, chosen)
        device = eff.device
        flops = 0.0
        dtype = "float32"
        shape_counts: dict[str, int] = {}
        for q, s, v in chains:
            sb, l_len, s_len = _bmn(shapes[s][0][0])
            e_qk = _mats(shapes[q][0])[-2][2]
            e_v = _mats(shapes[v][0])[1][2]
            flops += 2.0 * sb * l_len * s_len * (e_qk + e_v)
            dtype = _dtype(shapes[s][1])
            key = f"{'x'.join(map(str, shapes[q][0][-2]))} @ {'x'.join(map(str, shapes[q][0][-1]))} -> softmax " \
                  f"{'x'.join(map(str, shapes[s][0][0]))} @ {'x'.join(map(str, shapes[v][0][-1]))}"
            shape_counts[key] = shape_counts.get(key, 0) + 1
        achieved = flops / (attention_us / 1e6) / 1e12 if attention_us else 0.0
        where = sites(trace, [s for _, s, _ in chains], weights=chain_us)
        ms = attention_us / 1e3 / steps
        evidence: dict[str, Any] = {
            "trace": str(trace.path), "chains": len(chains), "steps": steps,
            "attention_ms_per_step": round(ms, 3), "kernel_share": round(share, 4),
            "parts_ms_per_step": {k: round(v / 1e3 / steps, 3) for k, v in parts.items()},
            "parts_share": {k: round(v / total_us, 4) for k, v in parts.items()} if total_us else {},
            "shapes": dict(sorted(shape_counts.items(), key=lambda kv: -kv[1])[:5]), "dtype": dtype,
            "flops_per_step": round(flops / steps), "achieved_tflops": round(achieved, 2),
            "device": device.key if device else None,
        }
        cost = Cost(ms_per_step=None, share_of_step=None, measured=False,
                    note="no device known to estimate a fused kernel's time (choose one with --device)")
        if device is not None:
            fused_ms = flops / (FUSED_PEAK_SHARE * device.peak_tflops(dtype) * 1e12) * 1e3 / steps
            evidence["fused_estimate_ms_per_step"] = round(fused_ms, 3)
            cost = Cost(ms_per_step=round(max(ms - fused_ms, 0.0), 3), share_of_step=None, measured=False,
                        note=f"estimate: the chains' {ms:.1f} ms/step of kernels less their "
                             f"{flops / steps / 1e12:.2f} TFLOP at {FUSED_PEAK_SHARE:.0%} of the {device.name}'s "
                             f"{dtype} peak ({device.peak_tflops(dtype):g} TFLOP/s), what a fused kernel reaches")
        top = next(iter(evidence["shapes"]))
        message = (f"{len(chains)} attention computations in {trace.label} run unfused (batched matmul, softmax, "
                   f"batched matmul): {ms:.1f} ms per step, {share:.0%} of GPU kernel time (softmax "
                   f"{parts['softmax'] / total_us:.0%}, matmuls "
                   f"{(parts['scores matmul'] + parts['values matmul']) / total_us:.0%}) at {achieved:.1f} TFLOP/s; "
                   f"shapes {top}. One fused scaled_dot_product_attention kernel never writes the score matrix.")
        return self.finding(
            message,
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence=evidence, cost=cost,
            fix=Fix(summary="Compute attention with torch.nn.functional.scaled_dot_product_attention(q, k, v, "
                            "attn_mask=..., dropout_p=..., scale=...); for a Hugging Face model load it with "
                            "attn_implementation=\"sdpa\" (or \"flash_attention_2\").",
                    config={"attn_implementation": "sdpa"}),
        )


def _dtype(types: list) -> str:
    t = str(types[0]).lower() if types else ""
    return {"c10::bfloat16": "bfloat16", "c10::half": "float16", "double": "float64"}.get(t, "float32")
