"""The line sampler reads the step's thread's frames from a thread of its own: it charges the user's
line, and nothing it does changes the program (its frames' lifetimes, its grad mode)."""
from __future__ import annotations

import sys
import time

import torch
from torch import nn

from auditor.capture.lines import FIRST_LOOK, LineSampler


def _enter_inference_mode_off():
    # what torch.compile's `preserve_global_state` does on its way out of every compile: the guard
    # `torch.autograd.grad_mode._enter_inference_mode(False)` returns is dropped, and its freeing
    # restores grad mode (entered, it turns grad mode on)
    guard = torch._C._InferenceMode(False)
    guard.__enter__()
    return guard


def test_a_look_never_keeps_a_frame_past_its_return():
    """A frame the sampler held while the program's thread ran on could return meanwhile: its locals
    outlived it, to be freed in the sampler's thread. A dropped guard then restored the sampler's
    grad mode, not the program's: in an audited compiled step, dynamo raised "Global grad_mode
    state changed while dynamo tracing" (CI, under load). With thread switches every microsecond
    the old sampler did it in 5 of 6 runs of 200,000 calls here; each of 6 rounds of no_grad code must
    stay under no_grad, and come out of it with grad mode on."""
    switch = sys.getswitchinterval()
    sampler = LineSampler(interval=0.0)
    try:
        sys.setswitchinterval(1e-6)
        for _ in range(6):
            sampler.resume()
            enabled = 0
            with torch.no_grad():
                for _ in range(100_000):
                    _enter_inference_mode_off()
                    enabled += torch.is_grad_enabled()
            sampler.pause()
            assert enabled == 0 and torch.is_grad_enabled()
            assert sampler.take(), "the sampler looked"
    finally:
        sys.setswitchinterval(switch)


def test_the_user_line_below_many_library_frames_is_charged():
    """A module call whose stack holds more library frames than a look reads first (nested
    Sequentials): the time goes to the user's line that made the call, found by a second read."""
    model = nn.Linear(256, 256)
    for _ in range(FIRST_LOOK):
        model = nn.Sequential(nn.Sequential(model))
    x = torch.randn(256, 256)
    sampler = LineSampler()
    sampler.resume()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        model(x)  # THE LINE
    sampler.pause()
    times = sampler.take()
    line = next(n for n, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# THE LINE"))
    top = max(times, key=lambda t: t["ms"])
    assert (top["where"]["file"], top["where"]["line"]) == (__file__, line), times
    total = sum(t["ms"] for t in times)
    assert total >= 150 and top["ms"] >= 0.8 * total, times  # (of the 300 ms sampled)


def test_after_the_dense_start_one_step_in_16_is_sampled_and_never_a_checked_one():
    """Every step of the first 40, then one in 16: the first unchecked step from each 16th on (a
    checked step's time has the numerics checks in it)."""
    from auditor.capture.lines import Schedule

    checked = {0, 1, 2, 40, 41, 88}
    s = Schedule()
    got = [i for i in range(120) if s.sampled(i, i in checked)]
    assert got == [*range(40), 42, 56, 72, 89, 104]


def test_a_long_run_is_sampled_half_as_often_after_each_32_samples_twice_then_one_step_in_64():
    """capture.cadence: one step in 16 for 32 samples after the dense start (steps 40-536), one in
    32 for 32 more (552-1544), then one in 64 for good (from 1576)."""
    from auditor.capture.lines import Schedule

    s = Schedule()
    got = [i for i in range(5000) if s.sampled(i, False)]
    gaps = [b - a for a, b in zip(got, got[1:])]
    assert got[:41] == list(range(41))
    assert gaps[40:72] == [16] * 32 and got[72] == 552
    assert gaps[72:104] == [32] * 32 and got[104] == 1576
    assert set(gaps[104:]) == {64}
    # a checked step owed its sample still hands it to the next unchecked one at the slower rates
    s = Schedule()
    assert [i for i in range(1570, 1700) if s.sampled(i, i == 1576)] == [1577, 1640]


def test_a_look_charges_the_line_f_lineno_reads_in_a_long_function():
    """A look reads each frame's instruction offset and the chosen frame's line from its code's line
    table (f_lineno decodes that table from its start at every read: ~10 us at the end of a
    600-line function). The line is the one the frame's f_lineno reads: in every frame of a real
    stack, and the user's line at the end of a long function whose calls span several lines."""
    from auditor.capture.lines import _line_at

    def every_frame_agrees() -> int:
        f, n = sys._getframe(), 0
        while f is not None:
            assert _line_at(f.f_code, f.f_lasti) == f.f_lineno, (f.f_code, f.f_lasti)
            f, n = f.f_back, n + 1
        return n

    assert every_frame_agrees() > 3
    seen = []
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.register_forward_hook(lambda *_: seen.append(every_frame_agrees()))
    model(torch.randn(2, 4))
    assert seen and seen[0] > 5  # (inside torch's module call, below this test's frames)

    lines = [f"    x{i} = {i}" for i in range(600)]
    source = ("def long(model, x, t0):\n" + "\n".join(lines) + "\n"
              "    while time.perf_counter() - t0 < 0.3:\n"
              "        y = model(\n"
              "            x)\n")
    scope = {"time": time}
    exec(compile(source, "long_function.py", "exec"), scope)
    model = nn.Linear(256, 256)
    for _ in range(FIRST_LOOK):
        model = nn.Sequential(nn.Sequential(model))
    sampler = LineSampler()
    sampler.resume()
    scope["long"](model, torch.randn(256, 256), time.perf_counter())
    sampler.pause()
    times = [t for t in sampler.take() if t["where"]["file"] == "long_function.py"]
    top = max(times, key=lambda t: t["ms"])
    assert top["where"]["line"] in (603, 604), times  # (the call's line: where its CALL instruction is)
    assert sum(t["ms"] for t in times if t["where"]["line"] in (603, 604)) >= 0.8 * sum(t["ms"] for t in times)
