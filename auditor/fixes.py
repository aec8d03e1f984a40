"""Code fixes: small source edits derived from the user's file, rendered as a `git apply`-able diff.

Rules build `Edit`s with these helpers; the engine renders each finding's edits into `Fix.patch`
and the patch reporter joins every finding's edits per file. An edit with `end == start - 1`
inserts before `start`.
All edits are computed from the file as it is on disk at analysis time; when the file is gone or
the line no longer matches what the run saw, no edit is offered.
"""
from __future__ import annotations

import ast
import difflib
import functools
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from auditor.evidence import source_access
from auditor.findings import Edit

if TYPE_CHECKING:
    from auditor import cst_edits
# libcst takes ~0.4 s to import, and most audits build no call edit: the functions that edit
# calls import auditor.cst_edits when first called.


def read_lines(file: str, keepends: bool = False) -> list[str] | None:
    """The file's lines (None if unreadable). keepends=True keeps each line's own ending, as the
    diff needs to reproduce the file byte for byte; without, lines feed the AST-level edits."""
    text = read_text(file)
    return None if text is None else text.splitlines(keepends=keepends)


def parse_file(file: str) -> tuple[ast.Module, list[str]] | None:
    """The file's syntax tree and its lines, what the AST-level edits read (None when the file is
    unreadable or no longer valid Python: no edit is offered then)."""
    lines = read_lines(file)
    if lines is None:
        return None
    try:
        return ast.parse("\n".join(lines)), lines
    except SyntaxError:
        return None


def call_name(node: ast.AST) -> str | None:
    """The name a call calls: `f` of `f(...)`, `step` of `opt.step(...)` (None for anything else)."""
    if not isinstance(node, ast.Call):
        return None
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _statement_at(file: str, line: int) -> ast.stmt | None:
    """The innermost simple statement starting on `line`."""
    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, _ = parsed
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and node.lineno == line and not hasattr(node, "body"):
            best = node
    return best


def remove_statement(file: str, line: int, reason: str) -> Edit | None:
    """Replace the statement on `line` with `pass  # reason` (keeps blocks syntactically valid).
    None when another statement shares its lines (`a(); torch.cuda.empty_cache()`, or a header:
    `if x: torch.cuda.empty_cache()`): replacing the lines would remove that one too."""
    stmt = _statement_at(file, line)
    parsed = parse_file(file)
    if stmt is None or parsed is None or not isinstance(stmt, ast.Expr):
        return None
    tree, lines = parsed
    end = stmt.end_lineno or line
    if lines[line - 1][:stmt.col_offset].strip():  # `if x: torch.cuda.empty_cache()`: the header is the line's too
        return None
    if _shares_lines(tree, stmt):
        return None
    return Edit(file=file, start=line, end=end, lines=[f"{_indent(lines[line - 1])}pass  # {reason}"])


def _shares_lines(tree: ast.Module, stmt: ast.stmt) -> bool:
    """Whether another simple statement of `tree` is on one of `stmt`'s lines (`a(); b()`)."""
    line, end = stmt.lineno, stmt.end_lineno or stmt.lineno
    return any(isinstance(n, ast.stmt) and (n.lineno, n.col_offset) != (stmt.lineno, stmt.col_offset)
               and not hasattr(n, "body") and n.lineno <= end and (n.end_lineno or n.lineno) >= line
               for n in ast.walk(tree))


def insert_before(file: str, line: int, text: str) -> Edit | None:
    """A line `text` inserted before the statement that starts on `line`, at its indentation (None
    when no simple statement starts there, or one on that line precedes it: `a(); b()`)."""
    stmt = _statement_at(file, line)
    lines = read_lines(file)
    if stmt is None or lines is None or lines[line - 1][:stmt.col_offset].strip():
        return None
    return Edit(file=file, start=line, end=line - 1, lines=[_indent(lines[line - 1]) + text])


