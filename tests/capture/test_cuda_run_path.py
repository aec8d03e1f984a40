"""The CUDA memory path of `audit run`, end to end, on a machine without a GPU.

On CUDA the child records the allocator's history over the profiled steps (memory_snapshot.pickle)
and attaches an out-of-memory observer that dumps oom_snapshot.pickle, with what the allocator told
it in oom_snapshot.json, before the error reaches Python. Here the real `audit run` CLI runs a small
trainer whose third step runs out of GPU memory; the GPU is a stand-in (FAKE_GPU below, loaded as
`sitecustomize` by the audited child only) that answers the torch.cuda calls the child makes on that
path, with an allocator state trimmed from a real recording. The trainer's tensors stay on the CPU.
(The fake's directory goes first on PYTHONPATH of `audit`, whose runner passes its environment to
the child; sitecustomize acts only when the process is `python -m auditor.capture.child`.)

Every expected number is the test's own: the trimmed state's sums and the request the trainer makes.
"""
from __future__ import annotations

import _thread
import functools
import io
import json
import os
import pickle
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, Audit, audit

from auditor.evidence.model import Evidence
from auditor.evidence.snapshot import GiB, MiB, _SafeUnpickler, load_snapshot
from auditor.rules.oom_risk import OomRisk

TRANSFORMER = FIXTURES / "snapshots" / "transformer_fullstep_with_history.pickle"

NAME = "NVIDIA Fake 2GB"  # what get_device_properties says the device is
REQUEST = 1 * GiB  # what the trainer's third step asks for
FREE = 600 * MiB  # what CUDA has free then
CONTEXT = 224 * MiB  # the device memory neither free nor the allocator's (CUDA context, other processes)
OOM_AT_STEP = 2

