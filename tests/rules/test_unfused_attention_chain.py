"""unfused-attention on a hand-written causal attention (examples/gpu_attention.py, a nanoGPT-style
block under bf16 autocast): a real CPU profiler trace of its training steps shows the chain (the
scores' matmul, the scale, the mask's eq and masked_fill, softmax, dropout, the values' matmul) at
the softmax's line, with its time and shapes, and an SDPA patch that runs; its clean twin
(examples/gpu_attention_clean.py, F.scaled_dot_product_attention) and the H100 recordings of the
other examples are silent."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT

from auditor.evidence.load import load_paths
from auditor.fixes import make_patch
from auditor.rules.engine import run_rules

EXAMPLES = ROOT / "examples"
RECORD = """
import runpy, sys, torch
for example, out in zip(sys.argv[1::2], sys.argv[2::2]):
    ns = runpy.run_path(example)
    for i in range(2):
        ns["step"](i)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, with_stack=True,
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
                                on_trace_ready=lambda p, out=out: p.export_chrome_trace(out)) as prof:
        for i in range(2, 5):
            ns["step"](i)
            prof.step()
"""


def record(*pairs: tuple[Path, Path]) -> list[Path]:
    """A CPU profiler trace of two training steps of each example (shapes and stacks recorded), the
    examples one after the other in one process (each its own module namespace, seeded by its own
    code, profiled in a session of its own); the examples share a folder, the process's cwd."""
    (folder,) = {example.parent for example, _ in pairs}
    subprocess.run([sys.executable, "-c", RECORD, *(str(p) for pair in pairs for p in pair)], check=True,
                   capture_output=True, timeout=240, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, cwd=folder)
    return [out for _, out in pairs]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    base = tmp_path_factory.mktemp("attention")
    names = ("gpu_attention", "gpu_attention_clean")
    return dict(zip(names, record(*((EXAMPLES / f"{name}.py", base / f"{name}.pt.trace.json") for name in names))))


def findings(path: Path) -> list:
    results = run_rules(load_paths([path]))
    assert not results.errors, results.errors
    return [f for f in results.findings if f.rule == "unfused-attention"]


def test_hand_written_causal_attention_is_found_at_the_softmax(traces, monkeypatch):
    monkeypatch.chdir(EXAMPLES)  # (the profiler names the example's file relative to its folder, sys.path[0])
    (f,) = findings(traces["gpu_attention"])
    ev = f.evidence
    assert ev["timed_on"] == "cpu" and ev["dtype"] == "bfloat16"
    assert ev["chains"] == 4  # 2 layers x 2 profiled steps
    # B4 x 4 heads, T128, heads of 16: both matmuls, 2 * 16 * 128 * 128 * (16 + 16) FLOPs a chain, 2 a step
    # (at T64 the chains were 0.11-0.115 of a CPU step, against the 0.1 the rule asks: under load on CI
    # one trace read less; at T128 they are 0.16-0.18)
    assert ev["shapes"] == {"16x128x16 @ 16x16x128 -> softmax 16x128x128 @ 16x128x16": 4}
    assert ev["flops_per_step"] == 2 * (2 * 16 * 128 * 128 * (16 + 16))
    assert {"aten::mul", "aten::eq", "aten::masked_fill", "aten::dropout"} <= set(ev["between"])
    assert ev["attention_ms_per_step"] > 0 and 0.1 <= ev["step_share"] < 1
    assert f.cost is not None and f"took {ev['attention_ms_per_step']:.2f} ms per step on the CPU" in f.cost.note
    loc = f.locations[0]
    assert Path(loc.file).name == "gpu_attention.py" and loc.line == 35
    assert loc.code == "att = torch.softmax(att, dim=-1)"
    assert f.message.startswith("Attention runs unfused: call scaled_dot_product_attention. 4 attention computations in gpu_attention.pt.trace.json run unfused (matmul, "
                                "softmax, matmul with ")


def test_the_sdpa_patch_replaces_the_chain_and_runs(traces, tmp_path, monkeypatch):
    monkeypatch.chdir(EXAMPLES)
    (f,) = findings(traces["gpu_attention"])
    (edit,) = f.fix.edits
    assert (edit.start, edit.end) == (33, 37) and f.fix.changes_numerics
    assert edit.lines == ["        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout.p "
                          "if self.training else 0.0, is_causal=True, scale=(1.0 / math.sqrt(k.size(-1))))"]
    assert make_patch([edit])
    lines = (EXAMPLES / "gpu_attention.py").read_text().splitlines()
    lines[edit.start - 1:edit.end] = edit.lines
    patched = tmp_path / "gpu_attention.py"
    patched.write_text("\n".join(lines) + "\n")
    # (the recording runs the patched file, its module body and five training steps, forward and
    # backward through the SDPA call: a patch that did not run would fail it, check=True)
    (trace,) = record((patched, tmp_path / "patched.pt.trace.json"))
    monkeypatch.chdir(tmp_path)
    assert findings(trace) == []


def test_the_sdpa_twin_is_silent(traces):
    assert findings(traces["gpu_attention_clean"]) == []


@pytest.mark.parametrize("recording", sorted(p.name for p in (FIXTURES / "h100" / "plain").glob("*.json.gz")))
def test_h100_recordings_without_attention_are_silent(recording):
    assert findings(FIXTURES / "h100" / "plain" / recording) == []


def test_a_frame_at_the_call_line_gets_the_same_patch_and_line():
    """An audited run's probes name the softmax call's line (35), not forward's def line (27) as
    a plain profiler trace does: the same function is found above it, so the same SDPA edit and
    location follow (before, `audit run gpu_attention.py:step` gave the finding no edit and
    --verify said 'settings with no code edit')."""
    from auditor.evidence.frame import Frame
    from auditor.rules._support.sdpa_patch import sdpa_edit, source_lines
    from auditor.rules.unfused_attention import softmax_location

    source = str(EXAMPLES / "gpu_attention.py")
    by_def, by_call = Frame(file=source, line=27, function="forward"), Frame(file=source, line=35, function="forward")
    assert source_lines(by_call) == source_lines(by_def) == (27, 39)
    edit = sdpa_edit(by_call)
    assert edit is not None and edit == sdpa_edit(by_def) and (edit.start, edit.end) == (33, 37)
    loc = softmax_location(by_call)
    assert loc.line == 35 and loc.code == "att = torch.softmax(att, dim=-1)"
    # a line outside any function, or past the file, has no function
    assert source_lines(Frame(file=source, line=13, function="<module>")) is None
    assert source_lines(Frame(file=source, line=10_000, function="forward")) is None
