"""Fix edits change only the tokens they must (auditor.cst_edits through auditor.fixes): the rest of
the user's file, formatting and comments included, survives byte for byte, and the patch applies."""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

from auditor.cst_edits import edit_call_text
from auditor.findings import Edit
from auditor.fixes import edit_call_kwargs, insert_before, make_patch

LOADER = """\
import torch
from torch.utils.data import DataLoader

loader = DataLoader(
    ds,  # comment
    batch_size=8,
)
"""


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_keyword_added_to_a_multi_line_call_keeps_every_other_line(tmp_path: Path) -> None:
    """The call was re-printed on one line (`loader = DataLoader(ds, batch_size=8, pin_memory=True)`),
    dropping `# comment` and the trailing comma. Now one line is inserted, at the arguments'
    indentation with the call's trailing comma, and `git apply` of the patch gives exactly that."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    train = tmp_path / "train.py"
    train.write_text(LOADER)
    edit = edit_call_kwargs(str(train), 5, ("DataLoader",), {"pin_memory": "True"})
    assert edit == Edit(file=str(train), start=7, end=6, lines=["    pin_memory=True,"])  # an insertion only
    patch = make_patch([edit], tmp_path)
    (tmp_path / "fixes.patch").write_text(patch)
    subprocess.run(["git", "apply", "fixes.patch"], cwd=tmp_path, check=True)
    assert train.read_text() == LOADER.replace("    batch_size=8,\n", "    batch_size=8,\n    pin_memory=True,\n")


@pytest.mark.parametrize("before,set_kwargs,drop,after", [
    # a value changed in place, parentheses and the rest of the line kept
    ("x = DataLoader(ds, batch_size=(8))  # b\n", {"batch_size": "16"}, (),
     "x = DataLoader(ds, batch_size=(16))  # b\n"),
    # along one line: appended there, trailing comma kept
    ("x = DataLoader(ds, batch_size=8,)\n", {"pin_memory": "True"}, (), "x = DataLoader(ds, batch_size=8, pin_memory=True,)\n"),
    ("x = DataLoader()\n", {"pin_memory": "True"}, (), "x = DataLoader(pin_memory=True)\n"),
    # beside `**mapping` (which may give the key in another configuration): merged into the mapping,
    # each key reaching the call once; a keyword the call names is still changed in place
    ("x = DataLoader(ds, **kw)\n", {"pin_memory": "True"}, (), "x = DataLoader(ds, **dict(kw, pin_memory=True))\n"),
    ("x = DataLoader(ds, batch_size=8, **(a if c else {}))\n", {"batch_size": "16", "num_workers": "2"}, (),
     "x = DataLoader(ds, batch_size=16, **(dict(a if c else {}, num_workers=2)))\n"),
    # one per line without a trailing comma: the last argument gets one, its comment stays on its line
    ("x = DataLoader(\n    ds,\n    batch_size=8  # last\n)\n", {"pin_memory": "True", "num_workers": "4"}, (),
     "x = DataLoader(\n    ds,\n    batch_size=8,  # last\n    pin_memory=True,\n    num_workers=4\n)\n"),
    # hanging indentation: the new argument lines up under the last one
    ("x = DataLoader(ds,\n               batch_size=8)\n", {"pin_memory": "True"}, (),
     "x = DataLoader(ds,\n               batch_size=8,\n               pin_memory=True)\n"),
    # tabs and CRLF line endings are the file's own
    ("if a:\n\tx = DataLoader(\n\t\tds,\n\t\tnum_workers=0,\n\t)\n", {"num_workers": "4", "persistent_workers": "True"}, (),
     "if a:\n\tx = DataLoader(\n\t\tds,\n\t\tnum_workers=4,\n\t\tpersistent_workers=True,\n\t)\n"),
    ("x = DataLoader(\r\n    ds,\r\n    batch_size=8\r\n)\r\n", {"pin_memory": "True"}, (),
     "x = DataLoader(\r\n    ds,\r\n    batch_size=8,\r\n    pin_memory=True\r\n)\r\n"),
    # dropped with the comma that separated it
    ("loss.backward(x, retain_graph=True)\n", {}, ("retain_graph",), "loss.backward(x)\n"),
    ("loss.backward(retain_graph=True, x=1)\n", {}, ("retain_graph",), "loss.backward(x=1)\n"),
    ("loss.backward(\n    x,  # keep\n    retain_graph=True,  # theirs\n)\n", {}, ("retain_graph",),
     "loss.backward(\n    x,  # keep\n)\n"),
    ("m = DDP(model, find_unused_parameters=True, bucket_cap_mb=25)  # é\n", {"static_graph": "True"},
     ("find_unused_parameters",), "m = DDP(model, bucket_cap_mb=25, static_graph=True)  # é\n"),
])
def test_call_edits_change_only_their_tokens(before: str, set_kwargs: dict, drop: tuple, after: str) -> None:
    line = 2 if before.startswith("if") else 1
    out = edit_call_text(before, line, ("DataLoader", "backward", "DDP"), set_kwargs, drop)
    assert out == after
    ast.parse(out)


def test_no_change_no_edit(tmp_path: Path) -> None:
    f = tmp_path / "t.py"
    f.write_text("x = DataLoader(ds, pin_memory=True)\n")
    assert edit_call_kwargs(str(f), 1, ("DataLoader",), {"pin_memory": "True"}) is None
    assert edit_call_kwargs(str(f), 1, ("Other",), {"pin_memory": "True"}) is None


def test_an_inserted_statement_takes_the_surrounding_indentation(tmp_path: Path) -> None:
    f = tmp_path / "t.py"
    f.write_text("def step():\n\tif x:\n\t\tscaler.step(opt)\n")
    assert insert_before(str(f), 3, "scaler.unscale_(opt)") == Edit(str(f), 3, 2, ["\t\tscaler.unscale_(opt)"])


def test_every_copy_call_on_a_line_gets_non_blocking_unless_it_may_pass_it(tmp_path: Path) -> None:
    """pageable-copy's copies: `x, y = x.to(d), y.to(d)` changes both calls; a call passing
    non_blocking already, possibly by position (`y.cuda(0, True)`), or through `**kw`, is left alone."""
    from auditor.fixes import edit_calls_on_line

    f = tmp_path / "t.py"
    f.write_text("x, y = x.to(d), y.to(d, non_blocking=False)  # copy\nz = x.cuda(), y.cuda(0, True), w.cuda(**kw)\n")
    calls = {"to": 2, "cuda": 2}
    assert edit_calls_on_line(str(f), 1, calls, {"non_blocking": "True"}) == Edit(
        str(f), 1, 1, ["x, y = x.to(d, non_blocking=True), y.to(d, non_blocking=False)  # copy"])
    assert edit_calls_on_line(str(f), 2, calls, {"non_blocking": "True"}) == Edit(
        str(f), 2, 2, ["z = x.cuda(non_blocking=True), y.cuda(0, True), w.cuda(**kw)"])


def test_no_edit_into_installed_code_inside_or_outside_the_project(tmp_path: Path) -> None:
    """fixes.in_project: a `pip install --target vendor` directory inside the project (it holds
    `*.dist-info`) was taken for the user's code and patched; a venv's site-packages inside the
    project and the standard library are not the user's either."""
    import os

    from auditor.fixes import in_project, refused_edit

    project = tmp_path / "project"
    vendor = project / "vendor"
    (vendor / "lib").mkdir(parents=True)
    (vendor / "lib-1.0.dist-info").mkdir()
    (vendor / "lib" / "loop.py").write_text("x = 1\n")
    venv = project / ".venv" / "lib" / "python3.11" / "site-packages" / "pkg"
    venv.mkdir(parents=True)
    (venv / "m.py").write_text("x = 1\n")
    (project / "src").mkdir()
    (project / "src" / "train.py").write_text("x = 1\n")
    roots = [project]
    assert in_project(str(project / "src" / "train.py"), roots)
    assert not in_project(str(vendor / "lib" / "loop.py"), roots)
    assert not in_project(str(venv / "m.py"), roots)
    assert refused_edit(Edit(str(vendor / "lib" / "loop.py"), 1, 1, ["x = 2"]), roots)
    assert refused_edit(Edit(os.__file__, 1, 1, ["x = 2"]), [Path("/")])  # the standard library


