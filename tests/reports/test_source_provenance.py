"""Source provenance: a run records the sha256 and the quoted lines of each source file it quotes;
`audit report DIR` after the file was edited quotes the recorded lines and says the file changed
(it used to re-read the edited file: the highlighted lines pointed at other code, with no word)."""
from __future__ import annotations

import hashlib
import html
import json
import shutil

from auditor.evidence.model import decode
from conftest import EXAMPLES, audit


def test_a_changed_source_is_quoted_as_the_run_read_it(tmp_path):
    for f in ("host_sync.py", "_common.py"):
        shutil.copy(EXAMPLES / f, tmp_path / f)
    src = tmp_path / "host_sync.py"
    original = src.read_text()
    line = original.splitlines().index("    history.append(loss.item())  # expect: host-sync") + 1
    a = audit("run", "host_sync.py:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stderr
    recorded = a.evidence["sources"][str(src)]
    assert recorded["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert recorded["lines"][str(line)] == original.splitlines()[line - 1]
    [f] = a.rule("host-sync")
    assert (f["locations"][0]["line"], f["locations"][0]["code"]) == (line, original.splitlines()[line - 1].strip())

    src.write_text("# one\n# two\n# three\n" + original)  # every line moves down by 3
    r = audit("report", str(a.out), out=a.out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"note: {src} changed since the run" in r.stdout
    assert f"  line {line}: at the run: history.append(loss.item())  # expect: host-sync" in r.stdout
    [g] = json.loads((a.out / "findings.json").read_text())["findings"]
    assert g["locations"][0] == f["locations"][0]  # the recorded line, not the edited file's line 19
    page = html.unescape((a.out / "report.html").read_text())
    assert "This file changed since the run" in page and f"{src} changed since the run" in page
    assert "history.append(loss.item())  # expect: host-sync</span>" in page
    # the recorded sources stay as the run read them: another render still compares with them
    assert json.loads((a.out / "evidence.json").read_text())["sources"][str(src)]["sha256"] == recorded["sha256"]


def test_evidence_without_sources_still_loads():
    ev = decode(json.dumps({"version": 2, "source": "run"}).encode())
    assert ev.sources == {}
