"""Every rule on the input that triggers it and on its clean twin: it fires on the first (at the
lines an example marks `# expect: rule-id`) and stays silent on the second.

The inputs are the audits the suite shares (example trainers, numerics examples, rehearsed GPU
examples, 2-rank jobs: conftest and test_rehearsal run each once per session), the recorded
traces and snapshots under tests/fixtures (analysed in-process), and checkpoints built here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from conftest import (
    EXAMPLES,
    FIXTURES,
    balanced_ddp_run,
    data_parallel_run,
    expected_lines,
    find_unused_run,
    metric_ddp_run,
    shared_audit,
    straggler_ddp_run,
)
from test_rehearsal import rehearsed  # noqa: F401  (the session's rehearsed GPU examples)

from auditor.cli import main
from auditor.config import Config
from auditor.evidence.load import load_paths
from auditor.rules.engine import run_rules
from auditor.rules.registry import all_rules

TRACES = FIXTURES / "traces"
SNAPSHOTS = FIXTURES / "snapshots"
W0 = TRACES / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
W4 = TRACES / "v100_resnet50_dataloader_workers4.pt.trace.json.gz"
BERT = TRACES / "h100_bert_small_item_sync.pt.trace.json.gz"
OWLV2 = TRACES / "h100_owlv2_syncs_dataloader.pt.trace.json.gz"
DDP_TRACE = TRACES / "a100_ddp_nccl_2rank.pt.trace.json.gz"
FRAGMENTED = SNAPSHOTS / "fragmented_72gb_state_only.pickle"
LLAMA = SNAPSHOTS / "llama_mostly_free_segments.pickle"
TRANSFORMER = SNAPSHOTS / "transformer_fullstep_with_history.pickle"
DATA = Path(__file__).resolve().parent.parent / "data"  # synthetic snapshots (tests/data/make_allocator_snapshots.py)


@dataclass(frozen=True)
class Input:
    """What a rule is audited on: `kind` (example: a CPU example trainer, 30 steps; numerics: a
    numerics example; rehearsal: a GPU example rehearsed on the CPU; ddp: a shared distributed
    run; file: a recorded trace or snapshot analysed in-process; checkpoint: one built here),
    `name` (the example, the shared run, the file or the checkpoint), and `options` of the rule
    for a file."""

    kind: str
    name: str
    options: tuple[tuple[str, Any], ...] = ()
    # (program: a whole program under tests/data/run_time, `audit run FILE --steps 40`)

    def __str__(self) -> str:
        return f"{self.kind}:{Path(self.name).name.split('.')[0]}"


def ex(name: str) -> Input:
    return Input("example", name)


CLEAN = ex("clean")
NUMERICS_CLEAN = Input("numerics", "numerics_clean")
GPU_CLEAN = Input("rehearsal", "gpu_clean")
RUN_TIME = DATA / "run_time"  # whole programs that stall, restart workers, work between steps


def program(name: str) -> Input:
    return Input("program", str(RUN_TIME / f"{name}.py"))


PROGRAM_CLEAN = program("slow_samples")  # (persistent workers, nothing between its steps)
BALANCED = Input("ddp", "balanced")

# rule id -> (the input it fires on, its clean twin)
TABLE: dict[str, tuple[Input, Input]] = {
    "allocator-fragmentation": (Input("file", str(FRAGMENTED)), Input("file", str(LLAMA))),
    "allocator-churn": (Input("file", str(DATA / "allocator_churn.pickle")), Input("file", str(DATA / "allocator_calm.pickle"))),
    "reserved-overhang": (Input("file", str(DATA / "reserved_overhang.pickle")), Input("file", str(TRANSFORMER))),
    "amp-opportunity": (Input("file", str(W0)), Input("file", str(BERT))),
    "amp-unscaled": (Input("numerics", "numerics_amp_unscaled"), NUMERICS_CLEAN),
    "anomaly-mode": (ex("anomaly_mode"), CLEAN),
    "checkpoint-health": (Input("checkpoint", "extreme"), Input("checkpoint", "healthy")),
    "collective-wait": (Input("ddp", "metric"), BALANCED),
    "data-parallel": (Input("ddp", "ddp_data_parallel"), BALANCED),
    "dataloader-bound": (ex("dataloader_bound"), CLEAN),
    "dataloader-on-device": (Input("rehearsal", "gpu_dataset_cuda"), GPU_CLEAN),
    "ddp-config": (Input("ddp", "ddp_find_unused"), BALANCED),
    "forced-cleanup": (ex("forced_cleanup"), CLEAN),
    "gpu-idle": (Input("file", str(W0)), Input("file", str(W4))),
    "grad-explosion": (Input("numerics", "numerics_lr_blowup"), NUMERICS_CLEAN),
    "zero-gradients": (Input("numerics", "numerics_zero_grad"), NUMERICS_CLEAN),
    "graph-leak": (ex("graph_leak"), CLEAN),
    "hook-leak": (ex("hook_leak"), CLEAN),
    "host-sync": (ex("host_sync"), CLEAN),
    "launch-bound": (Input("file", str(W0)), Input("file", str(BERT))),
    "lr-schedule": (Input("numerics", "numerics_lr_warmup"), NUMERICS_CLEAN),
    "memory-growth": (ex("memory_growth"), CLEAN),
    "nonfinite": (Input("numerics", "numerics_log_zero"), NUMERICS_CLEAN),
    "oom-risk": (Input("file", str(TRANSFORMER), (("device-capacity-gib", 60.0),)), Input("file", str(LLAMA))),
    "pageable-copy": (Input("rehearsal", "gpu_cuda_everywhere"), GPU_CLEAN),
    "peak-stats-reset": (ex("peak_stats_reset"), CLEAN),
    "rank-straggler": (Input("ddp", "straggler"), BALANCED),
    "retained-graph": (ex("retained_graph"), CLEAN),
    "unused-graph": (ex("unused_graph"), CLEAN),
    "sampler-epoch": (ex("sampler_epoch"), CLEAN),
    "step-slowdown": (ex("step_slowdown"), CLEAN),
    "unfused-attention": (Input("file", str(OWLV2)), Input("file", str(BERT))),
    "exposed-comm": (Input("file", str(DDP_TRACE)), Input("file", str(OWLV2))),
    "cudnn-benchmark": (Input("rehearsal", "gpu_convnet"), Input("rehearsal", "gpu_convnet_clean")),
    "manual-update": (Input("rehearsal", "gpu_manual_update"), GPU_CLEAN),
    "blocking-pinned-copy": (Input("rehearsal", "gpu_blocking_pinned_copy"), GPU_CLEAN),
    "worker-restarts": (program("epoch_restarts"), PROGRAM_CLEAN),
    "work-between-steps": (program("eval_and_save"), PROGRAM_CLEAN),
    "host-built-tensor": (Input("rehearsal", "gpu_host_built"), GPU_CLEAN),
}

# shared distributed run -> (its directory, given the session's tmp_path_factory; its example)
DDP_RUNS = {"balanced": (balanced_ddp_run, "ddp_balanced"),
            "straggler": (straggler_ddp_run, "ddp_straggler"),
            "metric": (lambda factory: metric_ddp_run(factory)[0], "ddp_metric_allreduce"),
            "ddp_find_unused": (lambda factory: find_unused_run(factory).out, "ddp_find_unused"),
            "ddp_data_parallel": (lambda factory: data_parallel_run(factory).out, "ddp_data_parallel")}


@cache
def _file_findings(path: str, rule_id: str, options: tuple[tuple[str, Any], ...]) -> list[dict]:
    config = Config(rule_options={rule_id: dict(options)} if options else {})
    results = run_rules(load_paths([Path(path)]), config)
    return msgspec.to_builtins([f for f in results.findings if f.rule == rule_id])


def _checkpoint_findings(kind: str, rule_id: str, tmp_path: Path, capsys) -> list[dict]:
    weights = torch.ones(8, 8)
    if kind == "extreme":
        weights[3, 3] = 2.5e5
    torch.save({"model": {"0.weight": weights}}, tmp_path / f"{kind}.pt")
    with pytest.raises(SystemExit):
        main(["checkpoint", str(tmp_path / f"{kind}.pt"), "--out", str(tmp_path / kind), "--quiet"])
    capsys.readouterr()
    doc = json.loads((tmp_path / kind / "findings.json").read_text())
    return [f for f in doc["findings"] if f["rule"] == rule_id]


def findings(inp: Input, rule_id: str, request) -> tuple[list[dict], Path | None]:
    """The rule's findings on the input (as findings.json writes them), and the example file whose
    `# expect` markers name the lines (None: the input is no example)."""
    factory = request.getfixturevalue("tmp_path_factory")
    if inp.kind == "file":
        return _file_findings(inp.name, rule_id, inp.options), None
    if inp.kind == "checkpoint":
        return _checkpoint_findings(inp.name, rule_id, request.getfixturevalue("tmp_path"),
                                    request.getfixturevalue("capsys")), None
    if inp.kind == "program":
        a = shared_audit(factory, f"program-{Path(inp.name).stem}", "run", inp.name, "--steps", "40", "--quiet",
                         env={"OMP_NUM_THREADS": "1"})
        assert a.returncode == 0, a.stderr[-4000:]
        return a.rule(rule_id), Path(inp.name)
    if inp.kind == "example":
        a = request.getfixturevalue("example_audit")(inp.name)
    elif inp.kind == "numerics":
        a = request.getfixturevalue("numerics_audit")(inp.name)
    elif inp.kind == "rehearsal":
        a = request.getfixturevalue("rehearsed")(inp.name)
    else:
        run, example = DDP_RUNS[inp.name]
        doc = json.loads((run(factory) / "findings.json").read_text())
        return [f for f in doc["findings"] if f["rule"] == rule_id], EXAMPLES / f"{example}.py"
    assert a.returncode == 0, a.stderr[-4000:]
    return a.rule(rule_id), EXAMPLES / f"{inp.name}.py"


@pytest.mark.parametrize("rule_id", sorted(TABLE))
def test_the_rule_fires_on_its_input_at_the_marked_lines(rule_id: str, request) -> None:
    found, example = findings(TABLE[rule_id][0], rule_id, request)
    assert found, f"{rule_id} did not fire on {TABLE[rule_id][0]}"
    if example is not None and (lines := expected_lines(example, rule_id)):
        located = {(loc["file"], loc["line"]) for f in found for loc in f["locations"]}
        assert located >= {(str(example), n) for n in lines}, [f["message"] for f in found]


@pytest.mark.parametrize("rule_id", sorted(TABLE))
def test_the_rule_is_silent_on_the_clean_twin(rule_id: str, request) -> None:
    found, _ = findings(TABLE[rule_id][1], rule_id, request)
    assert found == [], [f["message"] for f in found]


def test_every_rule_has_a_row() -> None:
    assert sorted(TABLE) == sorted(all_rules())