FAKE_GPU = r'''"""A stand-in CUDA device for tests/test_cuda_run_path.py (written there; never installed).

Loaded as `sitecustomize` by every Python process of the test, it acts only in the audited child
(`python -m auditor.capture.child`), where torch.cuda answers as one GPU would for the calls the child
makes on its CUDA path: is_available, is_initialized, device_count, current_device,
get_device_properties (NAME and TOTAL), get_per_process_memory_fraction (1.0),
memory_allocated, memory_reserved, memory_stats_as_nested_dict (those two counters), mem_get_info,
torch.cuda.memory._record_memory_history and _snapshot (the allocator's state: device_state.pickle,
trimmed from a real recording), and torch._C._cuda_attach_out_of_memory_observer
(the observers are kept in OBSERVERS). torch.profiler leaves CUDA activity out: a CPU build's profiler
has none to record. Anything else that would initialise real CUDA is logged to real_cuda.log and then
fails as it would.
"""
import inspect
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
OBSERVERS = []  # what torch._C._cuda_attach_out_of_memory_observer was given
_history = {"on": False, "ooms": []}


def _log(name, entry):
    with open(os.path.join(HERE, name), "a") as f:
        f.write(json.dumps(entry) + "\n")


def _frames(frame):
    """A Python stack as the allocator records it (stacks="python"): innermost first."""
    return [{"name": f.name, "filename": f.filename, "line": f.lineno}
            for f in reversed(traceback.extract_stack(frame))]


def record_oom(device, alloc, total, free):
    """The "oom" entry the allocator adds to its history, when one is recorded, before it calls the
    observers (it has the observers' arguments). Its stack is the caller's."""
    if _history["on"]:
        _history["ooms"].append({"action": "oom", "device_free": free, "size": alloc, "stream": 0,
                                 "time_us": time.time_ns() // 1000, "frames": _frames(sys._getframe(1))})


if "auditor.capture.child" in getattr(sys, "orig_argv", ()):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from auditor.evidence.snapshot import _SafeUnpickler

    with open(os.path.join(HERE, "device.json")) as f:
        _config = json.load(f)
    TOTAL, FREE, REQUEST, OOM_AT_STEP, NAME = (_config[k] for k in ("total", "free", "request", "oom_at_step",
                                                                    "name"))
    with open(os.path.join(HERE, "device_state.pickle"), "rb") as f:
        STATE = _SafeUnpickler(f).load()  # segments, the steps' trace, allocator_settings
    ALLOCATED = sum(s["allocated_size"] for s in STATE["segments"])
    RESERVED = sum(s["total_size"] for s in STATE["segments"])

    def _same_call(real):
        """A stand-in that takes exactly the arguments the real function takes."""
        sig = inspect.signature(real)

        def wrap(fake):
            def call(*args, **kwargs):
                return fake(**sig.bind(*args, **kwargs).arguments)
            return call
        return wrap

    @_same_call(torch.cuda.memory._record_memory_history)
    def _record_memory_history(**kwargs):
        _log("history_calls.jsonl", kwargs)
        _history["on"] = kwargs.get("enabled", "all") is not None
        if not _history["on"]:
            _history["ooms"].clear()  # torch drops the history when recording stops

    @_same_call(torch.cuda.memory._snapshot)
    def _snapshot(**kwargs):
        trace = STATE["device_traces"][0] + _history["ooms"] if _history["on"] else []
        return {"segments": STATE["segments"], "device_traces": [trace],
                "allocator_settings": STATE["allocator_settings"], "external_annotations": []}

    class _Properties:
        """What torch.cuda.get_device_properties returns, as far as the auditor reads it."""
        name = NAME
        total_memory = TOTAL

    @_same_call(torch.cuda.get_device_properties)
    def _get_device_properties(device=None):
        _log("properties_calls.jsonl", {"device": device})
        assert device in (None, 0), device  # one device
        return _Properties()

    def _attach(observer):
        assert callable(observer)
        OBSERVERS.append(observer)

    torch.cuda.is_available = lambda: True
    torch.cuda.is_initialized = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.memory_allocated = lambda device=None: ALLOCATED
    torch.cuda.memory_reserved = lambda device=None: RESERVED
    torch.cuda.memory_stats_as_nested_dict = lambda device=None: {
        "allocated_bytes": {"all": {"current": ALLOCATED}}, "reserved_bytes": {"all": {"current": RESERVED}}}
    torch.cuda.mem_get_info = lambda device=None: (FREE, TOTAL)
    torch.cuda.get_per_process_memory_fraction = lambda device=None: 1.0
    torch.cuda.get_device_properties = _get_device_properties
    torch.cuda.memory._record_memory_history = _record_memory_history
    torch.cuda.memory._snapshot = _snapshot
    torch._C._cuda_attach_out_of_memory_observer = _attach

    _profile_init = profile.__init__

    def _cpu_profile(self, *args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a != ProfilerActivity.CUDA]
        _profile_init(self, *args, activities=activities, **kwargs)
    profile.__init__ = _cpu_profile

    _real_lazy_init = torch.cuda._lazy_init

    def _tripwire():
        _log("real_cuda.log", "".join(traceback.format_stack()))
        _real_lazy_init()
    for _name, _module in list(sys.modules.items()):
        if _name.startswith("torch.cuda") and getattr(_module, "_lazy_init", None) is _real_lazy_init:
            _module._lazy_init = _tripwire
'''

TRAINER = '''"""A small trainer whose third step runs out of GPU memory (the GPU is the test's stand-in)."""
import torch

import sitecustomize as gpu

torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 16), torch.randn(64, 4)


def allocate(nbytes):
    """cudaMalloc(nbytes) failing on cuda:0, handled as torch's caching allocator handles it: the
    history's "oom" entry, then each observer with (device, alloc, device total, device free), then
    the error. (One line, as the allocator's one call: both see the same Python stack.)"""
    for tell in (gpu.record_oom, *gpu.OBSERVERS): tell(0, nbytes, gpu.TOTAL, gpu.FREE)  # asked here
    raise torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate {nbytes / 2**30:.2f} GiB. GPU 0 has a total capacity of "
        f"{gpu.TOTAL / 2**30:.2f} GiB of which {gpu.FREE / 2**20:.2f} MiB is free.")


def step(i):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if i == gpu.OOM_AT_STEP:
        allocate(gpu.REQUEST)
'''
ASKED_LINE = next(n for n, line in enumerate(TRAINER.splitlines(), 1) if line.endswith("# asked here"))


