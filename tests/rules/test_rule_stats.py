"""The trend statistics the timing rules share (auditor.rules._support.trends): one slow step is not a trend."""
from __future__ import annotations

from auditor.rules._support.trends import quarter_floors, quarter_medians, spearman, trend_ratio, without_spikes

# Step times (ms) shaped like those of a flat 20-step trainer's audit (steps 3-6 profiled): a
# garbage collection at step 12, two slow steps at the end, a slight upward drift in between.
STEPS = [2, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
FLAT_WITH_SPIKES = [12.9, 11.0, 11.3, 11.2, 11.4, 11.9, 33.0, 11.6, 12.0, 12.2, 12.1, 12.4, 34.0, 260.0]
RISING = [10.0, 11.0, 11.6, 12.1, 12.9, 13.4, 14.2, 14.8, 15.5, 16.1, 16.9, 17.3, 18.2, 18.8]


def test_spikes_pass_the_old_gates_but_not_the_robust_ones():
    first, last = quarter_medians(FLAT_WITH_SPIKES)
    assert last / first > 1.3 and spearman([float(x) for x in STEPS], FLAT_WITH_SPIKES) > 0.6
    keep = without_spikes(FLAT_WITH_SPIKES)
    assert [FLAT_WITH_SPIKES[i] for i in range(len(STEPS)) if i not in keep] == [33.0, 34.0, 260.0]
    xs = [float(STEPS[i]) for i in keep]
    ys = [FLAT_WITH_SPIKES[i] for i in keep]
    assert trend_ratio(xs, ys) < 1.3  # step-slowdown's min-ratio


def test_a_steady_rise_keeps_every_step_and_its_ratio():
    assert without_spikes(RISING) == list(range(len(RISING)))
    xs = [float(x) for x in STEPS]
    assert 1.7 < trend_ratio(xs, RISING) < 2.0  # from 10 ms (the fastest step) to ~19 ms on the line


def test_a_steep_noisy_rise_whose_line_starts_below_zero_is_still_a_rise():
    # wall times of a real audit of examples/step_slowdown.py on a loaded machine (steps 2, 7-29)
    ms = [16.7, 24.3, 23.8, 23.4, 32.1, 45.6, 41.6, 37.6, 39.6, 46.0, 47.6, 49.7, 91.9, 71.4, 100.0, 138.7,
          123.4, 102.1, 53.5, 92.4, 70.4, 103.7, 118.6, 123.0]
    xs = [2.0] + [float(i) for i in range(7, 30)]
    assert without_spikes(ms) == list(range(len(ms)))
    assert trend_ratio(xs, ms) > 3
    # its last quarter's fastest step is still far slower than the first quarter's: growing work,
    # not load, which comes and goes and leaves some late steps as fast as the early ones
    first, last = quarter_floors(ms)
    assert last / first > 3
