"""unfused-attention: attention computed by hand (the scores' matmul, scale, mask, softmax, dropout,
casts, the values' matmul), which one fused F.scaled_dot_product_attention kernel would do without
writing the score matrix. The chains are found by auditor.evidence.trace.attention."""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from auditor.evidence.frame import Frame
from auditor.evidence.trace.attention import Chain, attention_chains
from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.efficiency import trace_device
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, sites
from auditor.findings import Cost, Finding, Fix, Location
from auditor.rules.base import Option, Options, TraceRule
from auditor.evidence import source_access

# What a fused attention kernel reaches, as a share of the device's peak for its dtype, for the
# estimate of the time SDPA would take: FlashAttention-2 reports 50-73% of A100 peak forward
# (Dao 2023, arXiv:2307.08691); half of the peak is taken, a conservative figure.
FUSED_PEAK_SHARE = 0.5
_DTYPES = {"c10::bfloat16": "bfloat16", "c10::half": "float16", "double": "float64"}
_SOFTMAX_CALL = re.compile(r"\bsoftmax\s*\(")


def _dtype(recorded: str) -> str:
    return _DTYPES.get(recorded.lower(), "float32")


_PARTS = ("scores matmul", "softmax", "values matmul", "scale, mask, dropout, casts")


def _parts(trace: Trace, chains: list[Chain]) -> list[dict[str, float]]:
    """Each chain's kernel time (us) by the operator that launched it: the scores' matmul, the
    softmax, the values' matmul, and everything between (scale, mask, dropout, casts). A kernel's
    operator is the chain's last one that started by the kernel's launch and had not ended by then
    (none: between); all chains at once."""
    out = [dict.fromkeys(_PARTS, 0.0) for _ in chains]
    ts, end, dur, link = trace.col("ts"), trace.col("end"), trace.col("dur"), trace.col("link")
    ops = np.asarray([o for c in chains for o in c.ops], dtype=np.int64)
    kernels = np.asarray([k for c in chains for k in c.kernels], dtype=np.int64)
    if not len(kernels):
        return out
    op_chain = np.repeat(np.arange(len(chains)), [len(c.ops) for c in chains])
    k_chain = np.repeat(np.arange(len(chains)), [len(c.kernels) for c in chains])
    launched = ts[link[kernels]]
    # ops and kernels in one order (chain, time, an op before a kernel launched at its start): a
    # kernel's candidate is the last op before it in that order, when that op is of its chain
    chain_of = np.r_[op_chain, k_chain]
    order = np.lexsort((np.r_[np.zeros(len(ops)), np.ones(len(kernels))], np.r_[ts[ops], launched], chain_of))
    last = np.maximum.accumulate(np.where(order < len(ops), order, -1))
    at_kernel = order >= len(ops)
    kernel_pos, cand = order[at_kernel] - len(ops), last[at_kernel]
    cand_of = np.full(len(kernels), -1, dtype=np.int64)
    cand_of[kernel_pos] = cand
    ok = (cand_of >= 0) & (chain_of[np.maximum(cand_of, 0)] == k_chain)
    op = np.where(ok, ops[np.maximum(cand_of, 0)], -1)
    op = np.where((op >= 0) & (launched <= end[np.maximum(op, 0)]), op, -1)
    roles = np.asarray([(c.scores, c.softmax, c.values) for c in chains], dtype=np.int64)[k_chain]
    part = np.where(op == roles[:, 0], 0, np.where(op == roles[:, 1], 1, np.where(op == roles[:, 2], 2, 3)))
    for c, k, d in zip(k_chain.tolist(), part.tolist(), dur[kernels].tolist()):  # (summed in each chain's order)
        out[c][_PARTS[k]] += d
    return out


def softmax_location(frame: Frame) -> Location:
    """Where the user wrote the chain: the line of the softmax call inside the function the trace
    names (found in its source, and named by the path it was read at: a trace names a module by
    its path under its sys.path entry, `mingpt/model.py` for a script in projects/adder/), else the
    place the trace records."""
    from auditor.rules._support.sdpa_patch import source_lines  # (libcst: imported when the rule fires)

    span = source_lines(frame)
    named = source_access.getline(frame.file, frame.line) if frame.file else ""
    file = (source_access.resolve(frame.file) or frame.file) if span is not None else frame.file
    if span is not None and span[0] != frame.line and _SOFTMAX_CALL.search(named):  # the probes name the call
        return Location(file=file, line=frame.line, code=named.strip(),
                        note=f"the softmax call in {frame.function}")
    if span is not None:
        for n in range(span[0] + 1, span[1] + 1):
            code = source_access.getline(frame.file, n)
            if _SOFTMAX_CALL.search(code):
                return Location(file=file, line=n, code=code.strip(),
                                note=f"the softmax call in {frame.function}, which the trace records")
    return Location(*frame_location_parts(frame))