@functools.cache
def device_state() -> dict:
    """A small allocator state from the real Transformer recording: its 12 lowest segments holding
    memory a user line allocated, and the recorded actions on them (alloc, free, segment_alloc)."""
    d = _SafeUnpickler(io.BytesIO(TRANSFORMER.read_bytes())).load()
    segments = sorted((s for s in d["segments"] if s["device"] == 0 and any(
        b["state"] == "active_allocated" and b["frames"] for b in s["blocks"])), key=lambda s: s["address"])[:12]
    ranges = [(s["address"], s["address"] + s["total_size"]) for s in segments]
    trace = [e for e in d["device_traces"][0]
             if isinstance(e.get("addr"), int) and any(lo <= e["addr"] < hi for lo, hi in ranges)]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": d["allocator_settings"]}


def reserved() -> int:
    return sum(s["total_size"] for s in device_state()["segments"])


def total() -> int:
    return reserved() + FREE + CONTEXT


def gpu_runner(root: Path):
    """Writes the stand-in GPU and the trainer under `root`; returns a function that audits the
    trainer for N steps."""
    fake = root / "fake_gpu"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_GPU)
    (fake / "device_state.pickle").write_bytes(pickle.dumps(device_state(), protocol=4))
    project = root / "project"
    project.mkdir()
    (project / "train.py").write_text(TRAINER)

    def run(steps: int, device_total: int | None = None, oom_at_step: int = OOM_AT_STEP,
            trainer: str = TRAINER) -> Audit:
        (project / "train.py").write_text(trainer)
        (fake / "device.json").write_text(json.dumps({"total": device_total or total(), "free": FREE,
                                                      "request": REQUEST, "oom_at_step": oom_at_step,
                                                      "name": NAME}))
        path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
        a = audit("run", f"{project / 'train.py'}:step", "--steps", str(steps), "--quiet", "--no-numerics",
                  out=root / "out", env={"PYTHONPATH": path})
        assert not (fake / "real_cuda.log").exists(), (fake / "real_cuda.log").read_text()
        a.fake = fake  # type: ignore[attr-defined]
        a.train = project / "train.py"  # type: ignore[attr-defined]
        return a

    return run


@pytest.fixture
def gpu_run(tmp_path: Path):
    return gpu_runner(tmp_path)


@pytest.fixture(scope="module")
def oom_in_the_window(tmp_path_factory) -> Audit:
    """CLEAN_LEAKING_TRAINER (TRAINER's OOM, and a list that keeps only floats) audited for 5 steps:
    the profiled window is steps 0-2, so the history is recorded when step 2 fails. Shared by the
    post-mortem's test and the holder test's clean control (neither writes into the run's files)."""
    return gpu_runner(tmp_path_factory.mktemp("oom-in-the-window"))(5, trainer=CLEAN_LEAKING_TRAINER)


def _history_calls(fake: Path) -> list[dict]:
    return [json.loads(line) for line in (fake / "history_calls.jsonl").read_text().splitlines()]


