"""A directory of many recordings: the terminal and report.html stay the same size however many
there are (a rule's findings past 5 in one line; the page shows each rule's 5 costliest and links
50 traces), while findings.json keeps each. A 2,000-trace directory gave 8,004 terminal lines and a
72 MB page. The recordings' findings are those of a real trace, analysed once, then repeated as
the findings of 20 and of 200 recordings (analysing 200 traces would take minutes of the suite)."""
from __future__ import annotations

import shutil
from pathlib import Path

import msgspec

from auditor.evidence.load import load_paths
from auditor.findings import RuleResults
from auditor.reports.findings_json import FindingsJson
from auditor.reports.html import HtmlReport
from auditor.reports.terminal import summary_lines
from auditor.rules.engine import run_rules
from conftest import FIXTURES

TRACE = FIXTURES / "traces" / "a100_item_sync_small.pt.trace.json.gz"


def _as_recordings(tmp_path: Path, n: int, ev, results: RuleResults):
    """`ev` as if it held `n` recordings, each with the findings of the one it holds."""
    traces = [tmp_path / f"node{i // 8}_rank{i}.pt.trace.json.gz" for i in range(n)]
    ev.__dict__["trace_data"] = [ev.trace_data[0]] * n
    ev.traces = [str(p) for p in traces]
    findings = [msgspec.structs.replace(f, evidence={**f.evidence, "trace": str(p)})
                for p in traces for f in results.findings]
    return ev, RuleResults(findings=findings, skipped=results.skipped)


def test_the_terminal_and_the_page_do_not_grow_with_the_recordings(tmp_path: Path) -> None:
    d = tmp_path / "traces"
    d.mkdir()
    for i in range(2):  # (two recordings: a directory's, not one trace's, summary)
        shutil.copy(TRACE, d / f"t{i}.pt.trace.json.gz")
    ev = load_paths([d])
    results = run_rules(ev)
    per_trace = len(results.findings) // 2
    assert per_trace >= 4  # (gpu-idle and host-sync's three)
    results = RuleResults(findings=results.findings[::2], skipped=results.skipped)
    sizes = {}
    for n in (20, 200):
        ev_n, results_n = _as_recordings(tmp_path, n, ev, results)
        lines = [ln.plain for ln in summary_lines(ev_n, results_n, None)]
        page = HtmlReport().render(ev_n, results_n, tmp_path)
        doc = FindingsJson().render(ev_n, results_n, tmp_path)
        sizes[n] = (len(lines), len(page.encode()), len(doc))
        assert any(f"host-sync {3 * n:,} findings in all {n:,} recordings" in ln for ln in lines), lines
        assert len(page.encode()) < 5_000_000
        assert len(msgspec.json.decode(doc)["findings"]) == per_trace * n  # (every finding kept there)
    (lines20, page20, doc20), (lines200, page200, doc200) = sizes[20], sizes[200]
    assert lines200 == lines20 <= 10  # one line per rule, however many recordings
    assert page200 - page20 < 20_000, (page20, page200)  # (10x the recordings: 30 more trace links, then none)
    assert doc200 > 9 * doc20  # (findings.json grows with them: per-rank detail stays there)
