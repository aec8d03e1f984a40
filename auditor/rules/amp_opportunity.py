"""amp-opportunity: fp32 matmul/convolution kernels on a GPU with tensor cores."""
from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

import numpy as np

from auditor.evidence.devices import DeviceSpec, device_for
from auditor.evidence.step_clock import step_clock
from auditor.evidence.trace.decode import CAT
from auditor.evidence.trace.efficiency import kernel_ops, op_shapes, op_work
from auditor.evidence.trace.model import Trace
from auditor.evidence.trace.queries import frame_location_parts, issuing_op, sites
from auditor.evidence import model as m
from auditor.rules._support.cli_flags import OwnFlag, own_flag
from auditor.rules._support.frameworks import Trains, mixed_precision, trains_with
from auditor.rules._support.places import by_place, locations, on_accelerator, typical_pairs
from auditor.rules._support.text import line_ref, per_step
from auditor.rules.base import Option, Options, TraceRule
from auditor.rules.suppression import unsuppressed
from auditor.findings import Cost, Finding, Fix, Location

# Kernels that do matrix multiplies or convolutions (where tensor cores pay off); cuDNN's persistent
# RNN kernels (RNN_blockPersist_fp_LSTM<float, ...>, ..._HMMA<__half, ...>) run a layer's recurrent
# matmuls in one launch.
MATMUL_CONV = re.compile(r"gemm|gemv|matmul|conv|RNN_blockPersist|scudnn|hcudnn|dgrad|wgrad|fprop|cutlass.*tensorop|xmma|"
                         r"implicit_gemm|implicitgemm|winograd|fft2d|_nn_v1|_nt_v1|_tn_v1", re.IGNORECASE)
# Signs of reduced precision or tensor cores: mma shapes, half/bfloat16/tf32/int8/fp8 names.
REDUCED = re.compile(r"884|1688|16816|161616|hmma|wmma|imma|bf16|bfloat16|f16|fp16|half|__half|tf32|"
                     r"h\d{3,4}gemm|_h\d*gemm|hcudnn|_hgemm|int8|i8i8|e4m3|e5m2|fp8|tensorop", re.IGNORECASE)
# Signs of plain fp32 arithmetic on CUDA cores.
FP32 = re.compile(r"sgemm|scudnn|sgemv|<float|\bfloat\b|f32f32|_s\d*gemm|convolve_sgemm|fp32", re.IGNORECASE)
NOT_MATMUL = re.compile(r"bn_fw|bn_bw|batch_norm|nchwToNhwc|nhwcToNchw|elementwise|reduce_kernel|softmax",
                        re.IGNORECASE)


def kernel_precision(name: str) -> str | None:
    """"fp32" for an fp32 matmul/conv kernel, "reduced" for a tensor-core one, None otherwise."""
    if not MATMUL_CONV.search(name) or NOT_MATMUL.search(name):
        return None
    if REDUCED.search(name):
        return "reduced"
    if FP32.search(name):
        return "fp32"
    return None


