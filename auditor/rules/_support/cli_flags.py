"""The command-line option a setting is read from: a script that takes `num_workers=int(opt.workers)`
from its argparse parser (pytorch/examples' dcgan and imagenet: `--workers`) is fixed by running it
with that option, not by editing the call."""
from __future__ import annotations

import ast

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
