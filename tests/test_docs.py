"""The documentation is held to the code: the site builds with `mkdocs build --strict` (a broken link,
page or anchor fails), its generated pages list what the code registers, and every command line the
README and the pages show parses against the real click CLI (a documented flag or command that is gone
fails), the cheap ones run for real, and a page's commands read only the `--out` directories its
earlier commands write, those that read them running in the page's order."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from auditor.cli import cli
from auditor.rules.registry import all_rules

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

# Names a command may use for the user's own files and directories (what the reader puts there), and
# output directories an earlier command of the same page writes. Any other path must exist.
PLACEHOLDERS = {"TARGET", "PATH", "DIR", "A", "B", "RULE", "ID", "PCT", "train.py", "script.py", "ckpt.pt",
                "model.safetensors", "snap.pickle", "config.yaml", "small.yaml", "traces/", "rank-0/", "rank-1/",
                "output/checkpoint-500/", "/elsewhere/train.py", "traces/rank-*.pt.trace.json.gz",
                "v100_resnet50_dataloader_workers0.pt.trace.json.gz",
                "v100_resnet50_dataloader_workers4.pt.trace.json.gz"}
OUTPUTS = ("audit-out/",)
# An inline code span in prose may name a command or an option without the rest of its command line
# (`audit analyze`, `audit run --nproc-per-node`): its names must exist, its missing values may be missing.
INLINE = "inline: "
PROGRAM = re.compile(r"^(?:audit|python -m auditor)(?:\s|$)")


def documented_commands(pages: list[Path] = PAGES) -> list[tuple[str, str]]:
    """(where, command) for every `audit ...` / `python -m auditor ...` command of a code block, and every
    inline code span that is one. In a block that shows a `$ ` prompt only the prompted lines are
    commands (the others are output). A line may hold several commands (`... && audit run ...`), a CI
    workflow's step (`- run: audit ...`) or environment settings before one (`VAR=1 audit ...`); a
    `torchrun ... -m auditor ...` command counts from `-m auditor` on."""
    found = []
    for page in pages:
        lines = page.read_text().split("\n")
        blocks = _code_blocks(lines)
        for n, line in enumerate(lines, 1):
            where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name}:{n}"
            block = blocks.get(n)
            if block is None:
                found += [(where, f"{INLINE}{span}") for span in re.findall(r"`([^`]+)`", line) if PROGRAM.match(span)]
                continue
            text = line.strip()
            if block:  # a block with prompts
                if not text.startswith("$ "):
                    continue
                text = text[2:]
            found += [(where, c) for c in _line_commands(text)]
    return found


def _line_commands(text: str) -> list[str]:
    """The auditor's commands on one shell line of a code block."""
    text = re.sub(r"^(?:-\s+)?(?:run:\s+)?", "", text)  # a CI workflow's `- run: ...` / `run: ...` step
    out = []
    for part in re.split(r"\s(?:&&|\|\||;)\s", text):
        part = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", part.strip())  # VAR=value before the command
        if " -m auditor " in part and part.startswith("torchrun "):
            part = "python -m auditor " + part.split(" -m auditor ", 1)[1]
        if PROGRAM.match(part):
            out.append(part)
    return out


def _code_blocks(lines: list[str]) -> dict[int, bool]:
    """Line number -> whether its code block (fenced, or indented by 4 spaces after a blank line)
    shows `$ ` prompts; lines outside code blocks are absent."""
    blocks: list[list[int]] = []
    fenced = False
    for n, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            if fenced:
                blocks.append([])
            continue
        indented = line.startswith("    ") and not line.lstrip().startswith(("-", "|"))
        if fenced:
            blocks[-1].append(n)
        elif indented and (blocks and blocks[-1] and blocks[-1][-1] == n - 1 or n == 1 or not lines[n - 2].strip()):
            if not (blocks and blocks[-1] and blocks[-1][-1] == n - 1):
                blocks.append([])
            blocks[-1].append(n)
    out = {}
    for block in blocks:
        prompted = any(lines[n - 1].strip().startswith("$ ") for n in block)
        out.update({n: prompted for n in block})
    return out


def _args(command: str) -> list[str]:
    """The command's arguments after the program name: its comment dropped, `a|b` alternatives as
    their first, and the page's placeholders for "and so on" (`...`, `[options]`, `<this run>`) left out."""
    command = re.sub(r"\s+#\s.*$", "", command)
    words = shlex.split(command)
    words = words[3:] if words[:3] == ["python", "-m", "auditor"] else words[1:]
    args = []
    for w in words:
        if w.endswith("...") and w != "...":
            w = w[:-3]
        if w in ("...", "[options]") or w.startswith(("[", "<")) or w.endswith(">"):
            continue
        args.append(w.replace("\\|", "|").split("|")[0])
    return args


