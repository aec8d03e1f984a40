"""The sample outputs the README and the docs show, and the commands that make them.

A page's sample is the block that begins with `$ COMMAND` and runs to the block's end: the command's
output as a user sees it. `python docs/samples.py` runs each audit sample's command from the project's
root, writes its output into every page that shows it, and keeps the run's evidence (and trace) in
tests/fixtures/docs/NAME/, from which `audit report` prints the same summary again.
`python docs/samples.py --rerender` keeps the runs and writes what today's code prints of them into
the pages (the run's own notices, printed while it ran, stay as they were).
`python docs/samples.py --screenshot` writes docs/report.png, the top of the first kept run's
report.html as today's code renders it (headless Chromium, 1400 px wide). The test
(tests/test_doc_samples.py) re-renders each kept run with today's code and asks the pages' blocks to be
that output, and runs each sample of a recorded trace (deterministic) again: a change of the format
fails it until the samples are made again with this script.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEPT = ROOT / "tests" / "fixtures" / "docs"
# the lines of an output that name the run's own directory
RUN_DIR = re.compile(r"audit-out/[\w.-]+-\d{8}-\d{6}")


@dataclass(frozen=True)
class Sample:
    name: str  # its folder under tests/fixtures/docs
    command: str  # as the pages show it after `$ `
    pages: tuple[str, ...]  # the pages that show its output, relative to the root


AUDITS = (
    Sample("audited_train_script", "audit run examples/train_script.py --steps 30", ("README.md", "docs/getting-started.md")),
)


def block(page: Path, command: str) -> tuple[int, list[str]]:
    """(index of the `$ command` line, the output lines below it, dedented) of the page's sample."""
    lines = page.read_text().split("\n")
    for i, line in enumerate(lines):
        if line.strip() == f"$ {command}":
            indent = line[: len(line) - len(line.lstrip())]
            out = []
            for below in lines[i + 1:]:
                if not below.strip() or not below.startswith(indent) or below.strip() == "```":
                    break
                out.append(below[len(indent):])
            return i, out
    raise LookupError(f"{page}: no sample block for `$ {command}`")


def replace_block(page: Path, command: str, output: list[str]) -> None:
    i, old = block(page, command)
    lines = page.read_text().split("\n")
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i + 1: i + 1 + len(old)] = [indent + o for o in output]
    page.write_text("\n".join(lines))


def comparable(lines: list[str], run_dir: str) -> list[str]:
    """The lines as `audit report` prints them again: a run's own notices (`audit: ...`, printed while
    it runs) left out, its directory's name as RUN."""
    return [RUN_DIR.sub("RUN", line.replace(run_dir, "RUN") if run_dir else line)
            for line in lines if not line.startswith("audit: ")]


def report_command(run: Path) -> list[str]:
    """`audit report` of a kept run, reading its sources from this copy of the project."""
    return [sys.executable, "-m", "auditor", "report", str(run), "--source-root", str(ROOT)]


def make(sample: Sample) -> None:
    """Run the sample's command here, keep its evidence and trace, write its output into its pages."""
    args = sample.command.split()
    assert args[0] == "audit"
    done = subprocess.run([sys.executable, "-m", "auditor", *args[1:]], cwd=ROOT, capture_output=True, text=True)
    # (the terminal shows stderr's notices above the summary, as the run prints them first)
    output = [*done.stderr.splitlines(), *done.stdout.splitlines()]
    run_dir = next(RUN_DIR.search(line).group(0) for line in output if line.startswith("report: "))
    kept = KEPT / sample.name
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    # (the run's paths made relative to the project, so that any copy of it reads its own files)
    text = (ROOT / run_dir / "evidence.json").read_text().replace(f'"{ROOT}/', '"')
    (kept / "evidence.json").write_text(text)
    if (ROOT / run_dir / "tb").is_dir():
        shutil.copytree(ROOT / run_dir / "tb", kept / "tb")
    for page in sample.pages:
        replace_block(ROOT / page, sample.command, output)
    print(f"{sample.name}: exit {done.returncode}, {len(output)} lines into {', '.join(sample.pages)}")


def rerender(sample: Sample) -> None:
    """Today's `audit report` of the kept run, in place of the pages' lines after the run's notices."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / sample.name
        shutil.copytree(KEPT / sample.name, run)
        done = subprocess.run(report_command(run), cwd=ROOT, capture_output=True, text=True)
        printed = done.stdout.splitlines()
    for page in sample.pages:
        _, shown = block(ROOT / page, sample.command)
        notices = [line for line in shown if line.startswith("audit: ")]
        run_dir = next((m.group(0) for line in shown if (m := RUN_DIR.search(line))), "RUN")
        replace_block(ROOT / page, sample.command, notices + [line.replace(str(run), run_dir) for line in printed])
    print(f"{sample.name}: re-rendered into {', '.join(sample.pages)}")


# The screenshot the pages show: the top of the first kept audit's report.html as today's code renders
# it (its cards and findings table), in headless Chromium (Debian's, driven by Playwright, as
# tests/reports/test_html_browser.py does). Cropped so that the PNG stays near 300 KB.
SCREENSHOT = ROOT / "docs" / "report.png"
SCREENSHOT_SIZE = {"width": 1400, "height": 1450}  # px


def screenshot(report: Path, out: Path = SCREENSHOT, browser: object = None) -> None:
    """The top of a rendered report.html, opened offline, written to `out` as a PNG (temp + rename), in
    `browser` (a Playwright Chromium) or in headless Chromium launched for it."""
    if browser is None:
        import os

        from playwright.sync_api import sync_playwright

        chromium = os.environ.get("AUDITOR_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
        with sync_playwright() as p:
            launched = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"])
            try:
                screenshot(report, out, launched)
            finally:
                launched.close()
        return
    page = browser.new_page(viewport=SCREENSHOT_SIZE)  # type: ignore[attr-defined]
    try:
        # as a user opens it: from the file, anything but a local file refused
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:", "blob:"))
                   else r.abort())
        page.goto(report.as_uri(), wait_until="load")
        page.wait_for_function("() => [...document.querySelectorAll('.plot')]"
                               ".every(d => d.querySelector('.main-svg, canvas'))", timeout=10000)
        partial = out.with_name(out.name + ".partial.png")
        page.screenshot(path=str(partial))
    finally:
        page.close()
    partial.replace(out)


def make_screenshot(sample: Sample) -> None:
    """docs/report.png from today's `audit report` of the kept run."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / sample.name
        shutil.copytree(KEPT / sample.name, run)
        subprocess.run(report_command(run), cwd=ROOT, check=True, capture_output=True, text=True)
        screenshot(run / "report.html")
    print(f"{sample.name}: {SCREENSHOT.relative_to(ROOT)} ({SCREENSHOT.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    if "--screenshot" in sys.argv[1:]:
        make_screenshot(AUDITS[0])
        sys.exit(0)
    for s in AUDITS:
        rerender(s) if "--rerender" in sys.argv[1:] else make(s)