# `import torch` / `import torch.nn` bind the name `torch`; `from torch import nn` and
# `import torch.nn as nn` do not
_BINDS_TORCH = re.compile(r"\s*import\s+torch(\.\w+)*\s*(#.*)?$")


def binds_torch(lines: list[str]) -> bool:
    """Whether a file's `lines` import torch under its own name (`torch.no_grad` is defined there)."""
    return any(_BINDS_TORCH.match(t) for t in lines)


def wrap_statement(file: str, line: int, header: str) -> Edit | None:
    """The simple statement that starts on `line` put inside a block `header` (`with torch.no_grad():`),
    its lines indented one level more. None when it shares a line with another statement or a
    header (`if x: y = f(x)`), or holds a string over several lines (indenting would change it)."""
    stmt = _statement_at(file, line)
    parsed = parse_file(file)
    if stmt is None or parsed is None:
        return None
    tree, lines = parsed
    end = stmt.end_lineno or line
    after = lines[end - 1][stmt.end_col_offset or 0:].strip()
    if lines[line - 1][:stmt.col_offset].strip() or (after and not after.startswith("#")):
        return None
    if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.lineno != n.end_lineno
           for n in ast.walk(stmt)):
        return None
    if _shares_lines(tree, stmt):
        return None
    indent = _indent(lines[line - 1])
    deeper = "\t" if "\t" in indent else "    "  # (a file indented with tabs takes one more tab)
    return Edit(file=file, start=line, end=end,
                lines=[indent + header, *(deeper + text if text.strip() else text for text in lines[line - 1:end])])


def insert_before_header(file: str, line: int, text: str) -> Edit | None:
    """A line `text` inserted before the statement, simple or compound (a `for` header), that
    starts on `line` and is the first on it, at its indentation (None otherwise)."""
    parsed = parse_file(file)
    if parsed is None or not 0 < line <= len(parsed[1]):
        return None
    tree, lines = parsed
    stmt = next((n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno == line), None)
    if stmt is None or lines[line - 1][:stmt.col_offset].strip():
        return None
    return Edit(file=file, start=line, end=line - 1, lines=[_indent(lines[line - 1]) + text])


def _call_on_line(file: str, line: int, names: Iterable[str]) -> ast.Call | None:
    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, _ = parsed
    wanted = set(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno):
            name = call_name(node)
            if name in wanted:
                return node
    return None


def computed_kwargs(file: str, line: int, names: Iterable[str], keys: Iterable[str]) -> dict[str, str]:
    """{keyword: its source} for the `keys` the call on `line` passes as an expression rather than a
    literal (`num_workers=cfg["num_workers"]`): the value is set where that expression reads it, so
    a patch replacing it with a literal would leave the user's config entry dead."""
    call = _call_on_line(file, line, names)
    lines = read_lines(file)
    if call is None or lines is None:
        return {}
    keys = set(keys)
    src = "\n".join(lines)
    return {kw.arg: (ast.get_source_segment(src, kw.value) or "...") for kw in call.keywords
            if kw.arg in keys and not isinstance(kw.value, ast.Constant)}


def read_text(file: str) -> str | None:
    """The file's text with its own line endings (None if unreadable, or not under the source roots:
    auditor.evidence.source_access)."""
    path = source_access.resolve(file)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def text_edit(file: str, old: str, new: str) -> Edit | None:
    """The Edit turning `old` (the file's text) into `new`: only the lines that differ, from the
    first to the last (None when none does). Lines the change leaves alone stay out of it, so two
    fixes on one call conflict only where they touch the same lines."""
    a, b = old.splitlines(), new.splitlines()
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    if head == len(a) == len(b):
        return None
    return Edit(file=file, start=head + 1, end=len(a) - tail, lines=b[head:len(b) - tail])


def call_site(file: str, line: int, names: Iterable[str]) -> "cst_edits.CallSite | None":
    """The call to one of `names` spanning `line` as the edits see it: its keywords, whether it
    passes `**mapping` (None when the file is unreadable or no such call is there)."""
    from auditor import cst_edits  # (libcst: imported by the first edit, not by every audit)

    text = read_text(file)
    return None if text is None else cst_edits.find_call(text, line, names)


