"""Generated hostile inputs, a few hundred per kind from a fixed seed: CUDA memory snapshots
(pickles), checkpoints (torch.save files and safetensors) and profiler traces. Each is a small
file built from the shape of a real one with one part spoilt: a value of the wrong type, a number
out of any range, deep nesting, a shared reference repeated many times. Each must load or be
refused with one line (InputError: exit 2), in bounded time: never an internal error (exit 4).

The loaders run in this process (a subprocess per case would cost a second each); a few cases of
each kind go through `audit` itself (auditor.cli.main) so the rules and reports see them too."""
from __future__ import annotations

import io
import json
import pickle
import random
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import pytest

from auditor.cli import main
from auditor.evidence.errors import InputError

SEED = 25
CASES = 240
THROUGH_CLI = 8  # of each kind, also run through `audit` (rules and reports included)
BUDGET_S = 30.0  # for all the cases of one kind, on a shared 2-core machine


def _deep(n: int) -> Any:
    v: Any = 1
    for _ in range(n):
        v = [v]
    return v


def hostile(rng: random.Random, like: Any) -> Any:
    """A value no real file holds where `like` is: the wrong type, out of range, deep, shared."""
    choices: list[Callable[[], Any]] = [
        lambda: None, lambda: True, lambda: -1, lambda: 0, lambda: 2**63, lambda: -(2**63) - 1,
        lambda: 10**30, lambda: 10**400, lambda: int("9" * 4000), lambda: 1.5, lambda: float("nan"),
        lambda: float("inf"), lambda: float("-inf"), lambda: "", lambda: "x", lambda: "inf", lambda: "9" * 5000,
        lambda: [], lambda: {}, lambda: [1, "a", None], lambda: {"a": 1}, lambda: {1: 2, 3: 4},
        lambda: _deep(rng.choice([50, 2000, 20000])), lambda: (1, 2), lambda: b"\x00\x01",
        lambda: [like] * rng.choice([2, 1000, 100_000]),  # one object by many references
        lambda: {str(i): like for i in range(rng.choice([10, 5000]))},
    ]
    return rng.choice(choices)()