class AmpOpportunity(TraceRule):
    """
    What it detects:
        Kernel time spent in fp32 GEMM and convolution kernels (`sgemm`, `scudnn`, `<float>` cuDNN
        engines) in a profiler trace recorded on a GPU of compute capability 7.0 or newer, when no
        reduced-precision tensor-core kernel (`*884*`, `*1688*`, `*16816*`, `bf16`, `f16`, `tf32`) did
        that work. It reports the share of GPU kernel time that mixed precision could speed up.

    Why it costs:
        Tensor cores multiply fp16/bf16 (and tf32) matrices several times faster than fp32 CUDA cores,
        and halve the memory traffic of activations. Running fp32 leaves most of the GPU's arithmetic
        throughput unused.

    Example:
        loss = loss_fn(model(x), y)       # fp32 convolutions: volta_scudnn_128x64_relu_...
        loss.backward()

    Fix:
        Run forward and loss under `torch.autocast("cuda", dtype=torch.bfloat16)` (fp16 with a
        `torch.amp.GradScaler` on GPUs without bf16, compute capability < 8); on Ampere or newer, at
        least allow TF32 (`torch.backends.cuda.matmul.allow_tf32 = True`). This changes numerics.
        A program that trains with Lightning is told its framework's switch: `Fabric(precision=
        "bf16-mixed")`, `Trainer(precision="bf16-mixed")`, a LightningCLI's `--trainer.precision
        bf16-mixed`; a script with a dtype option of its own that names bfloat16 (llm.c's `--dtype
        float32|float16|bfloat16`) is told to run with it.

        In CUDA rehearsal (no GPU, no kernels) the program's own matmuls and convolutions of GPU
        tensors are counted instead: `F.linear`, `@`/`matmul`, `mm`, `bmm`, `conv1d/2d/3d`,
        `conv_transpose1d/2d/3d`, with the dtype they compute in and their forward FLOPs; it
        reports when most of those FLOPs are fp32
        outside autocast and they add up to enough work per step (`min-gflop-per-step`). Where the
        step clock predicts that step host-bound on the GPU, the message says so: its kernels are
        a small part of a step the host's launches set, and faster matmuls do not shorten it until
        the host issues the step faster.

    Evidence needed:
        A profiler trace with CUDA kernels and `deviceProperties` (recorded by Kineto), or a CUDA
        rehearsal (`audit run` of CUDA code on a machine without a GPU).
    """

    id = "amp-opportunity"
    reads = frozenset({"record_shapes"})  # (its FLOPs per operator)
    saves_on = "device"
    title = "fp32 matmul/conv on tensor-core GPU"
    severity = "info"
    category = "performance"
    judged_on_device = True
    options = (
        Option("min-share", 0.2, "Report when fp32 matmul/conv kernels take at least this share of GPU kernel time."),
        Option("min-ms-per-step", 1.0, "... and at least this many ms of kernel time per step."),
        Option("min-gflop-per-step", 0.1,
               "Rehearsal: report when the fp32 matmuls/convolutions outside autocast do at least this many "
               "GFLOP of forward work per step (and `min-share` of all the GPU matmul/conv FLOPs)."),
    )
    needs = frozenset({"trace", "run"})
    needs_text = "needs a profiler trace with CUDA kernels, or a CUDA rehearsal (`audit run --rehearse`)"

    def skip_reason(self, evidence: m.Evidence) -> str | None:
        """A run without a trace is judged in CUDA rehearsal only, where its GPU matmuls are counted."""
        return None if evidence.trace_data or evidence.environment.rehearsal else self.needs_text

    def check(self, evidence: m.Evidence, options: Options):
        yield from self.trace_findings(evidence, options)
        yield from self.rehearsal_findings(evidence, options)

    def rehearsal_findings(self, ev: m.Evidence, options: Options):
        """One finding for the run when most of its GPU matmul/conv FLOPs are fp32 outside autocast."""
        if not ev.steps or not ev.environment.rehearsal or on_accelerator(ev):
            return
        typical = typical_pairs(ev, m.DEVICE_MATMUL)
        n, pairs = typical.n, typical.pairs
        total = sum(t.count * int(t.data.get("flops") or 0) for _, t in pairs)
        fp32_pairs = [(s, t) for s, t in pairs if t.data.get("dtype") == "float32" and not t.data.get("autocast")]
        flops: dict[tuple, int] = {}
        for _, t in fp32_pairs:
            key = (t.what, t.where.file if t.where else None, t.where.line if t.where else None)
            flops[key] = flops.get(key, 0) + t.count * int(t.data.get("flops") or 0)
        places = unsuppressed(self.id, by_place(fp32_pairs), lambda p: p.where)

        def of(p) -> int:
            return flops.get((p.what, p.where.file if p.where else None, p.where.line if p.where else None), 0)

        places.sort(key=lambda p: -of(p))
        fp32 = sum(of(p) for p in places)
        if not places or not total or fp32 / total < options.min_share or fp32 / n < options.min_gflop_per_step * 1e9:
            return
        calls = sum(p.count for p in places)
        first = places[0].where.file if places[0].where else None
        # (the backward runs a derivative only for the calls autograd recorded; older evidence: all)
        graded = sum(t.count * int(t.data.get("flops") or 0) for _, t in fp32_pairs if t.data.get("grad", 1))
        graded_share = graded / sum(t.count * int(t.data.get("flops") or 0) for _, t in fp32_pairs)
        backward = ("the backward adds about twice as much" if graded_share > 0.99 else
                    "none of them is recorded for a backward" if graded_share < 0.01 else
                    f"the backward adds about twice the {graded_share:.0%} of it autograd records")
        yield self.finding(
            "fp32 matmuls outside autocast: try mixed precision. "
            f"On the GPU these matmuls/convolutions run in fp32 outside autocast: {per_step(calls / n)} calls per "
            f"step doing {fp32 / n / 1e9:.2f} GFLOP of forward work per step ({fp32 / total:.0%} of the GPU "
            f"matmul/conv FLOPs; {backward}), at "
            + "; ".join(f"{p.what} x{per_step(p.count / n)}/step ({of(p) / n / 1e9:.3f} GFLOP) at "
                        f"{line_ref(p.where.file if p.where else None, p.where.line if p.where else None, first)}"
                        for p in places[:5])
            + "; on a GPU with tensor cores, mixed precision runs them several times faster"
            + _host_bound_note(ev) + "." + typical.note(first),
            locations=locations(places),
            evidence={"fp32_gflop_per_step": round(fp32 / n / 1e9, 4), "gflop_per_step": round(total / n / 1e9, 4),
                      "fp32_share": round(fp32 / total, 4), "fp32_calls_per_step": round(calls / n, 2), "steps": n,
                      "fp32_recorded_share": round(graded_share, 4),
                      "left_out_steps": typical.left_out_steps(),
                      "rehearsal": True,
                      "sites": [{"what": p.what, "file": p.where.file if p.where else None,
                                 "line": p.where.line if p.where else None, "count": p.count,
                                 "gflop": round(of(p) / 1e9, 4)} for p in places]},
            cost=Cost(ms_per_step=None, share_of_step=None, measured=False,
                      note="counted, not timed: rehearsed on the CPU, where no tensor core runs"),
            fix=_framework_fix(trains_with([*(p.where.file for p in places if p.where), ev.target])) or
            _flag_fix(own_flag([ev.target, *(p.where.file for p in places if p.where)], "dtype", "bfloat16"),
                      ev.program.argv if ev.program else []) or
            Fix(summary="Run forward and loss under torch.autocast('cuda', dtype=torch.bfloat16) (float16 with "
                        "a GradScaler on GPUs before Ampere); at least allow TF32 for matmuls "
                        "(torch.backends.cuda.matmul.allow_tf32 = True). This changes numerics, so check the "
                        "loss curve.",
                config={"torch.autocast": {"device_type": "cuda", "dtype": "bfloat16"}},
                changes_numerics=True),
        )

    def check_trace(self, trace: Trace, options: Options, chosen: str = "") -> Finding | None:
        ev = trace.events
        kernels = ev[ev["cat"] == CAT["kernel"]]
        if not len(kernels):
            return None
        devices = kernels["device"].to_numpy()
        device_id = int(np.bincount(devices[devices >= 0]).argmax()) if (devices >= 0).any() else 0
        props = trace.device(device_id)
        if not props or not isinstance(props.get("computeMajor"), int) or props["computeMajor"] < 7:
            return None
        major, minor = int(props["computeMajor"]), int(props.get("computeMinor") or 0)
        codes = np.unique(kernels["name"].to_numpy())
        fp32_codes = [int(c) for c in codes if kernel_precision(trace.symbols[int(c)]) == "fp32"]
        reduced_codes = [int(c) for c in codes if kernel_precision(trace.symbols[int(c)]) == "reduced"]
        fp32 = kernels[kernels["name"].isin(fp32_codes)]
        total_ms = float(kernels["dur"].sum()) / 1000.0
        fp32_ms = float(fp32["dur"].sum()) / 1000.0
        reduced_ms = float(kernels[kernels["name"].isin(reduced_codes)]["dur"].sum()) / 1000.0
        steps = trace.step_count()
        share = fp32_ms / total_ms if total_ms else 0.0
        if share < options.min_share or fp32_ms / steps < options.min_ms_per_step:
            return None
        top = Counter()
        for code, dur in zip(fp32["name"].to_numpy(), fp32["dur"].to_numpy()):
            top[trace.symbols[int(code)]] += float(dur)
        rows = fp32.index.to_numpy()
        ops = Counter()
        for r, d in zip(rows, fp32["dur"].to_numpy()):
            ops[issuing_op(trace, int(r)) or "(no operator)"] += float(d) / 1000.0
        where = sites(trace, rows, weights=fp32["dur"].to_numpy())
        bf16 = major >= 8
        saving = fp32_ms / steps / 2.0  # tensor cores run these at least ~2x faster; a floor, not a promise
        note = "estimate: half of the fp32 matmul/conv kernel time"
        device, _ = device_for(trace, chosen, device_id)
        model: dict[str, Any] = {}
        if device is not None:
            model = model_estimate(trace, fp32.index.to_numpy(), device, "bfloat16" if bf16 else "float16", steps)
            saving = model["saving_ms_per_step"]
            note = model.pop("note")
        message = ("fp32 matmuls on a GPU with tensor cores: try mixed precision. "
                   f"The fp32 matmul/convolution kernels took {fp32_ms / steps:.1f} ms per step ({share:.0%} of GPU "
                   f"kernel time) in {trace.label} on a {props.get('name', 'GPU')} (compute capability "
                   f"{major}.{minor}) that has tensor cores; mixed precision could run them several times faster.")
        config: dict[str, Any] = {"torch.autocast": {"device_type": "cuda", "dtype": "bfloat16" if bf16 else "float16"}}
        if not bf16:
            config["torch.amp.GradScaler"] = True
        else:
            config["torch.backends.cuda.matmul.allow_tf32"] = True
            config["torch.backends.cudnn.allow_tf32"] = True
        return self.finding(
            message,
            locations=[Location(*frame_location_parts(f)) for f, _, _ in where],
            evidence={"trace": str(trace.path), "device": props.get("name"), "compute_capability": f"{major}.{minor}",
                      "steps": steps, "fp32_kernels": len(fp32), "fp32_ms_per_step": round(fp32_ms / steps, 3),
                      "reduced_ms_per_step": round(reduced_ms / steps, 3),
                      "kernel_ms_per_step": round(total_ms / steps, 3), "eligible_share": round(share, 4),
                      "top_kernels": {n[:120]: round(d / 1000.0, 3) for n, d in top.most_common(5)},
                      "ops_ms": {k: round(v, 3) for k, v in ops.most_common(5)}, **model},
            cost=Cost(ms_per_step=round(saving, 3), share_of_step=None,  # (TraceRule.check sets it)
                      measured=False, note=note),
            fix=_framework_fix(trains_with(f.file for f, _, _ in where), bf16) or
            Fix(summary=("Run forward and loss under torch.autocast('cuda', dtype=torch.bfloat16)" if bf16 else
                             "Run forward and loss under torch.autocast('cuda', dtype=torch.float16) with a GradScaler")
                    + "; this changes numerics, so check the loss curve.",
                    config=config, changes_numerics=True),
        )