def test_a_removal_never_takes_another_statement_on_its_line(tmp_path: Path) -> None:
    """`log(); torch.cuda.empty_cache()` became `pass  # ...`: the user's log() call went with it."""
    from auditor.fixes import remove_statement

    f = tmp_path / "t.py"
    f.write_text("import torch\nfor i in range(3):\n    log(); torch.cuda.empty_cache()\n    torch.cuda.empty_cache()\n"
                 "    if i: torch.cuda.empty_cache()\n")
    assert remove_statement(str(f), 3, "removed") is None
    assert remove_statement(str(f), 5, "removed") is None
    assert remove_statement(str(f), 4, "removed") == Edit(str(f), 4, 4, ["    pass  # removed"])


def test_a_wrapped_statement_keeps_its_lines_and_compiles(tmp_path: Path) -> None:
    """unused-graph's fix: the statement, over however many lines, inside `with torch.no_grad():`,
    each line one level deeper, its comment kept; none for a statement that shares its line with a
    header or another statement, or holds a string over several lines (indenting would change it)."""
    from auditor.fixes import apply_edits, wrap_statement

    src = tmp_path / "m.py"
    text = ('import torch\n\n\ndef f(model, x, flag):\n    out = model(\n        x,\n    )  # the forward\n'
            '    if flag: y = model(x)\n    a = model(x); b = 1\n    s = model("""\n x""")\n    return out\n')
    src.write_text(text)
    edit = wrap_statement(str(src), 5, "with torch.no_grad():")
    assert edit is not None and (edit.start, edit.end) == (5, 7)
    lines = [t.rstrip("\n") for t in apply_edits(text.splitlines(), [edit])]
    assert lines[4:8] == ["    with torch.no_grad():", "        out = model(", "            x,",
                          "        )  # the forward"]
    ast.parse("\n".join(lines))
    assert [wrap_statement(str(src), n, "with torch.no_grad():") for n in (8, 9, 10)] == [None, None, None]
    src.write_text("import torch\n\n\ndef f(model, x):\n\tout = model(x)\n\treturn out\n")
    assert wrap_statement(str(src), 5, "with torch.no_grad():").lines == ["\twith torch.no_grad():", "\t\tout = model(x)"]
