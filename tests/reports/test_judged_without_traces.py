"""`audit analyze TRACE` of a trace recorded without shapes (record_shapes=False) or stacks
(with_stack=False): the trace says so itself (its header, else its events), and the summary, the
report's Rules section and findings.json's `judged_without` name the rules judged without them, as
`audit run` does for a window that dropped them; a trace recorded with both gets no note.

The traces are recorded here, in this process, with torch.profiler on the CPU (a few milliseconds
each), as a user records one; the recordings and the reports are made in-process."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from auditor.evidence.load import load_paths
from auditor.evidence.trace.load import load_trace
from auditor.evidence.trace.recorded import recorded_without
from auditor.reports.findings_json import FindingsJson
from auditor.reports.html import HtmlReport
from auditor.reports.terminal import summary_lines
from auditor.rules.engine import run_rules
from conftest import FIXTURES

BOTH = ("record_shapes", "with_stack")
# the rules whose `reads` name each option (auditor/rules: amp-opportunity, cudnn-benchmark and
# manual-update read shapes; blocking-pinned-copy and gpu-idle stacks; unfused-attention both)
SHAPE_RULES = {"amp-opportunity", "cudnn-benchmark", "manual-update", "unfused-attention"}
STACK_RULES = {"blocking-pinned-copy", "gpu-idle", "unfused-attention"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[tuple[bool, bool], Path]:
    """{(record_shapes, with_stack): the trace} of three SGD steps of a small MLP, each way."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    d = tmp_path_factory.mktemp("recorded")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for shapes in (True, False):
        for stack in (True, False):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes, with_stack=stack) as prof:
                for _ in range(3):
                    opt.zero_grad()
                    model(torch.randn(8, 16)).square().mean().backward()
                    opt.step()
            path = out[shapes, stack] = d / f"shapes{int(shapes)}_stack{int(stack)}.pt.trace.json"
            prof.export_chrome_trace(str(path))
    return out


def _expected(shapes: bool, stack: bool) -> tuple[str, ...]:
    return tuple(o for o, on in zip(BOTH, (shapes, stack)) if not on)


@pytest.mark.parametrize("shapes,stack", [(True, True), (False, True), (True, False), (False, False)])
def test_the_trace_says_what_it_was_recorded_without_in_its_header_and_its_events(recorded, tmp_path, shapes, stack):
    path = recorded[shapes, stack]
    assert recorded_without(load_trace(path)) == _expected(shapes, stack)
    # without the header's keys (a torch that writes none), its events say the same: operators'
    # `Input Dims` with shapes, python_function events with stacks
    raw = path.read_text()
    doc = json.loads(raw)
    assert ('"Input Dims"' in raw) is shapes and ('"cat": "python_function"' in raw) is stack
    bare = tmp_path / "bare.pt.trace.json"
    bare.write_text(json.dumps({k: v for k, v in doc.items() if k not in BOTH}))
    assert recorded_without(load_trace(bare)) == _expected(shapes, stack)


def test_a_recorded_fixture_without_header_keys_is_read_from_its_events():
    """An A100 trace of an older torch (no header keys, no `Input Dims`, no Python events) lacks
    both (the V100 trace of torch ~1.9, old schema, lacks neither: test_analyze_cli)."""
    small = load_trace(FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz")
    assert not set(BOTH) & set(small.metadata) and recorded_without(small) == BOTH


def _reports(path: Path, tmp_path: Path) -> tuple[list[str], list[dict], str]:
    ev = load_paths([path])
    results = run_rules(ev)
    lines = [ln.plain for ln in summary_lines(ev, results, None)]
    doc = msgspec.json.decode(FindingsJson().render(ev, results, tmp_path))
    page = HtmlReport().render(ev, results, tmp_path)
    assert not results.errors
    return lines, doc["judged_without"], page


@pytest.mark.parametrize("shapes,stack", [(False, True), (True, False), (False, False)])
def test_analyze_names_the_rules_judged_without_what_the_trace_lacks(recorded, tmp_path, shapes, stack):
    path = recorded[shapes, stack]
    lines, judged, page = _reports(path, tmp_path)
    lacking = _expected(shapes, stack)
    # every rule that reads what is missing ran on this CPU trace but cudnn-benchmark (a GPU's)
    want = {r: [o for o in lacking if r in (SHAPE_RULES if o == "record_shapes" else STACK_RULES)]
            for r in SHAPE_RULES | STACK_RULES if r != "cudnn-benchmark"}
    assert judged == [{"rule": r, "without": w} for r, w in sorted(want.items()) if w]
    what = " or ".join({"record_shapes": "shapes (record_shapes)", "with_stack": "stacks (with_stack)"}[o]
                       for o in lacking)
    [line] = [ln for ln in lines if ln.startswith("profiler trace ")]
    named = ", ".join(f"{j['rule']} (without {' or '.join(o.split('_')[-1] for o in j['without'])})" for j in judged)
    assert line == (f"profiler trace {path.name} was recorded without {what} (torch.profiler.profile("
                    f"{', '.join(f'{o}=True' for o in lacking)}) records {'them' if len(lacking) > 1 else 'it'}); "
                    f"judged without them, and may find less: {named}")
    assert "<h3>Judged without what the trace did not record</h3>" in page
    for j in judged:
        assert (f"<tr><th><code>{j['rule']}</code></th>\n    <td>its trace recorded without "
                f"{' or '.join(j['without'])}: it may find less</td></tr>") in page


def test_a_trace_with_shapes_and_stacks_gets_no_note(recorded, tmp_path):
    lines, judged, page = _reports(recorded[True, True], tmp_path)
    assert judged == []
    assert not [ln for ln in lines if "recorded without" in ln]
    assert "Judged without" not in page


def test_many_traces_lacking_the_same_are_named_in_one_short_line(recorded, tmp_path):
    """A directory of many traces: those that lack the same are named together, the first three,
    the others counted (a directory of 2,000 would otherwise name them all in one line)."""
    d = tmp_path / "traces"
    d.mkdir()
    names = [f"rank{i}.pt.trace.json" for i in range(5)]
    for name in names:
        (d / name).write_bytes(recorded[False, True].read_bytes())
    (d / "full.pt.trace.json").write_bytes(recorded[True, True].read_bytes())
    (d / "nostack.pt.trace.json").write_bytes(recorded[True, False].read_bytes())
    lines, judged, _ = _reports(d, tmp_path)
    [line] = [ln for ln in lines if ln.startswith("profiler traces ")]
    assert line.startswith("profiler traces were recorded without what some rules read: "
                           "nostack.pt.trace.json without stacks (with_stack); rank0.pt.trace.json, rank1.pt.trace.json, "
                           "rank2.pt.trace.json and 2 more without shapes (record_shapes) "
                           "(torch.profiler.profile(record_shapes=True, with_stack=True) records them); "
                           "judged without them, and may find less: "), line
    assert "full.pt.trace.json" not in line and "rank3" not in line
    assert {"rule": "unfused-attention", "without": ["record_shapes", "with_stack"]} in judged