def _parse(args: list[str]) -> click.Command | None:
    """Parse `args` as the shell would hand them to `audit`: the subcommand must exist and take every
    option named (unknown options raise). Placeholder values parse without their checks
    (resilient parsing); a command whose files all exist is parsed in full as well."""
    ctx = click.Context(cli, info_name="audit", resilient_parsing=True)
    # the group's own options parsed as a plain command's: what is left is the subcommand and its
    # arguments (Group.parse_args would split them into the deprecated protected_args)
    rest = click.Command.parse_args(cli, ctx, list(args))
    if not rest:
        return None
    name, command, rest = cli.resolve_command(ctx, rest)
    assert command is not None, f"no command {name!r}"
    command.make_context(name, list(rest), parent=ctx, resilient_parsing=True)
    if not any(_is_placeholder(a) for a in rest):
        command.make_context(name, list(rest), parent=ctx)
    return command


def _is_placeholder(arg: str) -> bool:
    return arg in PLACEHOLDERS or arg.startswith(OUTPUTS) or arg.isupper()


def _paths(args: list[str]) -> list[str]:
    """The arguments that name files of this repository (a step target's file without `:step`)."""
    out = []
    for a in args:
        path = a.split(":")[0]
        if a.startswith("-") or _is_placeholder(a) or _is_placeholder(path):
            continue
        if "/" in path or re.search(r"\.(py|json|gz|pickle|pt|safetensors|ya?ml|toml)$", path):
            out.append(path)
    return out


COMMANDS = documented_commands()


def test_the_pages_show_commands():
    """The extraction reads the pages: a broken reader would pass every check below on nothing."""
    shown = {c.removeprefix(INLINE) for _, c in COMMANDS}
    assert "audit run examples/train_script.py --steps 30" in shown
    assert "audit explain dataloader-bound" in shown
    assert any(c.startswith("audit analyze") and "--engine" in c for c in shown)
    assert len(COMMANDS) > 80


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_parses(where, command):
    inline = command.startswith(INLINE)
    command = command.removeprefix(INLINE)
    args = _args(command)
    if args and args[0] in ("-h", "--help", "--version"):
        return  # run for real below
    try:
        _parse(args)
    except (click.MissingParameter, click.BadOptionUsage) as e:
        if not (inline and ("Missing argument" in e.format_message() or "requires an argument" in e.format_message())):
            pytest.fail(f"{where}: `{command}` does not parse: {e.format_message()}")
    except click.ClickException as e:
        pytest.fail(f"{where}: `{command}` does not parse: {e.format_message()}")
    missing = [p for p in _paths(args) if not (ROOT / p).exists()]
    assert not missing, f"{where}: `{command}` names files that do not exist: {missing}"


def test_a_gone_flag_fails_the_check():
    """The check above can fail: a flag the CLI does not have, or a command it does not have."""
    with pytest.raises(click.NoSuchOption):
        _parse(_args("audit run examples/demo.py:step --stepz 30"))
    with pytest.raises(AssertionError):
        _parse(_args("audit frobnicate examples/demo.py"))
    with pytest.raises(click.BadParameter):
        _parse(_args("audit run examples/demo.py:step --steps zero"))


def test_every_command_line_of_a_code_block_is_checked():
    """A line of a code block that calls the auditor, in whatever form (after `&&`, as a CI step, under
    a launcher), is among the commands checked above: a form the reader misses would go unchecked."""
    checked = {w for w, _ in COMMANDS}
    calls = re.compile(r"(?:^|[\s:;&|(])(?:audit|-m auditor)\s+-{0,2}[a-z]")
    unchecked = []
    for page in PAGES:
        lines = page.read_text().split("\n")
        for n, prompted in _code_blocks(lines).items():
            text = lines[n - 1].strip()
            if prompted and not text.startswith("$ "):
                continue  # a command's output
            if calls.search(text) and f"{page.relative_to(ROOT)}:{n}" not in checked:
                unchecked.append(f"{page.relative_to(ROOT)}:{n}: {text}")
    assert not unchecked