def given_elsewhere(site: "cst_edits.CallSite", keys: Iterable[str], received: Iterable[str] | None) -> dict[str, str]:
    """{key: where the call gives it} for the `keys` the call receives though its text does not pass
    them by name: through `**mapping` (or `*seq`) or by position, as the run saw the call bound
    (`received`: the parameters it gave; None when not recorded, where any unpacked argument may
    hold any key). Adding one of them by name would make the call raise "got multiple values"."""
    named = site.keywords()
    unpacked = " and ".join(f"`{u}`" for u in site.unpacked)  # (quoted: the reports' code style)
    out = {}
    for k in keys:
        if k in named:
            continue
        if received is not None and k in set(received):
            out[k] = unpacked or "its positional arguments"
        elif received is None and site.unpacked:
            out[k] = unpacked
    return out


def edit_call_kwargs(file: str, line: int, names: Iterable[str], set_kwargs: dict[str, str] | None = None,
                     drop: Iterable[str] = (), received: Iterable[str] | None = None) -> Edit | None:
    """The call to one of `names` spanning `line` with keyword arguments set (values are source
    text) and others dropped, changing only those tokens (auditor.cst_edits): the call's other
    arguments, line breaks, trailing commas and comments stay as they are. The Edit holds only the
    lines that changed.

    None when a keyword to add may already reach the call another way (see given_elsewhere;
    `received`: the parameters the run saw the call give, None when unknown): the patched call
    would raise "got multiple values"."""
    from auditor import cst_edits  # (libcst: imported by the first edit, not by every audit)

    text = read_text(file)
    if text is None:
        return None
    names = tuple(names)
    site = cst_edits.find_call(text, line, names)
    if site is None or given_elsewhere(site, set_kwargs or {}, received):
        return None
    new = cst_edits.edit_call_text(text, line, names, set_kwargs, drop)
    return None if new is None else text_edit(file, text, new)


def edit_mapping(file: str, line: int, names: Iterable[str], set_items: dict[str, str]) -> Edit | None:
    """The dict literal the call to one of `names` spanning `line` unpacks (`DataLoader(ds, **kw)`
    where `kw = {"batch_size": 64, "num_workers": 0}`) given the keys `set_items` (values as source
    text): changed in place where the literal has them, added after its last entry where it does
    not. None unless the mapping is a name bound once in the file, to a dict literal of string keys
    (no `**` in it) whose entries to change are literals, and read nowhere but in `**` of a call
    (no `.update()`, no other reader whose values would change with it); and unless the call
    unpacks that one mapping."""
    parsed = parse_file(file)
    site = call_site(file, line, names)
    if parsed is None or site is None or len(site.unpacked) != 1 or not site.unpacked[0].startswith("**"):
        return None
    tree, lines = parsed
    name = site.unpacked[0][2:].strip()
    stores = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load)]
    assigns = [a for a in ast.walk(tree) if isinstance(a, ast.Assign) and len(a.targets) == 1
               and isinstance(a.targets[0], ast.Name) and a.targets[0].id == name]
    unpacks = {id(k.value) for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg is None}
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
    if len(stores) != 1 or len(assigns) != 1 or any(id(n) not in unpacks for n in loads):
        return None
    d = assigns[0].value
    if not isinstance(d, ast.Dict) or not d.keys or any(not (isinstance(k, ast.Constant) and isinstance(k.value, str))
                                                        for k in d.keys):
        return None
    have = {k.value: v for k, v in zip(d.keys, d.values)}  # type: ignore[union-attr]
    spans = []  # (line, start byte, end byte, text), applied from the right
    for key, value in set_items.items():
        if key in have:
            v = have[key]
            if not isinstance(v, ast.Constant) or v.lineno != v.end_lineno:
                return None  # (an expression, `2 if cuda else 0`: the user's choice, set where it is made)
            spans.append((v.lineno, v.col_offset, v.end_col_offset, value))
    first_key = d.keys[0]
    quote = lines[first_key.lineno - 1].encode("utf-8")[first_key.col_offset:first_key.col_offset + 1].decode()
    quote = quote if quote in ("'", '"') else '"'
    added = [f"{quote}{k}{quote}: {v}" for k, v in set_items.items() if k not in have]
    last = d.values[-1]
    if added:
        if d.lineno == d.end_lineno:  # written on one line: continue it
            spans.append((last.end_lineno, last.end_col_offset, last.end_col_offset, "".join(", " + a for a in added)))
        else:  # one entry per line: each added one on its own line, at the entries' indentation
            indent = lines[d.keys[-1].lineno - 1][:d.keys[-1].col_offset]  # type: ignore[union-attr]
            rest = lines[last.end_lineno - 1].encode("utf-8")[last.end_col_offset:].decode("utf-8")
            if not rest.lstrip().startswith(","):
                return None  # (no trailing comma on the last entry: left as written)
            spans.append((last.end_lineno, len(lines[last.end_lineno - 1].encode("utf-8")),
                          len(lines[last.end_lineno - 1].encode("utf-8")),
                          "".join(f"\n{indent}{a}," for a in added)))
    new_lines = list(lines)
    for ln, a, b, text in sorted(spans, key=lambda x: (x[0], x[1]), reverse=True):
        raw = new_lines[ln - 1].encode("utf-8")  # (ast's columns are UTF-8 byte offsets)
        new_lines[ln - 1] = (raw[:a] + text.encode("utf-8") + raw[b:]).decode("utf-8")
    changed = [i for i, (old, new) in enumerate(zip(lines, new_lines), 1) if old != new]
    if not changed:
        return None
    first, last_line = changed[0], changed[-1]
    return Edit(file=file, start=first, end=last_line,
                lines=[ln for i in range(first, last_line + 1) for ln in new_lines[i - 1].split("\n")])


