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
    ("x = DataLoader(ds, **kw)\n", {"pin_memory": "True"}, (), "x = DataLoader(ds, **kw, pin_memory=True)\n"),
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