def test_an_oom_inside_the_profiled_steps_gets_a_post_mortem_from_the_history(oom_in_the_window) -> None:
    """5 steps: the profiled window is steps 0-2, so the history is recorded when step 2 fails.
    (The trainer is TRAINER with a list of floats, the holder test's control: the OOM's line is the same.)"""
    a = oom_in_the_window
    assert a.returncode == 3, a.stderr  # the target failed
    ending = a.evidence["ending"]
    assert (ending["status"], ending["step"], ending["exception"]) == ("oom", OOM_AT_STEP, "OutOfMemoryError")
    # The window switched the history on (Python stacks) and off again when the failed step ended it.
    calls = _history_calls(a.fake)
    assert [c["enabled"] for c in calls] == ["all", None]
    assert calls[0]["stacks"] == "python" and calls[0]["context"] == "all"

    out = a.out
    assert sorted(a.evidence["snapshots"]) == ["memory_snapshot.pickle", "oom_snapshot.pickle"]
    history, oom = load_snapshot(out / "memory_snapshot.pickle"), load_snapshot(out / "oom_snapshot.pickle")
    base = len(device_state()["device_traces"][0])
    for snap in (history, oom):  # the history ends with the OOM in both (the window ended after it)
        assert snap.histories[0].oom_indices == [base]
        entry = snap.device_traces[0][base]
        assert (entry.size, entry.device_free) == (REQUEST, FREE)
        assert (entry.owner.filename, entry.owner.line) == (str(a.train), ASKED_LINE)
    assert oom.oom is not None and history.oom is None  # the observer's record is the OOM snapshot's
    assert (oom.oom.device, oom.oom.requested, oom.oom.device_total, oom.oom.device_free) == (0, REQUEST, total(), FREE)

    # One OOM, one finding, from the OOM snapshot, naming what was asked and where.
    [f] = a.rule("oom-risk")
    e = f["evidence"]
    assert f["severity"] == "error" and "history" in f["title"]
    assert Path(e["snapshot"]).name == "oom_snapshot.pickle" and Path(e["oom_record"]).name == "oom_snapshot.json"
    assert (e["requested"], e["device_free"], e["device_total"], e["oom_index"]) == (REQUEST, FREE, total(), base)
    live = [b for s in device_state()["segments"] for b in s["blocks"] if b["state"] != "inactive"]
    assert (e["allocated"], e["reserved"]) == (sum(b["requested_size"] for b in live), reserved())
    assert (e["requested_at"]["file"], e["requested_at"]["line"]) == (str(a.train), ASKED_LINE)
    assert (f["locations"][0]["file"], f["locations"][0]["line"]) == (str(a.train), ASKED_LINE)
    assert f"a request for 1.0 GiB at train.py:{ASKED_LINE} allocate failed with 600.0 MiB free" in f["message"]
    assert f"of the device's {total() / GiB:.1f} GiB" in f["message"]
    assert "really full" in f["message"]

    # One recording held by both snapshots: its replay and its allocator-churn once each (both were
    # printed twice), from the OOM snapshot, on the capacity the observer's record gives.
    [churn] = a.rule("allocator-churn")
    assert Path(churn["evidence"]["snapshot"]).name == "oom_snapshot.pickle"
    assert (churn["evidence"]["capacity"], churn["evidence"]["capacity_source"]) == (total(), "oom record")
    assert (out / "summary.txt").read_text().count("allocator replay of cuda:0") == 1


def test_an_oom_after_the_profiled_steps_gets_a_post_mortem_from_the_observer(gpu_run) -> None:
    """4 steps: the profiled window is steps 0-1, so no history is recorded when step 2 fails and
    the snapshots hold no "oom" entry: the observer's numbers must carry the post-mortem."""
    a = gpu_run(4)
    assert a.returncode == 3, a.stderr
    assert a.evidence["ending"]["status"] == "oom"
    # every step's end read the device's allocator: its allocated and reserved bytes
    allocated = sum(s["allocated_size"] for s in device_state()["segments"])
    assert [(s["device_allocated"], s["device_reserved"]) for s in a.evidence["steps"]] == [(allocated, reserved())] * 3
    assert [c["enabled"] for c in _history_calls(a.fake)] == ["all", None]

    out = a.out
    assert sorted(a.evidence["snapshots"]) == ["memory_snapshot.pickle", "oom_snapshot.pickle"]
    history, oom = load_snapshot(out / "memory_snapshot.pickle"), load_snapshot(out / "oom_snapshot.pickle")
    assert history.histories[0].oom_indices == [] and oom.histories == {}
    record = json.loads((out / "oom_snapshot.json").read_text())
    assert record["observer_args"] == [0, REQUEST, total(), FREE]
    assert (record["frames"][0]["filename"], record["frames"][0]["line"]) == (str(a.train), ASKED_LINE)

    [f] = a.rule("oom-risk")
    e = f["evidence"]
    assert f["severity"] == "error" and "OOM observer" in f["title"]
    assert Path(e["snapshot"]).name == "oom_snapshot.pickle" and e["source"] == "oom-observer"
    assert (e["requested"], e["device_free"], e["device_total"]) == (REQUEST, FREE, total())
    allocated = sum(s["allocated_size"] for s in device_state()["segments"])
    assert (e["allocated"], e["reserved"]) == (allocated, reserved())
    assert e["capacity_at_least"] == reserved() + FREE
    assert (e["requested_at"]["file"], e["requested_at"]["line"]) == (str(a.train), ASKED_LINE)
    assert f"a request for 1.0 GiB at train.py:{ASKED_LINE} allocate failed with 600.0 MiB free" in f["message"]
    assert f"of the device's {total() / GiB:.1f} GiB" in f["message"]
    assert e["owners"] and e["owners"][0]["file"].endswith(".py")  # the recorded blocks' owning lines