def paths(obj: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every place in a nested dict/list structure, as key paths."""
    out = [prefix]
    if depth > 8:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += paths(v, prefix + (k,), depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:4]):
            out += paths(v, prefix + (i,), depth + 1)
    return out


def spoil(rng: random.Random, obj: Any, make: Callable[[random.Random, Any], Any] = hostile) -> Any:
    """A copy of `obj` (containers copied, leaves shared) with 1-3 places replaced."""
    def copy(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: copy(v) for k, v in o.items()}
        if isinstance(o, list):
            return [copy(v) for v in o]
        return o

    obj = copy(obj)
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(paths(obj))
        if not where:
            return make(rng, obj)
        holder = obj
        try:
            for k in where[:-1]:
                holder = holder[k]
            holder[where[-1]] = make(rng, holder[where[-1]])
        except (KeyError, IndexError, TypeError):  # (an earlier change replaced the path)
            pass
    return obj


def judged(load: Callable[[], Any]) -> str:
    """'ok' or 'refused' (one line); anything else fails the test with what was raised."""
    try:
        load()
    except InputError as e:
        assert "\n" not in str(e), str(e)
        return "refused"
    return "ok"


def through_cli(args: list[str], tmp_path: Path) -> int:
    with pytest.raises(SystemExit) as done:
        main([*args, "--out", str(tmp_path / "out"), "--quiet"])
    return int(done.value.code or 0)


# --- CUDA memory snapshots -----------------------------------------------------------------------

_FRAME = {"name": "forward", "filename": "/home/u/train.py", "line": 12}
_BLOCK = {"address": 1 << 20, "size": 512, "requested_size": 500, "state": "active_allocated", "frames": [_FRAME]}
SNAPSHOT = {
    "segments": [{"device": 0, "address": 1 << 20, "total_size": 2 << 20, "allocated_size": 512, "active_size": 512,
                  "requested_size": 500, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
                  "is_expandable": False, "frames": [_FRAME],
                  "blocks": [_BLOCK, {"address": (1 << 20) + 512, "size": (2 << 20) - 512, "requested_size": 0,
                                      "state": "inactive", "frames": []}]}],
    "device_traces": [[{"action": "segment_alloc", "addr": 1 << 20, "size": 2 << 20, "stream": 0, "time_us": 1,
                        "frames": [_FRAME]},
                       {"action": "alloc", "addr": 1 << 20, "size": 500, "stream": 0, "time_us": 2, "frames": [_FRAME]},
                       {"action": "oom", "device_free": 0, "size": 1 << 30, "stream": 0, "time_us": 3, "frames": []}]],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False, "max_split_size": -1,
                           "garbage_collection_threshold": 0.0},
    "external_annotations": [{"stage": "forward", "time_us": 1}],
}


def test_fuzz_snapshots(tmp_path: Path) -> None:
    from auditor.evidence.snapshot import live_at, load_snapshot

    rng = random.Random(SEED)
    seen = {"ok": 0, "refused": 0}
    t0 = time.monotonic()
    for i in range(CASES):
        raw = spoil(rng, SNAPSHOT)
        p = tmp_path / f"s{i}.pickle"
        try:
            data = pickle.dumps(raw, protocol=rng.choice([2, 4, 5]))
        except RecursionError:  # (pickle itself cannot write it)
            continue
        if rng.random() < 0.1:  # damaged bytes
            at = rng.randrange(len(data))
            data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
        p.write_bytes(data)

        def load() -> None:
            snap = load_snapshot(p)
            msgspec.json.encode(snap)
            for d, h in snap.histories.items():
                live_at(snap, d, h.peak_allocated_index)

        seen[judged(load)] += 1
        if i < THROUGH_CLI:
            assert through_cli(["analyze", str(p)], tmp_path) in (0, 2)
    assert seen["ok"] and seen["refused"], seen
    assert time.monotonic() - t0 < BUDGET_S


def test_fuzz_snapshot_bytes(tmp_path: Path) -> None:
    """Short opcode strings after the PROTO header: memo indices, huge lengths, bad opcodes."""
    from auditor.evidence.snapshot import load_snapshot

    rng = random.Random(SEED)
    ops = [b"]", b"}", b"(", b"l", b"d", b"t", b"e", b"a", b"u", b"r\xff\xff\xff\x7f", b"q\x05", b"h\x01",
           b"j\x00\x00\x00\x10", b"\x94", b"K\x05", b"J\xff\xff\xff\xff", b"\x8a\x08" + bytes(8),
           b"X\xff\xff\xff\x0fab", b"\x8d" + bytes(8), b"\x95\xff\xff\xff\xff\xff\xff\x00\x00", b"N", b"0", b"1",
           b"\x82\x01", b"c" + b"os\nsystem\n", b"\x93", b"R", b"b", b"\x88", b"\x89"]
    t0 = time.monotonic()
    for i in range(CASES):
        body = b"".join(rng.choice(ops) for _ in range(rng.randint(1, 12)))
        p = tmp_path / f"b{i}.pickle"
        p.write_bytes(b"\x80" + bytes([rng.choice([2, 4, 5])]) + body + rng.choice([b".", b""]))
        judged(lambda: load_snapshot(p))
    assert time.monotonic() - t0 < BUDGET_S


# --- checkpoints -----------------------------------------------------------------------------------

def _checkpoints() -> list[Any]:
    import torch

    w = {"fc.weight": torch.randn(4, 3), "fc.bias": torch.zeros(4)}
    opt = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.ones(4, 3)}},
           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "params": [0, 1],
                             "initial_lr": 1e-3}]}
    sched = {"milestones": {5: 1, 8: 1}, "gamma": 0.1, "base_lrs": [1e-3], "last_epoch": 3, "_step_count": 4}
    return [w, {"model": w, "optimizer": opt, "scheduler": sched, "epoch": 3},
            {"state_dict": w, "optimizer_states": [opt], "lr_schedulers": [sched], "global_step": 9, "epoch": 1,
             "pytorch-lightning_version": "2.4.0"}, opt]


def _hostile_tensor(rng: random.Random) -> Any:
    import torch

    return rng.choice([
        lambda: torch.zeros(1).expand(2**40, 2**20), lambda: torch.empty(3, 4, device="meta"),
        lambda: torch.full((1,), float("nan")).expand(2**30), lambda: torch.empty(0, 2**40),
        lambda: torch.tensor([float("inf"), -1.0], dtype=torch.float16), lambda: torch.zeros(3, dtype=torch.complex64),
        lambda: torch.zeros(2, dtype=torch.float8_e4m3fn), lambda: torch.zeros(3, dtype=torch.int64),
        lambda: torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True), lambda: torch.zeros(4)[::2],
        lambda: torch.zeros(6).as_strided((3, 3), (0, 1)), lambda: torch.tensor(float("nan")),
    ])()


def test_fuzz_checkpoints(tmp_path: Path) -> None:
    import torch

    from auditor.evidence.checkpoint import checkpoint_evidence

    rng = random.Random(SEED)
    bases = _checkpoints()
    seen = {"ok": 0, "refused": 0}

    def make(r: random.Random, like: Any) -> Any:
        return _hostile_tensor(r) if r.random() < 0.3 else hostile(r, like)

    t0 = time.monotonic()
    for i in range(CASES):
        obj = spoil(rng, rng.choice(bases), make)
        p = tmp_path / f"c{i}.pt"
        buf = io.BytesIO()
        try:
            torch.save(obj, buf)
        except (RecursionError, RuntimeError, TypeError, pickle.PicklingError):  # (torch.save cannot write it)
            continue
        p.write_bytes(buf.getvalue())
        seen[judged(lambda: msgspec.json.encode(checkpoint_evidence(p)))] += 1
        if i < THROUGH_CLI:
            assert through_cli(["checkpoint", str(p)], tmp_path) in (0, 2)
    assert seen["ok"], seen
    assert time.monotonic() - t0 < BUDGET_S


def test_fuzz_safetensors(tmp_path: Path) -> None:
    from auditor.evidence.checkpoint import checkpoint_evidence

    rng = random.Random(SEED)
    good = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "b": {"dtype": "BF16", "shape": [2], "data_offsets": [16, 20]}, "__metadata__": {"format": "pt"}}
    t0 = time.monotonic()
    for i in range(CASES):
        header = spoil(rng, good)
        try:
            h = json.dumps(header).encode()
        except (TypeError, ValueError, RecursionError):
            continue
        p = tmp_path / f"s{i}.safetensors"
        p.write_bytes(len(h).to_bytes(8, "little") + h + bytes(rng.choice([0, 20, 64])))
        judged(lambda: msgspec.json.encode(checkpoint_evidence(p)))
    assert time.monotonic() - t0 < BUDGET_S


def test_fuzz_checkpoint_directories(tmp_path: Path) -> None:
    """Sharded Hugging Face indexes: names outside the directory, of the wrong type, missing."""
    from auditor.evidence.checkpoint import checkpoint_evidence

    rng = random.Random(SEED)
    h = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    shard = len(h).to_bytes(8, "little") + h + bytes(4)
    (tmp_path / "outside.safetensors").write_bytes(shard)
    names = ["model-1.safetensors", "../outside.safetensors", "/etc/passwd", "sub/../model-1.safetensors", "",
             ".", "..", "/dev/zero", 5, None, ["a"], "missing.safetensors", "x" * 5000]
    t0 = time.monotonic()
    for i in range(60):
        d = tmp_path / f"d{i}"
        d.mkdir()
        (d / "model-1.safetensors").write_bytes(shard)
        index = {"weight_map": {"w": rng.choice(names)}} if rng.random() < 0.8 else hostile(rng, {})
        try:
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
        except (TypeError, ValueError, RecursionError):
            continue
        if judged(lambda: checkpoint_evidence(d)) == "ok":
            assert all(str(f).startswith(str(d)) for f in checkpoint_evidence(d).checkpoint.files["model"])
    assert time.monotonic() - t0 < BUDGET_S


# --- profiler traces --------------------------------------------------------------------------------

def _trace() -> dict:
    ev: list[dict] = []
    for i in range(4):
        t = i * 1000
        ev += [{"ph": "X", "name": f"ProfilerStep#{i}", "cat": "user_annotation", "pid": 1, "tid": 1, "ts": t, "dur": 900},
               {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 1, "tid": 1, "ts": t + 5, "dur": 50,
                "args": {"External id": i, "Call stack": "train.py(12): step"}},
               {"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "pid": 1, "tid": 1, "ts": t + 10, "dur": 10,
                "args": {"correlation": i, "External id": i}},
               {"ph": "X", "name": "gemm", "cat": "kernel", "pid": 0, "tid": 7, "ts": t + 30, "dur": 100,
                "args": {"correlation": i, "device": 0, "stream": 7, "External id": i}},
               {"ph": "i", "s": "t", "name": "[memory]", "cat": "cpu_instant_event", "pid": 1, "tid": 1, "ts": t + 20,
                "args": {"Bytes": 1024, "Total Allocated": 1024, "Device Type": 1}},
               {"ph": "f", "id": i, "pid": 0, "tid": 7, "ts": t + 30, "cat": "ac2g", "name": "ac2g", "bp": "e"}]
    ev.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}})
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2},
            "deviceProperties": [{"id": 0, "name": "GPU", "totalGlobalMem": 16 << 30}], "traceEvents": ev}


def test_fuzz_traces(tmp_path: Path) -> None:
    from auditor.evidence.ranks.traces import ranks_from_traces
    from auditor.evidence.trace.load import load_trace

    rng = random.Random(SEED)
    base = _trace()
    seen = {"ok": 0, "refused": 0}

    def make(r: random.Random, like: Any) -> Any:
        v = hostile(r, like)
        return v if not isinstance(v, bytes) else v.decode()

    t0 = time.monotonic()
    for i in range(CASES):
        doc = spoil(rng, base, make)
        try:
            text = json.dumps(doc)  # (NaN and Infinity are written as Python writes them: not JSON)
        except (TypeError, ValueError, RecursionError):
            continue
        p = tmp_path / f"t{i}.json"
        p.write_text(text)

        def load() -> None:
            trace = load_trace(p, workers=0)
            ranks_from_traces([trace])

        seen[judged(load)] += 1
        if i < THROUGH_CLI:
            assert through_cli(["analyze", str(p)], tmp_path) in (0, 2)
    assert seen["ok"] and seen["refused"], seen
    assert time.monotonic() - t0 < BUDGET_S