def model_estimate(trace: Trace, rows: np.ndarray, device: DeviceSpec, target: str, steps: int) -> dict[str, Any]:
    """What the device model says the fp32 matmul/conv kernels (`rows`) would take in `target`
    (bfloat16 or float16) and in TF32. An operator whose shapes the trace records keeps the share
    of its roofline it reached in fp32 (its roofline time, max(FLOPs / peak, bytes / bandwidth),
    over its kernel time) under the target's roofline: the target's peak, and half the bytes for
    16-bit (TF32 keeps fp32 storage). Kernels without shapes: their time scaled by the ratio of the
    fp32 peak to the target's. {"device", "estimate_<target>_ms_per_step",
    "estimate_tf32_ms_per_step" (None without TF32), "saving_ms_per_step", "note"}."""
    dur = trace.col("dur")
    charged = kernel_ops(trace)
    shapes = op_shapes(trace)
    by_op: dict[int, float] = {}
    for r in rows.tolist():
        by_op[int(charged[r])] = by_op.get(int(charged[r]), 0.0) + float(dur[r])
    bw = device.mem_bw_gbs * 1e9
    half_ratio = device.fp32 / device.peak_tflops(target)
    tf32_ratio = device.fp32 / device.tf32 if device.tf32 else None
    half_us = tf32_us = 0.0
    floors = 0
    for op, us in by_op.items():
        work = None
        if op >= 0 and op in shapes:
            dims, types, concrete = shapes[op]
            work = op_work(trace.symbols[int(trace.col("name")[op])], dims, types, concrete)
        if work is None or work[0] <= 0:  # no shapes: the peak ratio alone
            half_us += us * half_ratio
            tf32_us += us * (tf32_ratio if tf32_ratio is not None else 1.0)
            continue
        floors += 1
        flops, nbytes = work[0], work[1]
        roof_fp32 = max(flops / (device.fp32 * 1e12), nbytes / bw) * 1e6
        share = min(1.0, roof_fp32 / us) if us > 0 else 1.0  # of its fp32 roofline, kept
        half_us += max(flops / (device.peak_tflops(target) * 1e12), nbytes / 2 / bw) * 1e6 / share
        tf32_us += max(flops / ((device.tf32 or device.fp32) * 1e12), nbytes / bw) * 1e6 / share
    fp32_ms = sum(by_op.values()) / 1e3 / steps
    half_ms = half_us / 1e3 / steps
    tf32_ms = tf32_us / 1e3 / steps if tf32_ratio is not None else None
    basis = (f"the {device.name}'s {target} peak {device.peak_tflops(target):g} against fp32 {device.fp32:g} "
             f"TFLOP/s" + (f" and {device.mem_bw_gbs:g} GB/s, each of {floors} operators with recorded shapes at "
                           f"the share of its roofline it reached in fp32, with half the bytes" if floors else ""))
    return {"device": device.key, f"estimate_{target}_ms_per_step": round(half_ms, 3),
            "estimate_tf32_ms_per_step": None if tf32_ms is None else round(tf32_ms, 3),
            "saving_ms_per_step": round(fp32_ms - half_ms, 3),
            "note": f"estimate from the device model: {fp32_ms:.1f} ms/step of fp32 kernels would take "
                    f"{half_ms:.1f} ms in {target} ({basis})"
                    + (f"; {tf32_ms:.1f} ms with TF32" if tf32_ms is not None else "")}


