"""Which line a trace finding names when the training loop runs in the frame that started the
profiler. Kineto's Python tracer names a frame already running when it starts by the line it was
on at that moment (`with profile(...)`, `prof.step()`), and keeps that name for the frame's whole
life: a DataLoader wait in the next steps was named at the profiler's own line. The traces are
recorded with torch.profiler (with_stack=True) by tests/data/recorded_trainer.py, in the ways users
write it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import RECORDED_TRAINER, Recording, audit

TRAINER = RECORDED_TRAINER.read_text()  # recorded as train.py by the session's `recording`


@pytest.fixture
def recorded(recording: Recording) -> Path:
    """The folder the trainer ran in: train.py and its traces."""
    return recording.root


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(TRAINER.splitlines(), 1) if line.strip().startswith(text))


def loader_finding(root: Path, trace: Path, name: str) -> dict:
    a = audit("analyze", str(trace), "--source-root", str(root), out=root / f"out-{name}", cwd=root)
    assert a.returncode == 0, a.stderr
    [f] = a.rule("dataloader-bound")
    return f


def raw_loader_ms_per_step(trace: Path) -> float:
    """DataLoader __next__ ms per ProfilerStep (or in the span of its events, the profiler's own
    `Trace` span left out, as one step), from the JSON."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "Trace"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        steps = [(min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))]
    loads = [(e["ts"], e["ts"] + e["dur"]) for e in events
             if e["name"].startswith("enumerate(DataLoader)") and e["name"].endswith("__next__")]
    inside = sum(max(0.0, min(b, hi) - max(a, lo)) for lo, hi in steps for a, b in loads)
    return inside / len(steps) / 1e3


def test_a_loop_inside_with_profile_is_placed_in_its_function(recorded: Path) -> None:
    """main() holds the `with profile()`: its frame was recorded at that line, and the batches it
    loads afterwards were placed there. The finding names main() (its def line), as for any
    function the trace records."""
    trace = recorded / "in_function.json"
    f = loader_finding(recorded, trace, "in_function")
    [loc] = f["locations"]
    assert (loc["file"], loc["line"]) == ("train.py", line_of("def main():"))
    assert (loc["code"], loc["note"]) == ("def main():", "the trace records this function, not the line within it")
    assert f["evidence"]["loader_ms_per_step"] == pytest.approx(raw_loader_ms_per_step(trace), rel=1e-3)


def test_a_scheduled_profiler_is_not_placed_at_prof_step(recorded: Path) -> None:
    """With a schedule, the profiler starts inside `prof.step()`: every later step was placed at that line."""
    [trace] = (recorded / "tb").glob("*.pt.trace.json")
    f = loader_finding(recorded, trace, "scheduled")
    [loc] = f["locations"]
    assert (loc["file"], loc["line"]) == ("train.py", line_of("def scheduled():"))
    assert f["evidence"]["loader_ms_per_step"] == pytest.approx(raw_loader_ms_per_step(trace), rel=1e-3)
    assert len(f["evidence"]["steps"]) == 3


def test_module_code_keeps_the_with_line_and_says_what_it_is(recorded: Path) -> None:
    """Module-level code has no def line: the `with` line stays, marked as the profiler's start."""
    f = loader_finding(recorded, recorded / "module.json", "module")
    [loc] = f["locations"]
    assert (loc["file"], loc["line"]) == ("train.py", TRAINER.splitlines().index(
        "with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:") + 1)
    assert loc["code"] == "with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:"
    assert loc["note"] == ("the line <module> was on when the profiler started: the trace does not record the "
                           "line within it")


NOTE_STARTED = "the line main was on when the profiler started: the trace does not record the line within it"


def test_without_the_source_the_recorded_line_is_marked(recorded: Path, tmp_path: Path) -> None:
    """Analysed where the trainer's file is not (another machine): main()'s def line cannot be
    found, so the recorded line stays, marked as where the profiler started. The mark is a note of
    its own, not the line's code: the page showed '21 # (the line main was on ...)' in the source
    block, as if it were line 21 of train.py."""
    f = loader_finding(tmp_path, recorded / "in_function.json", "elsewhere")
    [loc] = f["locations"]
    with_line = next(i for i, line in enumerate(TRAINER.splitlines(), 1) if "with profile(" in line)
    assert (loc["file"], loc["line"]) == ("train.py", with_line)
    assert (loc["code"], loc["note"]) == ("", NOTE_STARTED)

    page = (tmp_path / "out-elsewhere" / "report.html").read_text()
    article = page[page.index('<article class="finding"'):page.index("</article>")]
    assert f'<div class="path">train.py:{with_line}</div>' in article
    assert f'<p class="loc-note">{NOTE_STARTED} (its source is not on this disk, or not under a source root)</p>' in article
    assert "<pre>" not in article.split('<details')[0]  # no source block: there is no source to show
    sarif = json.loads((tmp_path / "out-elsewhere" / "findings.sarif").read_text())
    [result] = [r for r in sarif["runs"][0]["results"] if r["ruleId"] == "dataloader-bound"]
    [where] = result["locations"]
    assert where["message"]["text"] == NOTE_STARTED and "snippet" not in where["physicalLocation"]["region"]


def test_with_the_source_the_note_sits_beside_the_source_lines(recorded: Path) -> None:
    """The def line's note, with the source here: the page shows train.py's own lines around it
    and the note apart (it was only in findings.json's code, and not on the page at all)."""
    f = loader_finding(recorded, recorded / "in_function.json", "in_function_page")
    page = (recorded / "out-in_function_page" / "report.html").read_text()
    article = page[page.index('<article class="finding"'):page.index("</article>")]
    pre = article[article.index("<pre>"):article.index("</pre>")]
    assert f'<span class="no">{line_of("def main():"):5d}</span> def main():</span>' in pre
    assert "trace records" not in pre
    assert '<p class="loc-note">the trace records this function, not the line within it</p>' in article


def test_a_function_called_under_the_profiler_keeps_its_own_line(recorded: Path) -> None:
    """The clean case: train() is called after the profiler started, so its frame is named by its
    def line, as before; clean(), which holds the `with`, is not named."""
    f = loader_finding(recorded, recorded / "called.json", "called")
    [loc] = f["locations"]
    assert (loc["file"], loc["line"]) == ("train.py", line_of("def train(n):"))
