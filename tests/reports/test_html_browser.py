"""report.html opened in a real headless Chromium, the way a person opens it: from a file, offline.

One report comes from a real `audit run` of an example trainer, one from the shared reporter
fixture (50 steps, every kind of finding), one from the same fixture with hostile strings in every
user-supplied field. Each page must load with no console error, no page error and no request other
than file:// (every other URL is aborted and fails the test); every plot must draw SVG or canvas;
findings and the patched-config block must be visible. The hostile page must fire no dialog, create
no element from the input, and show the strings literally.

Chromium is Debian's (`apt-get install chromium`), driven by Python Playwright; Playwright's own
browser download is never used.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from auditor.reports.html import HtmlReport
from test_reporters import HOSTILE, make_case

from conftest import FIXTURES, ROOT

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
CHROMIUM = os.environ.get("AUDITOR_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set AUDITOR_CHROMIUM)",
                allow_module_level=True)

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = ROOT
EXAMPLE = "examples/host_sync.py:step"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


class Page:
    """A page with everything that must not happen recorded: errors, dialogs, network requests."""

    def __init__(self, browser: object, report: Path, width: int = 1280) -> None:
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": width, "height": 900})  # type: ignore[attr-defined]
        self.page.on("console", lambda m: self.errors.append(f"console {m.type}: {m.text}")
                     if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("dialog", self._dialog)
        self.page.route("**/*", self._route)
        self.page.goto(report.as_uri(), wait_until="load")
        try:
            self.page.wait_for_function("() => [...document.querySelectorAll('.plot')]"
                                        ".every(d => d.querySelector('.main-svg, canvas'))", timeout=10000)
        except playwright_api.TimeoutError:
            self.errors.append("plots were not drawn within 10 s")

    def _dialog(self, dialog: object) -> None:
        self.dialogs.append(dialog.message)  # type: ignore[attr-defined]
        dialog.dismiss()  # type: ignore[attr-defined]

    def _route(self, route: object) -> None:
        url = route.request.url  # type: ignore[attr-defined]
        if url.startswith(("file:", "data:", "blob:")):
            route.continue_()  # type: ignore[attr-defined]
        else:
            self.requests.append(url)
            route.abort()  # type: ignore[attr-defined]

    def assert_clean(self) -> None:
        assert not self.errors, self.errors
        assert not self.requests, f"the report made network requests: {self.requests}"
        assert not self.dialogs, f"dialogs fired: {self.dialogs}"

    def assert_plots_drawn(self, at_least: int) -> None:
        ids = self.page.eval_on_selector_all(".plot", "els => els.map(e => e.id)")
        assert len(ids) >= at_least, ids
        for plot_id in ids:
            drawn = self.page.eval_on_selector(
                f"#{plot_id}", "e => e.querySelectorAll('svg.main-svg, canvas').length > 0 && "
                               "e.querySelectorAll('.trace, .bars, .scatterlayer .trace').length > 0")
            assert drawn, f"plot {plot_id} has no drawn traces"

    def close(self) -> None:
        self.page.close()


@pytest.fixture(scope="module", autouse=True)
def audit_in_background(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A real 10-step audit of an example trainer, started first so it runs while the other pages load."""
    out = tmp_path_factory.mktemp("audit") / "run"
    proc = subprocess.Popen([sys.executable, "-m", "auditor", "run", EXAMPLE, "--steps", "10", "--out", str(out), "-q"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.fixture
def audited_report(audit_in_background: tuple[subprocess.Popen, Path]) -> Path:
    proc, out = audit_in_background
    _, stderr = proc.communicate(timeout=180)
    assert (out / "report.html").is_file(), f"audit run wrote no report (exit {proc.returncode}):\n{stderr}"
    return out / "report.html"


def test_fixture_report_shows_findings_and_config(browser: object, tmp_path: Path) -> None:
    case = make_case(tmp_path)
    report = HtmlReport().write(case.evidence, case.results, case.out_dir)
    page = Page(browser, report)
    try:
        page.assert_clean()
        page.assert_plots_drawn(at_least=3)
        p = page.page
        for i, f in enumerate(case.results.findings, start=1):
            card = p.locator(f"#finding-{i}")
            assert card.is_visible() and f.rule in card.inner_text()
        config = p.locator("#config pre.config")
        assert config.count() == 3 and config.first.is_visible()
        text = p.locator("#config").inner_text()
        assert "export OMP_NUM_THREADS=4" in text and "num_workers=4," in text
        assert "torch.autograd.set_detect_anomaly = False" in text
        # the source context of a finding is the user's real line, highlighted
        n = [f.rule for f in case.results.findings].index("host-sync") + 1
        assert "loss.item()" in p.locator(f"#finding-{n} .source .hit").first.inner_text()
        assert p.locator(f"#finding-{n} .source pre span.ln").count() >= 4  # with lines around it
        # a trace link resolves to the file next to the report
        href = p.locator("#traces a[href$='.json'], #traces a[href$='.json.gz']").first.get_attribute("href")
        assert href and (report.parent / href).is_file()
        p.screenshot(path=str(tmp_path / "fixture.png"))
    finally:
        page.close()


def test_hostile_strings_stay_text(browser: object, tmp_path: Path) -> None:
    hostile = "".join(HOSTILE)
    case = make_case(tmp_path, hostile=hostile)
    report = HtmlReport().write(case.evidence, case.results, case.out_dir)
    page = Page(browser, report)
    try:
        page.assert_clean()
        p = page.page
        assert p.locator("img").count() == 0, "an <img> was created from user data"
        assert p.locator("script").count() == 3, "a <script> was created from user data"
        body = p.locator("body").inner_text()
        for s in ("<script>alert(1)</script>", "\"'><img src=x onerror=alert(1)>", "[red]x[/]"):
            assert s in body, f"{s!r} is not shown literally"
        # the embedded findings.json survives intact, U+2028 included
        message = p.evaluate("() => window.auditorReport.findings.findings.find(f => f.rule === 'host-sync').message")
        assert message.endswith(hostile)
        page.assert_plots_drawn(at_least=3)  # op names and paths in plot data do not break plotting
    finally:
        page.close()


def test_audited_report_renders_offline(browser: object, audited_report: Path, tmp_path: Path) -> None:
    page = Page(browser, audited_report)
    try:
        page.assert_clean()
        page.assert_plots_drawn(at_least=3)  # phases, step time, memory: a real run has all three
        assert page.page.locator("#finding-1").is_visible()
        assert page.page.locator("#verdict .card").count() >= 4
        assert page.page.locator("#traces a[href$='.json'], #traces a[href$='.json.gz']").count() >= 1, \
            "no link to the profiler trace"
        page.page.screenshot(path=str(tmp_path / "audited.png"), full_page=True)
        assert (tmp_path / "audited.png").stat().st_size > 10_000
    finally:
        page.close()


# Axis tick labels of one axis whose boxes overlap by more than this many pixels are unreadable.
OVERLAP_PX = 1.0
OVERLAPS = """els => {
  const boxes = els.map(e => e.getBoundingClientRect()).filter(r => r.width > 0);
  const out = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i], b = boxes[j];
    const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
    const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    if (w > %s && h > %s) out.push([els[i].textContent, els[j].textContent]);
  }
  return out;
}""" % (OVERLAP_PX, OVERLAP_PX)


@pytest.fixture(scope="module")
def docs_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of the README's audit (tests/fixtures/docs), rendered by today's code: a patch line of
    150 characters, evidence tables of every kind, settings that are not Python."""
    run = tmp_path_factory.mktemp("docs") / "run"
    shutil.copytree(FIXTURES / "docs" / "audited_train_script", run)
    subprocess.run([sys.executable, "-m", "auditor", "report", str(run), "--source-root", str(REPO)],
                   cwd=REPO, check=True, capture_output=True, timeout=180)
    return run / "report.html"


@pytest.mark.parametrize("width", [1400, 800])
@pytest.mark.parametrize("which", ["audited", "docs"])
def test_the_audited_report_fits_its_width_and_its_labels_do_not_overlap(browser: object, request: pytest.FixtureRequest,
                                                                        tmp_path: Path, width: int, which: str) -> None:
    """At 1400 and at 800 px: nothing wider than the window (no horizontal scroll: long patch lines
    wrap inside their cards, tables fit), and no two tick labels of one axis overlap in any plot.
    Screenshots kept."""
    report = request.getfixturevalue("audited_report" if which == "audited" else "docs_report")
    page = Page(browser, report, width=width)
    try:
        page.assert_clean()
        wide = page.page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert wide <= 1, f"{wide} px wider than the {width} px window"
        scrolled = page.page.eval_on_selector_all(
            "pre.diff, pre.config", "els => els.filter(e => e.scrollWidth - e.clientWidth > 1).map(e => e.textContent.slice(0, 60))")
        assert not scrolled, f"patch or config lines cut at the card's edge: {scrolled}"
        for plot_id in page.page.eval_on_selector_all(".plot", "els => els.map(e => e.id)"):
            for axis in ("xtick", "ytick", "y2tick"):
                clash = page.page.eval_on_selector_all(f"#{plot_id} g.{axis} text", OVERLAPS)
                assert not clash, (plot_id, axis, clash[:5])
        page.page.screenshot(path=str(tmp_path / f"{which}-{width}.png"), full_page=True)
        assert (tmp_path / f"{which}-{width}.png").stat().st_size > 10_000
    finally:
        page.close()


def test_the_docs_screenshot_is_taken_of_todays_report(browser: object, docs_report: Path, tmp_path: Path) -> None:
    """docs/samples.py's screenshot of the docs run's report (what docs/report.png is): the size the
    pages' image has, the page drawn (not a blank capture)."""
    import importlib.util

    samples = sys.modules.get("doc_samples")
    if samples is None:  # (loaded as tests/test_doc_samples.py loads it: its dataclass needs the module listed)
        spec = importlib.util.spec_from_file_location("doc_samples", ROOT / "docs" / "samples.py")
        samples = sys.modules["doc_samples"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(samples)  # type: ignore[union-attr]
    out = tmp_path / "report.png"
    samples.screenshot(docs_report, out, browser)
    png = out.read_bytes()
    size = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert size == tuple(samples.SCREENSHOT_SIZE.values()) == (1400, 1450)
    assert 100_000 < len(png) < 350_000 and not list(tmp_path.glob("*.partial.png"))


V100_TRACE = FIXTURES / "traces" / "v100_resnet50_dataloader_workers0.pt.trace.json.gz"


def test_a_recorded_traces_page_plots_its_steps(browser: object, tmp_path: Path) -> None:
    """`audit analyze` of a recorded GPU trace: its ProfilerSteps drawn (the page had only the
    memory plot), the cards worded for a recording."""
    out = tmp_path / "analyzed"
    subprocess.run([sys.executable, "-m", "auditor", "analyze", str(V100_TRACE), "--out", str(out), "-q"],
                   cwd=REPO, check=True, capture_output=True, timeout=180)
    page = Page(browser, out / "report.html")
    try:
        page.assert_clean()
        page.assert_plots_drawn(at_least=2)
        p = page.page
        titles = p.eval_on_selector_all(".plot .gtitle", "els => els.map(e => e.textContent)")
        assert f"Step time in {V100_TRACE.name} (ms)" in titles
        cards = p.locator("#verdict").inner_text()
        assert "6 ProfilerSteps recorded" in cards and "steps run" not in cards and "RSS" not in cards
        assert "Tesla V100-DGXS-32GB x4" in cards
    finally:
        page.close()
