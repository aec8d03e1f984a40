"""The rules judged in two processes (auditor.rules.forked) give what one process gives: the same
findings, skips and errors in the same order, on a recorded trace; a rule that raises in the fork is
an error as it is in one process; a fork that dies or never reports leaves nothing unjudged; rules that share derived
evidence are judged in one process."""
from __future__ import annotations

import os
import time
import sys

import msgspec
import pytest
from conftest import FIXTURES

from auditor.evidence.load import load_paths
from auditor.rules import engine, forked
from auditor.rules.engine import run_rules
from auditor.rules.registry import all_rules

OWLV2 = FIXTURES / "traces" / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
pytestmark = pytest.mark.skipif(sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2,
                                reason="the rules are split over two processes on Linux with two cores or more")


def _plain(results) -> tuple:
    return (msgspec.json.encode(results.findings), results.skipped,
            [{k: v for k, v in e.items() if k != "traceback"} for e in results.errors], results.suppressed)


@pytest.fixture()
def owlv2():
    return load_paths([OWLV2])


def test_two_processes_give_what_one_gives(owlv2, monkeypatch):
    monkeypatch.setattr(forked, "FORK_MIN_EVENTS", 10**12)
    assert not forked.worth_forking(owlv2)
    one = run_rules(owlv2)
    # (a fresh parse: the rules' derived evidence cached on the first one is not shared)
    ev = load_paths([OWLV2])
    calls = []
    plain_fork = forked.judge_forked

    def counted(groups, judge, then=None):
        calls.append([i for g in groups for i in g])
        return plain_fork(groups, judge, then)

    monkeypatch.setattr(engine, "judge_forked", counted)
    monkeypatch.setattr(engine, "worth_forking", lambda evidence: True)
    two = run_rules(ev)
    assert calls and sorted(calls[0]) == sorted(all_rules())
    assert _plain(two) == _plain(one)
    assert {f.rule for f in two.findings} >= {"unfused-attention", "gpu-idle", "host-sync"}


def test_the_fork_judges_its_share_and_rules_sharing_a_gap_table_stay_together(owlv2, monkeypatch):
    monkeypatch.setattr(engine, "worth_forking", lambda evidence: True)
    pids: dict[str, int] = {}
    plain = engine._judge

    def judge(rule, rule_id, *args):
        out = plain(rule, rule_id, *args)
        # the judging process is told through the outcome (a fork's own variables die with it)
        out.skipped = {**(out.skipped or {"rule": rule_id}), "pid": str(os.getpid())}
        return out

    monkeypatch.setattr(engine, "_judge", judge)
    results = run_rules(owlv2)
    for entry in results.skipped:
        pids[entry["rule"]] = int(entry["pid"])
    assert set(pids) == set(all_rules())
    assert len(set(pids.values())) == 2 and os.getpid() in pids.values()
    assert pids["gpu-idle"] == pids["host-sync"] == pids["launch-bound"]


def test_a_rule_that_raises_in_the_fork_is_an_error_as_in_one_process(owlv2, monkeypatch):
    parent = os.getpid()

    def broken(self, evidence, options):
        raise ValueError(f"judged in {'the fork' if os.getpid() != parent else 'this process'}")

    # (the fork takes the list from its back: the last rule this trace is judged by is among its first)
    last = next(r for r in reversed(all_rules()) if engine.skip_reason(all_rules()[r](), owlv2) is None)
    monkeypatch.setattr(all_rules()[last], "check", broken)
    monkeypatch.setattr(engine, "worth_forking", lambda evidence: True)
    results = run_rules(owlv2)
    assert [(e["rule"], e["error"]) for e in results.errors] == [(last, "ValueError: judged in the fork")]
    assert "Traceback" in results.errors[0]["traceback"]


def test_units_keep_rules_that_share_together_at_the_first_ones_place():
    shares = {"a": (), "b": ("gaps",), "c": (), "d": ("gaps", "eff"), "e": ("eff",), "f": ()}
    assert forked.units(list(shares), lambda i: shares[i]) == [["a"], ["b", "d", "e"], ["c"], ["f"]]


def test_small_evidence_is_judged_in_this_process(owlv2):
    assert sum(len(t.events) for t in owlv2.trace_data) < forked.FORK_MIN_EVENTS
    assert not forked.worth_forking(owlv2)


@pytest.mark.parametrize("fork_does", ["exits", "never reports"])
def test_a_fork_that_dies_or_never_reports_leaves_nothing_unjudged(owlv2, monkeypatch, fork_does):
    """A fork that is gone (nothing it judged comes back), or one that waits forever (as a fork would
    on a lock another thread held at the fork: killed FORK_WAIT_S after this process's share): its
    share is judged here."""
    monkeypatch.setattr(forked, "FORK_MIN_EVENTS", 10**12)
    one = run_rules(owlv2)
    ev = load_paths([OWLV2])
    parent = os.getpid()
    last = list(all_rules())[-1]
    plain_check = all_rules()[last].check

    def misbehaves_in_the_fork(self, evidence, options):
        if os.getpid() != parent:
            if fork_does == "exits":
                os._exit(3)
            time.sleep(600)
        return plain_check(self, evidence, options)

    monkeypatch.setattr(all_rules()[last], "check", misbehaves_in_the_fork)
    monkeypatch.setattr(engine, "worth_forking", lambda evidence: True)
    monkeypatch.setattr(forked, "FORK_WAIT_S", 1.0)
    started = time.monotonic()
    two = run_rules(ev)
    assert time.monotonic() - started < 60
    assert _plain(two) == _plain(one)


def test_the_fork_makes_the_reports_efficiency_once_its_share_is_judged(owlv2, monkeypatch):
    """The efficiency the reports read is made in the fork after its rules (it waits for this
    process's) and kept here: the same tables one process makes, and not made again here."""
    from auditor.evidence.trace import efficiency as eff_module

    alone = eff_module.reported_efficiency(load_paths([OWLV2]))
    assert alone is not None and alone.ops and alone.steps and not alone.failed
    parent = os.getpid()
    made_in: list[int] = []
    plain = eff_module._efficiency

    def counted(trace, chosen):
        made_in.append(os.getpid())  # (the fork's own list dies with it: only this process's calls show)
        return plain(trace, chosen)

    monkeypatch.setattr(eff_module, "_efficiency", counted)
    monkeypatch.setattr(engine, "worth_forking", lambda evidence: True)
    run_rules(owlv2)
    trace = eff_module.gpu_trace(owlv2)
    assert made_in == []  # (no rule read it here: exposed-comm has no collectives to judge on this trace)
    kept = trace.__dict__["_efficiency"][owlv2.environment.device_model]
    assert msgspec.json.encode(kept) == msgspec.json.encode(alone)
    assert eff_module.reported_efficiency(owlv2) is kept and made_in == []
    assert parent == os.getpid()


def test_what_the_fork_was_to_make_is_made_here_when_it_does_not_report(owlv2, monkeypatch):
    monkeypatch.setattr(engine, "worth_forking", lambda evidence: True)
    monkeypatch.setattr(forked, "_made", lambda then: os._exit(3))  # (the fork dies after its share)
    results = run_rules(owlv2)
    assert not results.errors
    from auditor.evidence.trace import efficiency as eff_module
    trace = eff_module.gpu_trace(owlv2)
    assert owlv2.environment.device_model not in trace.__dict__.get("_efficiency", {})
    assert eff_module.reported_efficiency(owlv2).ops  # (made here, when the reports read it)