def _chain_times(trace: Trace, chains: list[Chain], on_gpu: bool) -> tuple[dict[str, float], list[float]]:
    """Each chain's time (its kernels' on a GPU trace, its operators' span on a CPU one) and, on a GPU,
    the kernels' time by part of the chain, in us."""
    parts = dict.fromkeys(_PARTS, 0.0)
    chain_us = []
    by_chain = _parts(trace, chains) if on_gpu else []
    for n, c in enumerate(chains):
        if on_gpu:
            got = by_chain[n]
            for k, x in got.items():
                parts[k] += x
            chain_us.append(sum(got.values()))
        else:  # a CPU trace: the operators run on the host, their span is their time
            chain_us.append(c.end - c.start)
    return parts, chain_us


def _shape_counts(chains: list[Chain]) -> dict[str, int]:
    """How many chains ran each shape, as the evidence names it."""
    shape_counts: dict[str, int] = {}
    for c in chains:
        key = (f"{c.heads}x{c.queries}x{c.qk_dim} @ {c.heads}x{c.qk_dim}x{c.keys} -> softmax "
               f"{c.heads}x{c.queries}x{c.keys} @ {c.heads}x{c.keys}x{c.v_dim}")
        shape_counts[key] = shape_counts.get(key, 0) + 1
    return shape_counts


