"""Patterns of GPU programs seen in CUDA rehearsal: cuDNN's autotuner left off for fixed shapes,
fp32 matmuls/convolutions outside autocast, a hand-written per-parameter update loop, pinned
batches copied without non_blocking=True. Each on its example (at the marked lines, with its
numbers) and on its clean twin."""
from __future__ import annotations

import pytest

from conftest import EXAMPLES, expected_lines
from test_rehearsal import STEPS, rehearsed  # noqa: F401  (the session's rehearsed GPU examples)

pytestmark = pytest.mark.slow


@pytest.fixture
def run(request):
    """The session's rehearsed audit of a GPU example, by name."""
    return request.getfixturevalue("rehearsed")


def only(a, rule_id: str, name: str, estimated: float | None = None) -> dict:
    assert a.returncode == 0, a.stderr[-3000:]
    found = a.rule(rule_id)
    assert len(found) == 1, [(f["rule"], f["message"]) for f in a.findings]
    f = found[0]
    lines = expected_lines(EXAMPLES / f"{name}.py", rule_id)
    assert lines
    assert {(loc["file"], loc["line"]) for loc in f["locations"]} == {(str(EXAMPLES / f"{name}.py"), n)
                                                                     for n in lines}
    assert f["cost"]["measured"] is False  # counted, never timed; estimated for the device model's row, or not
    assert f["cost"]["ms_per_step"] == (pytest.approx(estimated) if estimated is not None else None)
    return f


def test_cudnn_benchmark_off_for_a_fixed_shape_convnet(run):
    f = only(run("gpu_convnet"), "cudnn-benchmark", "gpu_convnet")
    ev = f["evidence"]
    # two convolutions per step, the same two input shapes in every step
    assert ev["convolutions_per_step"] == 2.0 and ev["steps_with_common_shapes"] == STEPS
    assert ev["input_shapes"] == [[32, 3, 32, 32], [32, 16, 16, 16]]
    assert f["fix"]["config"] == {"torch.backends.cudnn.benchmark": True}


def test_amp_opportunity_from_rehearsal(run):
    a = run("gpu_convnet")
    f = a.rule("amp-opportunity")[0]
    ev = f["evidence"]
    # conv1: 2*32*16*32*32*27, conv2: 2*32*32*16*16*144, fc: 2*32*2048*10 forward FLOPs per step
    want = 2 * 32 * 16 * 32 * 32 * 27 + 2 * 32 * 32 * 16 * 16 * 144 + 2 * 32 * 2048 * 10
    assert ev["fp32_gflop_per_step"] == round(want / 1e9, 4) and ev["fp32_share"] == 1.0
    assert ev["fp32_calls_per_step"] == 3.0
    marked = expected_lines(EXAMPLES / "gpu_convnet.py", "amp-opportunity")
    lines = {loc["line"] for loc in f["locations"]}
    assert set(marked) <= lines and len(lines) == 3  # the classifier's line and both convolutions'
    assert f["severity"] == "info" and f["fix"]["changes_numerics"] is True


def test_convnet_twin_with_benchmark_and_autocast_is_silent(run):
    a = run("gpu_convnet_clean")
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings == [], [(f["rule"], f["message"]) for f in a.findings]
    # its convolutions were seen, under autocast in bfloat16 and with the autotuner on
    convs = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "device-matmul"]
    assert convs and all(t["data"]["autocast"] and t["data"]["dtype"] == "bfloat16" for t in convs)


def test_manual_update_loop(run):
    # 3 Linear layers: 6 parameters, each updated once a step at one line: 5 launches a step more
    # than the one torch._foreach_add_ would make, x 5 us on the default row (A100 SXM4 80GB)
    f = only(run("gpu_manual_update"), "manual-update", "gpu_manual_update", estimated=5 * 5 / 1e3)
    assert f["evidence"]["updates_per_step"] == 6.0
    assert [s["what"] for s in f["evidence"]["sites"]] == ["Parameter.data.add_"]
    assert f["cost"]["within"] == "launch-bound" and "A100 SXM4 80GB" in f["cost"]["note"]
    assert "1 launch(es) torch._foreach_* would make" in f["cost"]["note"]
    assert run("gpu_manual_update").rule("launch-bound") == []  # 12 launches a step: not a launch-bound step


def test_blocking_pinned_copy(run):
    f = only(run("gpu_blocking_pinned_copy"), "blocking-pinned-copy", "gpu_blocking_pinned_copy")
    # one 512x1024 float32 batch a step; the labels' copy asks for non_blocking and is not counted
    assert f["evidence"]["copies_per_step"] == 1.0 and f["evidence"]["bytes_per_step"] == 512 * 1024 * 4
    edit = f["fix"]["edits"][0]
    assert edit["lines"] == ["    x = x.to(device, non_blocking=True)  # expect: blocking-pinned-copy"]


def test_the_clean_gpu_trainer_has_none_of_them(run):
    a = run("gpu_clean")
    assert not [f for f in a.findings if f["rule"] in ("cudnn-benchmark", "manual-update", "blocking-pinned-copy")]