def edit_calls_on_line(file: str, line: int, positional: dict[str, int], set_kwargs: dict[str, str]) -> Edit | None:
    """Every call on `line` to a name in `positional` (`to` of `x.to(dev)`, `cuda`) given the
    keyword arguments `set_kwargs` where it does not pass them yet: `x, y = x.to(d), y.to(d)`
    changes both calls. A call that passes `*seq`/`**mapping`, or as many positional arguments as
    `positional` names for it (where one of them may be the keyword's), is left as it is. Only the
    added tokens change (auditor.cst_edits)."""
    from auditor import cst_edits  # (libcst: imported by the first edit, not by every audit)

    text = read_text(file)
    if text is None:
        return None
    new = text
    names = tuple(positional)
    for i in range(len(cst_edits.find_calls(text, line, names))):
        calls = cst_edits.find_calls(new, line, names)  # (read again after each edit: the offsets moved)
        call = calls[i]
        plain = [a for a in call.args if not a.keyword and not a.star]
        if call.unpacked or len(plain) >= positional[call.name]:
            continue
        todo = {k: v for k, v in set_kwargs.items() if k not in call.keywords()}
        if todo:
            new = cst_edits.edit_call_text(new, line, names, todo, nth=i) or new
    return text_edit(file, text, new)


def replace_in_line(file: str, line: int, old: str, new: str) -> Edit | None:
    lines = read_lines(file)
    if lines is None or line > len(lines) or old not in lines[line - 1]:
        return None
    return Edit(file=file, start=line, end=line, lines=[lines[line - 1].replace(old, new, 1)])


# --- which edits the user's project takes ----------------------------------------------------

_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/")


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


def project_roots(target: str = "") -> list[Path]:
    """Where the user's own files are: the git toplevel of the current directory (else the
    directory itself), and that of the audited file's directory when the target names a file."""
    roots = [repo_root(Path.cwd())]
    file = target.split(":", 1)[0] if target and not target.startswith("-") else ""
    if file.endswith(".py"):
        p = Path(file).resolve()
        roots.append(repo_root(p) if _git_toplevel(str(p.parent)) else p.parent)
    return roots