class UnfusedAttention(TraceRule):
    """
    What it detects:
        Attention computed by hand in a profiler trace recorded with shapes: a matmul that makes
        the scores ([.., L, E] x [.., E, S]), a softmax over them and a matmul with the values
        ([.., L, S] x [.., S, E]), with whatever the program runs between them (the scale, a
        causal mask's `masked_fill`, dropout, autocast's dtype casts): the chain of a GPT tutorial's
        `att = (q @ k.transpose(-2, -1)) * scale; att.masked_fill(mask == 0, float("-inf"));
        softmax; dropout; att @ v`. It reports the share of GPU kernel time the chains' kernels
        take (matched to their operators by correlation), split into the matmuls, the softmax and
        what lies between, their shapes, the line of the softmax in the user's code, and what one
        fused kernel would take for the same shapes on the trace's GPU (device model). On a CPU
        trace the chains' operator time is reported, without an estimate. Forward chains only.

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
        dropout_p=p, scale=scale) (`is_causal=True` for a causal mask; a patch when the chain is
        written as the consecutive statements above with a `torch.tril` mask); a Hugging Face model: `from_pretrained(..., attn_implementation="sdpa")`
        (or "flash_attention_2"). The result is the same attention, up to floating-point rounding.

    Evidence needed:
        A profiler trace recorded with `record_shapes=True` (stacks with `with_stack=True` for the
        line).
    """

    id = "unfused-attention"
    reads = frozenset({"record_shapes", "with_stack"})  # (the chain's shapes and its softmax's line)
    saves_on = "device"
    title = "attention not fused (matmul, mask, softmax, matmul)"
    severity = "warning"
    category = "performance"
    judged_on_device = True
    options = (
        Option("min-share", 0.1, "Report when the chains take at least this share of GPU kernel time (of the "
               "steps' time on a CPU trace)."),
        Option("min-ms-per-step", 0.5, "... and at least this many ms per step (of kernel time; on a CPU trace, of "
               "the operators' time)."),
    )

    def check_trace(self, trace: Trace, options: Options, chosen: str = "") -> Finding | None:
        chains = attention_chains(trace)
        if not chains:
            return None
        cat, dur = trace.col("cat"), trace.col("dur")
        kernels = np.flatnonzero(cat == CAT["kernel"])
        on_gpu = bool(len(kernels))
        steps = trace.step_count()
        parts, chain_us = _chain_times(trace, chains, on_gpu)
        attention_us = sum(chain_us)
        lo, hi = trace.window()
        # the share of what the device did: kernel time on a GPU, the steps' span on a CPU
        total_us = float(dur[kernels].sum()) if on_gpu else (hi - lo)
        share = attention_us / total_us if total_us else 0.0
        if share < options.min_share or attention_us / 1e3 / steps < options.min_ms_per_step:
            return None
        flops = sum(c.flops() for c in chains)
        dtype = _dtype(chains[0].dtype)
        shape_counts = _shape_counts(chains)
        between = sorted({n for c in chains for n in c.op_names[1:-1] if n not in ("aten::softmax", "aten::_softmax")})
        achieved = flops / (attention_us / 1e6) / 1e12 if attention_us else 0.0
        where = sites(trace, [c.softmax for c in chains], weights=chain_us)
        # (the figure the evidence records, to the microsecond; the texts print this same figure)
        ms = round(attention_us / 1e3 / steps, 3)
        device = trace_device(trace, chosen) if on_gpu else None
        evidence: dict[str, Any] = {
            "trace": str(trace.path), "chains": len(chains), "steps": steps, "timed_on": "gpu" if on_gpu else "cpu",
            "attention_ms_per_step": ms, "kernel_share" if on_gpu else "step_share": round(share, 4),
            "between": between, "shapes": dict(sorted(shape_counts.items(), key=lambda kv: -kv[1])[:5]),
            "dtype": dtype, "flops_per_step": round(flops / steps), "achieved_tflops": round(achieved, 4),
            "device": device.key if device else None,
        }
        if on_gpu:
            evidence["parts_ms_per_step"] = {k: round(v / 1e3 / steps, 3) for k, v in parts.items()}
            evidence["parts_share"] = {k: round(v / total_us, 4) for k, v in parts.items()} if total_us else {}
        top = next(iter(evidence["shapes"]))
        if on_gpu and device is not None:
            fused_ms = flops / (FUSED_PEAK_SHARE * device.peak_tflops(dtype) * 1e12) * 1e3 / steps
            evidence["fused_estimate_ms_per_step"] = round(fused_ms, 3)
            cost = Cost(ms_per_step=round(max(ms - fused_ms, 0.0), 3), share_of_step=None, measured=False,
                        note=f"estimate: the chains' {ms:.1f} ms/step of kernels less their "
                             f"{flops / steps / 1e12:.2f} TFLOP at {FUSED_PEAK_SHARE:.0%} of the {device.name}'s "
                             f"{dtype} peak ({device.peak_tflops(dtype):g} TFLOP/s), what a fused kernel reaches")
        elif on_gpu:
            cost = Cost(ms_per_step=None, share_of_step=None, measured=False,
                        note="no device known to estimate a fused kernel's time (choose one with --device)")
        else:
            cost = Cost(ms_per_step=None, share_of_step=None, measured=False,
                        note=f"the chains' operators took {ms:.2f} ms per step on the CPU ({share:.0%} of the "
                             "steps' time); what a fused kernel saves is known on a GPU trace of the program")
        split = (f" (softmax {parts['softmax'] / total_us:.0%}, matmuls "
                 f"{(parts['scores matmul'] + parts['values matmul']) / total_us:.0%}, scale/mask/dropout/casts "
                 f"{parts['scale, mask, dropout, casts'] / total_us:.0%})") if on_gpu and total_us else ""
        timed = "of GPU kernel time" if on_gpu else "of the steps' time on the CPU"
        rate = f" at {achieved:.2f} TFLOP/s" if on_gpu else ""  # (a CPU's rate says nothing of a GPU's)
        with_ops = f" with {', '.join(b.removeprefix('aten::') for b in between)} between" if between else ""
        message = ("Attention runs unfused: call scaled_dot_product_attention. "
                   f"{len(chains)} attention computations in {trace.label} run unfused (matmul, softmax, matmul"
                   f"{with_ops}): {ms:.2f} ms per step, {share:.0%} {timed}{split}{rate}; "
                   f"shapes {top}. One fused scaled_dot_product_attention kernel never writes the score matrix.")
        locations = [softmax_location(f) for f, _, _ in where]
        from auditor.rules._support.sdpa_patch import sdpa_edit

        edits = [e for f, _, _ in where[:1] if (e := sdpa_edit(f)) is not None]
        return self.finding(
            message, locations=locations, evidence=evidence, cost=cost,
            fix=Fix(summary="Compute attention with torch.nn.functional.scaled_dot_product_attention(q, k, v, "
                            "attn_mask=..., dropout_p=..., scale=...) (is_causal=True for a causal mask); for a "
                            "Hugging Face model load it with attn_implementation=\"sdpa\" (or \"flash_attention_2\").",
                    config={"attn_implementation": "sdpa"}, edits=edits, changes_numerics=bool(edits)),
        )
