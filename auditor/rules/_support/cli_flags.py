"""The command-line option a setting is read from: a script that takes `num_workers=int(opt.workers)`
from its argparse parser (pytorch/examples' dcgan and imagenet: `--workers`) is fixed by running it
with that option, not by editing the call; a switch the script has an option of its own for
(`--compile`, llm.c's train_gpt2.py) is turned on with that option (`own_flag`)."""
from __future__ import annotations

import ast
from typing import Iterable, NamedTuple

from auditor.fixes import call_name, parse_file


def flag_for(file: str, expression: str) -> str | None:
    """`--workers` where `expression` (`int(opt.workers)`, `args.num_workers`, with or without the
    backticks a message quotes it in) reads one attribute of a parsed command line whose option an
    `add_argument` call in `file` declares; None otherwise."""
    try:
        node = ast.parse(expression.strip().strip("`"), mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Call) and call_name(node) in ("int", "bool", "float") and len(node.args) == 1:
        node = node.args[0]
    if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
        return None
    parsed = parse_file(file)
    if parsed is None:
        return None
    for call in ast.walk(parsed[0]):
        if call_name(call) != "add_argument":
            continue
        options = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        longs = [o for o in options if o.startswith("--")] or [o for o in options if o.startswith("-")]
        dest = next((k.value.value for k in call.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)),
                    longs[0].lstrip("-").replace("-", "_") if longs else None)
        if dest == node.attr and longs:
            return longs[0]
    return None


class OwnFlag(NamedTuple):
    """A script's own command-line option for a switch (`--compile`), as its `add_argument` declares it:
    the option, how to turn it on (`--compile 1`, or the bare flag of a store_true), its file and line."""

    option: str
    usage: str
    file: str
    line: int


def own_flag(files: Iterable[str | None], dest: str, value: str | None = None) -> OwnFlag | None:
    """The first `add_argument` in `files` whose destination is `dest` (`--compile` for "compile");
    with `value`, only one whose help, choices or default name that value (`--dtype` of "float32|
    bfloat16"), used as `--dtype bfloat16`; None when none declares one."""
    for file in dict.fromkeys(f for f in files if f):
        parsed = parse_file(file)
        if parsed is None:
            continue
        for call in ast.walk(parsed[0]):
            if call_name(call) != "add_argument":
                continue
            options = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            longs = [o for o in options if o.startswith("--")] or [o for o in options if o.startswith("-")]
            kw = {k.arg: k.value for k in call.keywords if k.arg}
            declared = kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else (
                longs[0].lstrip("-").replace("-", "_") if longs else None)
            if declared != dest or not longs:
                continue
            if value is not None:
                named = " ".join(ast.unparse(kw[k]) for k in ("help", "choices", "default") if k in kw)
                if value not in named:
                    continue
                return OwnFlag(longs[0], f"{longs[0]} {value}", file, call.lineno)
            action = kw.get("action")
            bare = (isinstance(action, ast.Constant) and action.value == "store_true") or (
                isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction")
            return OwnFlag(longs[0], longs[0] if bare else f"{longs[0]} 1", file, call.lineno)
    return None