def in_project(file: str, roots: Sequence[Path]) -> bool:
    """Whether `file` is the user's to edit: under one of `roots` and not installed library code
    (site-packages, dist-packages, the interpreter's standard library or environment, a
    `pip install --target` directory inside the project: one holding `*.dist-info`)."""
    path = os.path.realpath(file)
    if any(m in path.replace(os.sep, "/") for m in _LIBRARY_MARKERS):
        return False
    if path.startswith(_library_dirs()):
        return False
    for root in (str(r.resolve()) for r in roots):
        if path.startswith(root + os.sep):
            # the directories between the root and the file (the root itself is the project's)
            d = os.path.dirname(path)
            while d.startswith(root + os.sep):
                if source_access.holds_distributions(d):
                    return False
                d = os.path.dirname(d)
            return True
    return False


def _imported_names(tree: ast.Module) -> set[str]:
    """The names the file binds by import (`import torch` -> torch, `from gc import collect` -> collect)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                names.add((a.asname or a.name).split(".")[0])
    return names


def _dotted_root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def removes_library_caller(edit: Edit) -> bool:
    """Whether `edit` removes (replaces with `pass`) a statement that calls into a library rather
    than being the call a rule found: `trainer.fit(model)` or `run()`, whose callee did the work
    inside, as opposed to `torch.cuda.empty_cache()` or `gc.collect()`, a function named through
    the file's imports. Removing the former would drop the user's whole call for what the
    library did inside it."""
    if not edit.lines or any(ln.strip().split("#", 1)[0].strip() != "pass" for ln in edit.lines):
        return False
    parsed = parse_file(edit.file)
    if parsed is None:
        return True
    tree, _ = parsed
    stmt = next((n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno == edit.start
                 and not hasattr(n, "body")), None)
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return False  # (not a call statement: nothing is called into)
    func = stmt.value.func
    if not isinstance(func, (ast.Name, ast.Attribute)):
        return True  # `make()()`, `obj[k](...)`: called on something made at run time
    return _dotted_root(func) not in _imported_names(tree)


def refused_edit(edit: Edit, roots: Sequence[Path]) -> str | None:
    """Why no patch may carry `edit` (None: it may): its file is outside the user's project
    (installed libraries, the standard library, any file not under `roots`), or it removes a
    statement that calls into a library (see removes_library_caller)."""
    if not in_project(edit.file, roots):
        return "the file is not in the project (a library's or outside the project's directory)"
    if removes_library_caller(edit):
        return "the line calls into a library, which did the work inside: not an edit of that line"
    return None


# --- the diff core: edits -> a `git apply`-able unified diff ------------------------------

NO_NEWLINE = "\\ No newline at end of file\n"


@functools.lru_cache(maxsize=256)
def _git_toplevel(directory: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", directory, "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def repo_root(path: str | Path) -> Path:
    """The git toplevel holding `path`, else the current directory: where the user applies the patch."""
    p = Path(path).resolve()
    top = _git_toplevel(str(p.parent if not p.is_dir() else p))
    return Path(top).resolve() if top else Path.cwd().resolve()


def patch_path(path: str | Path, root: Path | None = None) -> str:
    """`path` as a patch names it: POSIX, relative to `root` (default: its repo_root).

    A file outside that root is named by its absolute path without the leading slash (git apply
    refuses `..`), so such a patch applies from `/`.
    """
    p = Path(path).resolve()
    rel = Path(os.path.relpath(p, root or repo_root(p))).as_posix()
    return rel if not rel.startswith("../") and rel != ".." else p.as_posix().lstrip("/")


def outside_root(path: str | Path, root: Path | None = None) -> bool:
    """Whether patch_path names `path` by its absolute path: outside `root` (default: its
    repo_root), where only `git apply` run from `/` finds it."""
    p = Path(path).resolve()
    rel = Path(os.path.relpath(p, root or repo_root(p))).as_posix()
    return rel.startswith("../") or rel == ".."


@dataclass
class EditPlan:
    """The edits of one file that can be applied together, and those left out with the reason."""

    taken: list[Edit] = field(default_factory=list)
    skipped: list[tuple[Edit, str]] = field(default_factory=list)


def _span(e: Edit) -> tuple[int, int]:
    """Half-open [start, stop) of the replaced lines (an insertion is empty: stop == start)."""
    return e.start, e.end + 1


def _conflict(a: Edit, b: Edit) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a0 == a1 and b0 == b1:  # two insertions at one point: their order would be a guess
        return a0 == b0
    if a0 == a1:  # an insertion strictly inside a replaced range is ambiguous
        return b0 < a0 < b1
    if b0 == b1:
        return a0 < b0 < a1
    return max(a0, b0) < min(a1, b1)


def plan_edits(edits: Iterable[Edit], line_count: int) -> EditPlan:
    """Keep edits in the order given (findings arrive ranked, so the more important wins)."""
    plan = EditPlan()
    for e in edits:
        if e.start < 1 or e.end < e.start - 1 or e.end > line_count:
            plan.skipped.append((e, f"lines {e.start}-{e.end} are outside the file ({line_count} lines)"))
        elif e in plan.taken:
            continue  # the same edit proposed by two findings
        elif any(_conflict(e, t) for t in plan.taken):
            plan.skipped.append((e, f"lines {e.start}-{e.end} overlap another edit"))
        else:
            plan.taken.append(e)
    return plan


def apply_edits(lines: list[str], edits: Sequence[Edit]) -> list[str]:
    """The file's lines (with their endings) after non-overlapping `edits`, applied bottom-up."""
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    out = list(lines)
    for e in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        new = [ln + newline for ln in e.lines]
        # Lines up to e.end are untouched so far, so e reaches the current end iff e.end == len(out).
        if new and e.end == len(out) and out and not out[-1].endswith(("\n", "\r")):
            if e.end < e.start:
                out[-1] += newline  # appending after an unterminated last line ends that line first
            new[-1] = new[-1][: -len(newline)]  # the file still ends without a newline
        out[e.start - 1:e.end] = new
    return out