def _framework_fix(trains: Trains | None, bf16: bool | None = None) -> Fix | None:
    """Mixed precision in the terms of the Lightning Fabric or Trainer the program trains with:
    its `precision` setting, not an autocast of the user's own (frameworks.mixed_precision)."""
    advice = mixed_precision(trains, bf16)
    if advice is None:
        return None
    summary, config = advice
    return Fix(summary=summary + "; at least allow TF32 for matmuls (`torch.set_float32_matmul_precision(\"high\")`). "
               "This changes numerics, so check the loss curve.", config=config, changes_numerics=True)


def _flag_fix(flag: OwnFlag | None, argv: list[str]) -> Fix | None:
    """A script with its own option for the compute dtype (llm.c's `--dtype float32|float16|bfloat16`),
    not given on its command line: run it with that option."""
    if flag is None or any(a.split("=")[0] == flag.option for a in argv):
        return None
    return Fix(summary=f"Run it with its own `{flag.usage}` (its option at line {flag.line} of "
               f"{os.path.basename(flag.file)}: the forward and loss under autocast in bfloat16). This changes "
               "numerics, so check the loss curve.", config={flag.option: flag.usage.split(" ", 1)[1]},
               changes_numerics=True)


def _host_bound_note(ev: m.Evidence) -> str:
    """Where the step clock predicts the rehearsed step host-bound on the GPU: its kernels, matmuls
    included, are a part of the step its launches already outlast, so faster matmuls do not shorten
    it until the host issues the step faster (cleanrl's SAC: 0.07 ms of kernels in a 3.42 ms step)."""
    c = step_clock(ev)
    if c.source != "estimate" or c.bound != "host" or c.device_ms is None or not c.issue_floor_ms:
        return ""
    return (f", but this step is predicted host-bound there: all its kernels take about {c.device_ms:.2f} ms of the "
            f"{c.issue_floor_ms:.2f} ms the host takes to issue it, so they shorten the step only once the host "
            "issues it faster")