def test_the_run_records_the_devices_memory_and_oom_risk_judges_against_it(gpu_run) -> None:
    """No OOM this time (2 steps; the profiled window, step 0, records the history), on a device
    with only 128 MiB more than the allocator reserves: the child records the device's properties
    in the environment, and oom-risk judges the peak against that total, as a warning, where an
    unknown capacity would be an assumed 16 GB card and no finding at all."""
    device_total = reserved() + 128 * MiB
    a = gpu_run(2, device_total=device_total, oom_at_step=-1)
    assert a.returncode == 0, a.stderr
    assert a.evidence["ending"]["status"] == "completed"
    env = a.evidence["environment"]
    assert env["cuda_available"] is True
    assert env["cuda_devices"] == [{"index": 0, "name": NAME, "total_memory": device_total,
                                    "memory_fraction": 1.0}]
    # the allocator replay runs on that device's capacity, not an assumed 16 GB T4
    assert f"capacity {device_total / (1 << 30):.2f} GiB from the device: {NAME})" in (a.out / "summary.txt").read_text()
    assert a.findings_doc["environment"]["cuda_devices"] == env["cuda_devices"]
    assert [json.loads(line) for line in (a.fake / "properties_calls.jsonl").read_text().splitlines()] == [
        {"device": 0}]  # read once, for the one device (at the end: the program had initialised CUDA)
    assert f"{NAME}, {device_total / (1 << 30):.1f} GiB" in (a.out / "report.html").read_text()

    assert a.evidence["snapshots"] == ["memory_snapshot.pickle"]  # no OOM: no OOM snapshot
    [f] = a.rule("oom-risk")
    e = f["evidence"]
    assert f["severity"] == "warning" and Path(e["snapshot"]).name == "memory_snapshot.pickle"
    assert (e["capacity"], e["capacity_source"], e["capacity_from"]) == (device_total, "device-properties",
                                                                         "environment")
    # every segment of the trimmed state is allocated during the recorded steps: the peak is the end state
    assert e["peak_reserved"] == reserved() and e["share"] == round(reserved() / device_total, 4)
    assert f"({NAME}, as torch.cuda.get_device_properties reported it in the run)" in f["message"]


# ------------------------------------------------------------------------------------------------
# The observer's record and the rule, without a subprocess


def _rule(*snaps) -> list:
    ev = Evidence(source="snapshot", snapshots=[s.path for s in snaps])
    ev.__dict__["snapshot_data"] = list(snaps)
    return list(OomRisk().check(ev, OomRisk.default_options()))


@pytest.fixture
def observed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """attach_oom_observer on a faked device whose allocator holds the trimmed state and records no
    history; returns (snapshot path, a function that fails an allocation of N bytes here)."""
    torch = pytest.importorskip("torch")
    from auditor.capture import cuda_memory

    state = {**device_state(), "device_traces": [[]]}
    observers: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: state)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", observers.append, raising=False)
    path = tmp_path / "oom_snapshot.pickle"
    assert cuda_memory.attach_oom_observer(path) is True and len(observers) == 1

    def fail(nbytes: int, device_total: int = 16 * GiB, free: int = 100 * MiB) -> None:
        observers[0](0, nbytes, device_total, free)  # the allocator's call, from the failing line

    fail.observer = observers[0]  # type: ignore[attr-defined]
    return path, fail