def test_a_page_showing_a_gone_flag_or_command_fails(tmp_path):
    """From a page's text to the verdict: a CI step with a flag the CLI lacks, and a command it lacks
    at the end of an install line, are read from the page and fail to parse."""
    page = tmp_path / "page.md"
    page.write_text("A job:\n\n```yaml\nsteps:\n  - run: audit run examples/demo.py:step --stepz 3\n```\n\n"
                    "    pip install -e . && OMP_NUM_THREADS=1 audit frobnicate examples/demo.py\n")
    found = [c for _, c in documented_commands([page])]
    assert found == ["audit run examples/demo.py:step --stepz 3", "audit frobnicate examples/demo.py"]
    with pytest.raises(click.NoSuchOption):
        _parse(_args(found[0]))
    with pytest.raises(AssertionError):
        _parse(_args(found[1]))


def _outputs_and_inputs(args: list[str]) -> tuple[list[str], list[str]]:
    """The `audit-out/...` directories a command writes (its `--out`) and those it reads."""
    outs = [b for a, b in zip(args, args[1:]) if a == "--out"]
    return outs, [a for a in args if a.startswith(OUTPUTS) and a not in outs]


def _sequences() -> dict[str, list[tuple[str, str]]]:
    """Per page, the commands of its code blocks in the page's order."""
    pages: dict[str, list[tuple[str, str]]] = {}
    for where, command in COMMANDS:
        if not command.startswith(INLINE):
            pages.setdefault(where.split(":")[0], []).append((where, command))
    return pages


def test_a_pages_commands_read_only_what_its_earlier_commands_wrote():
    """Run in the order a page shows them, each command's `audit-out/...` input is the `--out` of a
    command above it on the same page (a reader who copies the page in turn never meets a missing
    directory)."""
    for page, commands in _sequences().items():
        written: set[str] = set()
        for where, command in commands:
            outs, ins = _outputs_and_inputs(_args(command))
            missing = [i for i in ins if i.rstrip("/") not in written]
            assert not missing, f"{where}: `{command}` reads {missing}, which no command above it writes"
            written |= {o.rstrip("/") for o in outs}


# the pages whose commands chain through `audit-out/...` directories
CHAINED = sorted(page for page, commands in _sequences().items()
                 if any(_outputs_and_inputs(_args(c))[1] for _, c in commands))


@pytest.mark.parametrize("page", CHAINED)
def test_a_pages_chained_commands_run_as_written(page, tmp_path, monkeypatch):
    """The page's commands, in its order, in a scratch directory: each `audit run ... --out DIR` is
    stood in for by the audit docs/samples.py keeps (tests/fixtures/docs: an `audit run` output
    directory, as DIR would be; the runs themselves parse above), and every command that reads such a
    directory runs for real, as written, and exits 0."""
    from conftest import FIXTURES

    kept = FIXTURES / "docs" / "audited_train_script"
    monkeypatch.chdir(tmp_path)
    ran = 0
    for where, command in _sequences()[page]:
        args = _args(command)
        outs, ins = _outputs_and_inputs(args)
        if args[0] == "run":
            for out in outs:  # (a run into an earlier run's --out replaces it)
                shutil.rmtree(tmp_path / out, ignore_errors=True)
                shutil.copytree(kept, tmp_path / out)
        elif ins:
            result = CliRunner().invoke(cli, args, prog_name="audit")
            assert result.exit_code == 0, f"{where}: `{command}` exited {result.exit_code}: {result.output}"
            ran += 1
    assert ran


# the documented commands that run in a moment: `audit rules`, `audit explain` of a rule id
CHEAP = sorted({c for c in (c.removeprefix(INLINE) for _, c in COMMANDS)
                if (_args(c) == ["rules"] or len(_args(c)) == 2 and _args(c)[0] == "explain")
                and not any(_is_placeholder(a) for a in _args(c))} | {"audit --help", "audit run --help"})


@pytest.mark.parametrize("command", CHEAP)
def test_cheap_documented_command_runs(command):
    result = CliRunner().invoke(cli, _args(command), prog_name="audit")
    assert result.exit_code == 0, result.output
    assert result.output.strip()


def test_readme_is_short_and_keeps_the_set_up_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if line.startswith("python3 -m venv"))
    assert f"\n    {test_command}\n" in readme
    assert ("\n    python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e . && "
            "audit run examples/train_script.py --steps 30\n") in readme
    assert "(docs/report.png)" in readme and (ROOT / "docs" / "report.png").exists()