def unified_diff(old: list[str], new: list[str], name: str, context: int = 3) -> str:
    """A git-style unified diff of one file (`diff --git a/name b/name`), '' when nothing changed."""
    body = list(difflib.unified_diff(old, new, fromfile=f"a/{name}", tofile=f"b/{name}", n=context))
    if not body:
        return ""
    out = [f"diff --git a/{name} b/{name}\n"]
    for ln in body:
        if ln.endswith("\n"):
            out.append(ln)
        else:  # the file's last line has no newline: say so, as diff and git do
            out.append(ln + "\n" + NO_NEWLINE)
    return "".join(out)


@dataclass
class PatchResult:
    diff: str
    skipped: list[tuple[Edit, str]] = field(default_factory=list)


def diff_edits(edits: Iterable[Edit], root: Path | None = None) -> PatchResult:
    """Join edits (in priority order) into one diff, file by file; also say which were left out."""
    by_file: dict[str, list[Edit]] = {}
    for e in edits:
        by_file.setdefault(str(Path(e.file).resolve()), []).append(e)
    parts: list[str] = []
    skipped: list[tuple[Edit, str]] = []
    for file in sorted(by_file, key=lambda f: patch_path(f, root)):
        lines = read_lines(file, keepends=True)
        if lines is None:
            skipped.extend((e, "the file cannot be read") for e in by_file[file])
            continue
        plan = plan_edits(by_file[file], len(lines))
        skipped.extend(plan.skipped)
        parts.append(unified_diff(lines, apply_edits(lines, plan.taken), patch_path(file, root)))
    return PatchResult("".join(parts), skipped)


def make_patch(edits: Sequence[Edit], root: Path | None = None) -> str:
    """The unified diff of `edits` ('' if none apply): what a rule puts in `Fix.patch`."""
    return diff_edits(edits, root).diff