FAIL_LINE = next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                 if line.strip().startswith("observers[0](0, nbytes"))


def test_the_observer_saves_what_it_was_told_beside_the_snapshot(observed) -> None:
    path, fail = observed
    fail(3 * GiB)
    record = json.loads(path.with_suffix(".json").read_text())
    assert record["observer_args"] == [0, 3 * GiB, 16 * GiB, 100 * MiB]
    assert (record["requested"], record["device_total"], record["device_free"]) == (3 * GiB, 16 * GiB, 100 * MiB)
    assert (record["frames"][0]["filename"], record["frames"][0]["line"]) == (__file__, FAIL_LINE)
    snap = load_snapshot(path)
    assert snap.histories == {} and snap.oom is not None
    assert (snap.oom.requested, snap.oom.device_free, snap.oom.device_total) == (3 * GiB, 100 * MiB, 16 * GiB)
    assert (snap.oom.owner.filename, snap.oom.owner.line) == (__file__, FAIL_LINE)
    assert not list(path.parent.glob("*.tmp*"))


def test_an_oom_on_a_thread_that_runs_no_python_still_saves_the_numbers(observed) -> None:
    """Backward-pass allocations come from autograd's C++ threads: the observer is then the only
    Python frame on its thread, and there is no stack to keep, but the numbers are kept."""
    path, fail = observed
    _thread.start_new_thread(fail.observer, (0, 3 * GiB, 16 * GiB, 100 * MiB))
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:  # written last, atomically
        time.sleep(0.01)
    record = json.loads(path.with_suffix(".json").read_text())
    assert record["observer_args"] == [0, 3 * GiB, 16 * GiB, 100 * MiB] and record["frames"] == []
    [f] = _rule(load_snapshot(path))
    assert f.evidence["requested_at"]["file"] is None
    assert "a request for 3.0 GiB failed with 100.0 MiB free on the device" in f.message


def test_a_post_mortem_from_the_observer_when_the_history_has_no_oom_entry(observed) -> None:
    path, fail = observed
    fail(3 * GiB)
    segments = device_state()["segments"]
    allocated = sum(s["allocated_size"] for s in segments)
    [f] = _rule(load_snapshot(path))
    e = f.evidence
    assert f.severity == "error" and e["source"] == "oom-observer" and e["oom_index"] is None
    assert (e["requested"], e["device_free"], e["device_total"]) == (3 * GiB, 100 * MiB, 16 * GiB)
    assert (e["allocated"], e["reserved"], e["reserved_unallocated"]) == (allocated, reserved(), reserved() - allocated)
    assert e["capacity_at_least"] == reserved() + 100 * MiB
    assert (f.locations[0].file, f.locations[0].line) == (__file__, FAIL_LINE)
    assert (f"a request for 3.0 GiB at test_cuda_run_path.py:{FAIL_LINE} fail failed with 100.0 MiB free on the "
            "device") in f.message
    assert "of the device's 16.0 GiB" in f.message and "really full" in f.message
    # A history that ends before the OOM (recording stopped with the profiled window) changes nothing.
    path.write_bytes(pickle.dumps(device_state(), protocol=4))
    snap = load_snapshot(path)
    assert snap.histories[0].oom_indices == [] and snap.oom is not None
    [g] = _rule(snap)
    assert g.evidence["source"] == "oom-observer" and g.message == f.message
    # Without the record the same snapshot is state only: no OOM to report, and far from 16 GiB.
    path.with_suffix(".json").unlink()
    assert load_snapshot(path).oom is None and _rule(load_snapshot(path)) == []


def test_a_request_larger_than_the_device_is_said_to_be(observed) -> None:
    path, fail = observed
    fail(20 * GiB)
    [f] = _rule(load_snapshot(path))
    assert "larger than the whole device (16.0 GiB)" in f.message


