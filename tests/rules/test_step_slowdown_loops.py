"""step-slowdown judges the loop a run ends in (pytorch/tutorials' nn_tutorial trains a logistic
regression, then CNNs, each in a loop of its own: its CPU step time rose from 0.5 to 4.9 ms across
them, and the rule reported a x11 slowdown "at" the CNN's backward). A rise across loops of other
work is no slowdown; a rise within the last loop still is. (Its evaluation of every sample seen,
run after the update, is the loop's own work: the step finder gives a loop with a new optimizer
its own tail of such forwards, where it had held it to the first loop's none, and put it between
the steps.)"""
from __future__ import annotations

import statistics

import pytest

from conftest import ONE_THREAD, audit

pytestmark = pytest.mark.slow

FIRST, SECOND = 60, 60
TWO_LOOPS = f'''import torch
from torch import nn

torch.manual_seed(0)
small = nn.Linear(16, 1)
opt = torch.optim.SGD(small.parameters(), lr=0.01)
for i in range({FIRST}):
    loss = small(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

big = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
opt = torch.optim.SGD(big.parameters(), lr=0.01)
seen = torch.empty(0, 256)
for i in range({SECOND}):
    x = torch.randn(128, 256)
    loss = big(x).pow(2).mean()  # LOOP LINE
    opt.zero_grad()
    loss.backward()
    opt.step()
    GROWING
'''
GROW = '''seen = torch.cat([seen, x])
    with torch.no_grad():
        big(seen).mean()  # GROW LINE: every sample seen so far, again'''


def run(tmp_path, growing: bool):
    (tmp_path / "loops.py").write_text(TWO_LOOPS.replace("GROWING", GROW if growing else "pass"))
    a = audit("run", str(tmp_path / "loops.py"), "--steps", "200", "--to-end", "--quiet",
              out=tmp_path / "out", env=ONE_THREAD)
    assert a.returncode == 0, a.stderr[-3000:]
    assert len(a.evidence["steps"]) == FIRST + SECOND
    return a


def test_a_rise_across_two_loops_of_other_work_is_no_slowdown(tmp_path):
    a = run(tmp_path, growing=False)
    steps = [s for s in a.evidence["steps"] if not s["profiled"] and s["index"] >= 2]
    first = sorted(s["cpu_ms"] for s in steps[:len(steps) // 4])
    last = sorted(s["cpu_ms"] for s in steps[-len(steps) // 4:])
    assert last[len(last) // 2] > 1.5 * first[len(first) // 2]  # (the second loop's steps are slower)
    assert a.rule("step-slowdown") == []
    # the summary names the two loops, each with its own median step, and the audit's own cost is
    # measured within one loop: the dense start's checked steps against the first loop's timed ones
    summary = (a.out / "summary.txt").read_text()
    assert f"in 2 training loops, each of other forward, backward or optimizer calls: steps 0-{FIRST - 1} (" in summary
    assert f", {FIRST}-{FIRST + SECOND - 1} (" in summary and "the headline's median over them all" in summary
    own = a.findings_doc["steps"]["own_cost"]
    assert own["loops"] == 2 and own["checks_compared_in"] == [0, FIRST - 1] == own["profile_compared_in"]
    first_timed = [s["ms"] for s in a.evidence["steps"][:FIRST] if s["index"] in own["timed_steps"]]
    assert own["timed_ms"] == pytest.approx(statistics.median(first_timed), abs=0.002)
    assert f"(in steps 0-{FIRST - 1}, one of the program's 2 training loops: " in summary


def test_a_rise_within_the_last_loop_is_judged_there(tmp_path):
    a = run(tmp_path, growing=True)
    grow = next(n for n, text in enumerate(TWO_LOOPS.replace("GROWING", GROW).splitlines(), 1) if "GROW LINE" in text)
    for s in a.evidence["steps"][FIRST:]:  # (the evaluation after the update is in the step)
        assert grow in {t["where"]["line"] for t in s["tallies"] if t["kind"] == "forward"}, s["index"]
    [f] = a.rule("step-slowdown")
    assert f["evidence"]["loops_before"] == 1 and f["evidence"]["first_step_judged"] == FIRST
    assert f"(those of the last of its 2 training loops, from step {FIRST})" in f["message"], f["message"]
