"""report.html of recorded traces analysed on their own (`audit analyze trace.json`): the page said
"No step data to plot." of a trace with ProfilerSteps, its cards "N steps run" (nothing ran here),
"- RSS / no device allocator numbers" and a Device card of a bare "torch" (this machine's torch is
not the recording's, and the trace did not say which). The traces are a CPU trace recorded here
with torch.profiler and the recorded GPU fixtures; expected numbers come from the raw JSON."""
from __future__ import annotations

import gzip
import html
import json
import re
from pathlib import Path

import pytest

from conftest import FIXTURES, Recording, audit

from auditor.evidence.snapshot import format_bytes

TRACES = FIXTURES / "traces"
V100 = TRACES / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"
H100 = TRACES / "h100_bert_small_item_sync.pt.trace.json.gz"

def card(page: str, label: str) -> tuple[str, str]:
    """(value, sub) of the verdict card with this label, as text."""
    m = re.search(rf'<div class="label">{label}</div>\s*<div class="value">(.*?)</div>.*?<div class="sub">(.*?)</div>',
                  page, re.S)
    assert m, f"no card {label}"
    return tuple(html.unescape(re.sub(r"<[^>]+>|\{#.*?#\}", "", g)).strip() for g in m.groups())  # type: ignore[return-value]


def plots(page: str) -> list[dict]:
    data = re.search(r'<script type="application/json" id="auditor-data">(.*?)</script>', page, re.S).group(1)
    return [p["figure"] for p in json.loads(data)["plots"]]


def raw_steps(events: list[dict]) -> list[tuple[int, float]]:
    """(ProfilerStep number, ms) of the CPU-side ProfilerSteps, in time order."""
    steps = sorted((e["ts"], int(e["name"].split("#")[1]), e["dur"]) for e in events
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
                   and e.get("cat") in ("user_annotation", "cpu_op", "Operator"))
    return [(n, d / 1000) for _, n, d in steps]


@pytest.fixture
def cpu_trace(recording: Recording) -> Path:
    """The trainer's 4 ProfilerSteps under a schedule (6 iterations, 1 warmup), no memory events."""
    return recording.root / "steps.json"


def test_a_traces_profiler_steps_are_plotted_and_the_cards_speak_of_a_recording(cpu_trace: Path) -> None:
    """A CPU trace of 4 ProfilerSteps and no memory events: it had no plot at all."""
    events = json.loads(cpu_trace.read_text())["traceEvents"]
    steps = raw_steps(events)
    assert len(steps) == 4 and not any(e.get("name") == "[memory]" for e in events)
    out = cpu_trace.parent / "out"
    a = audit("analyze", str(cpu_trace), out=out)
    assert a.returncode == 0, a.stderr
    page = (out / "report.html").read_text()
    assert "No step data to plot" not in page
    [fig] = [f for f in plots(page) if f["layout"]["title"]["text"] == "Step time in steps.json (ms)"]
    [line] = [t for t in fig["data"] if t.get("mode") == "lines+markers"]
    assert line["x"] == [n for n, _ in steps]
    assert line["y"] == pytest.approx([ms for _, ms in steps], abs=1e-3)
    assert card(page, "Median step")[1].startswith("4 ProfilerSteps recorded; p10-p90 ")
    assert card(page, "Peak memory") == ("-", "not recorded: the trace has no memory events (profile_memory=True "
                                                "records them)")
    assert card(page, "Device") == ("cpu", "")  # (the trace names neither a GPU nor torch's version)
    assert "torch" not in card(page, "Device")[1]


def test_a_gpu_recording_names_its_gpus_and_what_its_memory_events_say(tmp_path: Path) -> None:
    """The V100 trace (torch 1.9, 4 GPUs listed, no torch version in it; its memory events carry
    each allocation's size, not the total)."""
    doc = json.loads(gzip.decompress(V100.read_bytes()))
    names = [p["name"] for p in doc["deviceProperties"]]
    assert names == ["Tesla V100-DGXS-32GB"] * 4
    gpu = [e["args"]["Bytes"] for e in doc["traceEvents"] if e.get("name") == "[memory]"
           and e["args"].get("Device Type") == 1]
    running, peak = 0, 0
    for b in gpu:
        running += b
        peak = max(peak, running)
    a = audit("analyze", str(V100), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    assert card(page, "Median step")[1].startswith(f"{len(raw_steps(doc['traceEvents']))} ProfilerSteps recorded; p10-p90 ")
    assert card(page, "Device") == ("cuda", "Tesla V100-DGXS-32GB x4")
    value, sub = card(page, "Peak memory")
    assert value == f"+{format_bytes(peak)}" and sub.startswith("GPU allocated at its peak, over what it held")
    [fig] = [f for f in plots(page) if f["layout"]["title"]["text"].startswith("Step time in ")]
    assert fig["data"][0]["y"] == pytest.approx([ms for _, ms in raw_steps(doc["traceEvents"])], abs=1e-3)


def test_the_torch_version_a_trace_states_is_shown(tmp_path: Path) -> None:
    """The H100 trace's harness stored torch's version in its metadata
    (metadata.system.torch_env_info.torch_version); its memory events carry the total allocated."""
    doc = json.loads(gzip.decompress(H100.read_bytes()))
    version = doc["metadata"]["system"]["torch_env_info"]["torch_version"]
    [name] = [p["name"] for p in doc["deviceProperties"]]
    peak = max(e["args"]["Total Allocated"] for e in doc["traceEvents"] if e.get("name") == "[memory]"
               and e["args"].get("Device Type") == 1)
    a = audit("analyze", str(H100), out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    page = (tmp_path / "out" / "report.html").read_text()
    assert card(page, "Device") == ("cuda", f"{name}; torch {version}")
    assert card(page, "Peak memory") == (format_bytes(peak), "GPU allocated at its peak, from the trace's memory events")
    assert card(page, "Median step")[1] == "1 ProfilerStep recorded"  # (one step: no spread)
    assert a.findings_doc["environment"]["torch_version"] == version