def test_the_reports_screenshot_is_the_top_of_a_page_and_small():
    """docs/report.png is what `python docs/samples.py --screenshot` writes: a PNG of its size (the
    top of a 1400 px page), near 300 KB."""
    png = (ROOT / "docs" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 1450), "not the size docs/samples.py takes: run it with --screenshot"
    assert len(png) < 350_000


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the site under `root` (no --quiet: it hides the warnings strict
    mode counts, and a broken link then builds)."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(out)], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    start = time.perf_counter()
    done = build(ROOT, out)
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"docs build: {time.perf_counter() - start:.2f} s")
    return out


def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", copy)
    shutil.copy(ROOT / "README.md", copy)
    with open(copy / "docs" / "memory.md", "a") as f:
        f.write("\nSee [the forecast](forecast.md).\n")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0
    assert "forecast.md" in done.stdout + done.stderr


def test_site_builds_strict_with_every_page(site):
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages
    for page in pages:
        html = site / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert html.exists(), page


def test_rules_reference_lists_every_registered_rule(site):
    html = (site / "rules" / "index.html").read_text()
    rules = all_rules()
    assert len(rules) >= 30
    for rule_id, cls in rules.items():
        assert f'id="{rule_id}"' in html, rule_id
        # the text `audit explain` prints, escaped as HTML shows it
        first_line = cls.docs().splitlines()[0]
        assert _html_text(first_line) in html, (rule_id, first_line)


def test_schemas_are_generated_from_the_structs(site):
    import msgspec

    from auditor.evidence.model import Evidence
    from auditor.findings import Finding

    html = (site / "schemas" / "index.html").read_text()
    for struct in (Finding, Evidence):
        for field in msgspec.structs.fields(struct):
            assert f"<code>{field.encode_name}</code>" in html, (struct.__name__, field.encode_name)


def test_the_flag_table_is_generated_from_the_cli(site):
    """docs/auditing-programs.md's flag table is `audit run`'s click options, each with its help text:
    a flag added to the CLI is in the table without an edit of the page."""
    page = (ROOT / "docs" / "auditing-programs.md").read_text()
    assert "<!-- flags: run -->" in page and "| `--steps N` |" not in page
    html = (site / "auditing-programs" / "index.html").read_text()
    for p in cli.commands["run"].params:
        if isinstance(p, click.Option) and p.name != "help" and not p.hidden:
            for opt in (*p.opts, *p.secondary_opts):
                assert f"<code>{opt}" in html, opt
            assert _html_text(re.split(r"[`(\[]", p.help or "")[0].strip()[:30]) in html, p.name


def _html_text(text: str) -> str:
    import html

    return html.escape(text, quote=False)


def test_rules_at_a_glance_table_is_the_registered_rules():
    """The hand-written one-line table of docs/rules.md names every registered rule once, at its
    default severity (the full reference below it is generated)."""
    text = (ROOT / "docs" / "rules.md").read_text()
    rows = re.findall(r"^\| `([a-z-]+)` \| (\w+) \|", text, re.M)
    assert sorted(rows) == sorted((rule_id, cls.severity) for rule_id, cls in all_rules().items())


def test_the_ci_workflow_is_complete():
    """docs/diff-and-ci.md's GitHub Actions workflow is valid YAML and holds what the page promises:
    the install, an audit that fails on a warning, a baseline kept between runs (saved on main,
    restored on a pull request) and `audit diff` against it, the SARIF upload. Its `audit` lines
    parse above, with the others."""
    import yaml

    page = (ROOT / "docs" / "diff-and-ci.md").read_text()
    workflow = yaml.safe_load(re.search(r"```yaml\n(.*?)```", page, re.S).group(1))
    steps = workflow["jobs"]["audit"]["steps"]
    runs = [s.get("run", "") for s in steps]
    uses = [s.get("uses", "") for s in steps]
    assert any("pip install torch" in r for r in runs)
    assert any(r.startswith("audit run") and "--fail-on warning" in r and "audit-out/pr" in r for r in runs)
    saved = next(s for s in steps if s.get("uses", "").startswith("actions/cache/save"))
    restored = next(s for s in steps if s.get("uses", "").startswith("actions/cache/restore"))
    assert saved["with"]["path"] == restored["with"]["path"] == "audit-out/main"
    assert any(r.startswith("audit diff audit-out/main audit-out/pr --fail-on-regression") for r in runs)
    assert any(u.startswith("github/codeql-action/upload-sarif") for u in uses)
    assert "Expected time" in page
