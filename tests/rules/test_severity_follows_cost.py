"""Severity follows cost (auditor.rules.engine.graded): a performance warning saves at least ~1% of
the run's time, or is not timed for a reason a user can act on; the rest is info. On README command
1's kept run (tests/fixtures/docs/audited_train_script, a CUDA rehearsal on a CPU)."""
from __future__ import annotations

import shutil

import msgspec
import pytest

from conftest import FIXTURES

from auditor.config import Config
from auditor.evidence.load import load_paths
from auditor.findings import Cost
from auditor.rules.engine import MIN_WARNING_SHARE, graded, run_rules
from auditor.rules.registry import all_rules


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    run = tmp_path_factory.mktemp("graded") / "audited_train_script"
    shutil.copytree(FIXTURES / "docs" / "audited_train_script", run)
    return {f.rule: f for f in run_rules(load_paths([run]), Config()).findings}


def test_warnings_that_save_a_share_of_the_run_stay_warnings(found):
    loader, pageable = found["dataloader-bound"], found["pageable-copy"]
    assert loader.severity == "warning" and loader.cost.share_of_step == pytest.approx(0.44, abs=0.01)
    # 0.32 of 35.0 ms a step: 0.9%, printed as 1%
    assert pageable.severity == "warning" and MIN_WARNING_SHARE <= pageable.cost.share_of_step < 0.01


def test_a_warning_that_saves_next_to_nothing_is_info(found):
    sync = found["host-sync"]
    assert sync.cost.ms_per_step == pytest.approx(0.01) and sync.cost.share_of_step < MIN_WARNING_SHARE
    assert sync.severity == "info" and sync.evidence["judged_as_gpu_code"] is True


def test_an_untimed_warning_without_a_reason_to_act_is_info(found):
    cudnn = found["cudnn-benchmark"]
    assert cudnn.cost.ms_per_step is None and not all_rules()["cudnn-benchmark"].warns_uncounted
    assert cudnn.severity == "info"


def test_an_untimed_warning_whose_rule_gives_a_reason_stays_a_warning(found):
    """anomaly-mode's cost is not timed in a rehearsal; its rule says why it matters all the same."""
    like = msgspec.structs.replace(found["cudnn-benchmark"], rule="anomaly-mode", severity="warning")
    assert all_rules()["anomaly-mode"].warns_uncounted
    assert graded([like])[0].severity == "warning"
    small = msgspec.structs.replace(like, cost=Cost(ms_per_step=0.01, share_of_step=0.0003))
    assert graded([small])[0].severity == "info"  # (timed and small: info, whatever the rule says)
    memory = msgspec.structs.replace(small, rule="memory-growth")
    assert graded([memory])[0].severity == "warning"  # (not a performance rule: its severity is its own)