def test_a_json_beside_a_snapshot_that_is_not_the_observers_is_left_alone(observed) -> None:
    path, fail = observed
    fail(3 * GiB)
    side = path.with_suffix(".json")
    side.write_text(json.dumps({"kind": "something-else", "device": 0, "requested": 1, "device_free": 1}))
    assert load_snapshot(path).oom is None
    side.write_text("{not json")
    snap = load_snapshot(path)
    assert snap.oom is None and "unreadable OOM observer record oom_snapshot.json" in snap.notes


def test_one_oom_held_by_two_snapshots_is_one_finding(tmp_path: Path, observed) -> None:
    """The OOM snapshot and the window's history snapshot dumped after it both end with the OOM."""
    path, fail = observed
    fail(REQUEST, device_total=2 * GiB, free=FREE)
    oom = {"action": "oom", "device_free": FREE, "size": REQUEST, "stream": 0, "time_us": 1, "frames": []}
    d = {**device_state(), "device_traces": [device_state()["device_traces"][0] + [oom]]}
    path.write_bytes(pickle.dumps(d, protocol=4))
    history = tmp_path / "memory_snapshot.pickle"
    history.write_bytes(pickle.dumps(d, protocol=4))
    [f] = _rule(load_snapshot(history), load_snapshot(path))
    assert f.evidence["snapshot"] == str(path) and f.evidence["source"] == "history"
    assert f.evidence["device_total"] == 2 * GiB and "of the device's 2.0 GiB" in f.message
    # the request's line: the history entry has no stack here, the observer's record does
    assert (f.locations[0].file, f.locations[0].line) == (__file__, FAIL_LINE)


# The leak the seeds describe ("OOM on the second batch"): each step's output, with its graph, kept
# in a module-level list (1 MiB a step: 4096 x 64 float32).
LEAKING_TRAINER = TRAINER.replace("torch.nn.Linear(16, 4)", "torch.nn.Linear(16, 64)").replace(
    "torch.randn(64, 16), torch.randn(64, 4)", "torch.randn(4096, 16), torch.randn(4096, 64)").replace(
    "def step(i):\n    loss = torch.nn.functional.mse_loss(model(x), y)",
    "preds = []\n\n\ndef step(i):\n    out = model(x)\n    preds.append(out)  # kept\n"
    "    loss = torch.nn.functional.mse_loss(out, y)")
CLEAN_LEAKING_TRAINER = LEAKING_TRAINER.replace("preds.append(out)", "preds.append(out.detach().sum().item())")
assert ASKED_LINE == next(n for n, line in enumerate(CLEAN_LEAKING_TRAINER.splitlines(), 1)
                       if line.endswith("# asked here"))


def test_an_oom_names_what_keeps_the_live_memory_alive(gpu_run, oom_in_the_window) -> None:
    """The OOM's finding names the holder the graph scans found after the failed step (the list,
    the line that fills it, its bytes and growth), and that line is its first location."""
    assert "preds.append(out)  # kept" in LEAKING_TRAINER
    a = gpu_run(5, trainer=LEAKING_TRAINER)
    assert a.returncode == 3, a.stderr
    fill = next(n for n, line in enumerate(LEAKING_TRAINER.splitlines(), 1) if line.endswith("# kept"))
    [f] = a.rule("oom-risk")
    assert Path(f["evidence"]["snapshot"]).name == "oom_snapshot.pickle"
    assert (f"What keeps the live memory alive: `preds` (list, filled at train.py:{fill}) holds 3.0 MiB in 3 "
            "tensors after step 2, 1.0 MiB more per step since step 0.") in f["message"], f["message"]
    assert (f["locations"][0]["file"], f["locations"][0]["line"]) == (str(a.train), fill)
    assert f"a request for 1.0 GiB at train.py:{ASKED_LINE}" in f["message"]
    h = f["evidence"]["holder"]
    assert (h["name"], h["bytes"], h["tensors"], h["after_step"]) == ("preds", 3 * MiB, 3, OOM_AT_STEP)

    clean = oom_in_the_window  # the same trainer keeping floats, not tensors
    assert clean.returncode == 3, clean.stderr
    [f] = clean.rule("oom-risk")
    assert "What keeps the live memory alive" not in f["message"] and "holder" not in f["evidence"]
