"""Fetches whose number the step computes with, not logs (host-sync's advice for them): read from
the source line that made the fetch.

* arithmetic on a fetched number (`advantage = R - value.item()`, PyTorch's actor-critic example):
  the number goes back into the step's tensors. `value.detach()` in place of `value.item()` keeps it
  on the device: the same value, with no gradient through it, as the number had none. A running
  total (`total += loss.item() * n`) is the logging case, not this one, and so is a number named
  for the output further down (nanoGPT's `lossf = loss.item() * gradient_accumulation_steps`, read
  only by `print(f"... {lossf:.4f}")`: a tensor there would be fetched by the print); a number set
  into an object or a dict (`group["lr"] = 0.05 * float(scale)`) may be wanted as a number there.
* a tensor made from tensors (`torch.tensor([R])` of a 0-d tensor `R`): torch reads each one back
  to the host to copy its value. Made from them on the device (`R.reshape(1)`, `torch.stack`), the
  values never leave it.

* a stop test (`stop_tests`): the number a loop's `if ...: break` or `while` reads (pytorch/examples'
  regression; a decoder's `if decoder_input.item() == EOS_token: break`, pytorch/tutorials' seq2seq
  translation). It is needed every time the test runs, so testing less often is the remedy, or a
  loop of a set length whose stop is a mask on the device.

Advice only, no patch: whether the other operand is a tensor, and what the result is used for
further on, is not known from the line alone."""
from __future__ import annotations

import ast
from typing import Any, Iterator

from auditor.fixes import parse_file

_NUMBERS = frozenset({"Tensor.item", "float(Tensor)", "int(Tensor)"})  # the fetches that make a host number
_MAKERS = frozenset({"torch.tensor", "torch.as_tensor", "torch.Tensor", "torch.FloatTensor", "torch.DoubleTensor",
                     "torch.LongTensor", "torch.IntTensor"})
# calls whose statement writes its values out (the logging case): no advice of this module's
_OUTPUT = frozenset({"print", "log", "info", "debug", "warning", "add_scalar", "add_scalars", "write", "append",
                     "extend", "set_postfix", "set_description", "format"})


def _statement(tree: ast.Module, line: int) -> ast.stmt | None:
    stmts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not hasattr(n, "body") and _spans(n, line)]
    return stmts[0] if len(stmts) == 1 else None


def _fetched(node: ast.Call) -> str | None:
    """The tensor expression `x` of `x.item()` or `float(x)`; None for another call."""
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "item" and not node.args and not node.keywords:
        return ast.unparse(f.value)
    if isinstance(f, ast.Name) and f.id == "float" and len(node.args) == 1 and not node.keywords:
        return ast.unparse(node.args[0])
    return None


def _made_from_tensors(node: ast.Call) -> str | None:
    """`torch.tensor([...])` (and the like) of something other than literals: its advice's remedy."""
    if ast.unparse(node.func) not in _MAKERS or not node.args:
        return None
    data = node.args[0]
    if all(isinstance(c, (ast.Constant, ast.List, ast.Tuple, ast.UnaryOp, ast.unaryop, ast.expr_context))
           for c in ast.walk(data)):
        return None  # literals: nothing of the device's is read
    items = data.elts if isinstance(data, (ast.List, ast.Tuple)) else None
    if items is not None and len(items) == 1 and isinstance(items[0], ast.Name):
        return f"`{items[0].id}.reshape(1)`"
    return "`torch.stack(...)` of the tensors, or `.reshape` of one"


def _fetch_trees(places: list[Any]) -> Iterator[tuple[Any, ast.Module]]:
    """(place, its file's tree) for each place that fetches a number (item, float, int) at a user's
    line of a file that parses."""
    for p in places:
        if p.what not in _NUMBERS or not p.where or not p.direct:
            continue
        parsed = parse_file(p.where.file)
        if parsed is not None:
            yield p, parsed[0]


def _fetch_statements(places: list[Any]) -> Iterator[tuple[Any, ast.Module, ast.stmt]]:
    """(place, its file's tree, its statement) for each place of `_fetch_trees` whose line is one
    statement."""
    for p, tree in _fetch_trees(places):
        stmt = _statement(tree, p.where.line)
        if stmt is not None:
            yield p, tree, stmt


def computed(places: list[Any]) -> dict[int, str]:
    """{id(place): advice} for the places (host-sync's, by_place's) whose fetch the line computes
    with: a number in arithmetic, or tensors copied into a new tensor through the host."""
    out: dict[int, str] = {}
    for p, tree, stmt in _fetch_statements(places):
        if isinstance(stmt, ast.AugAssign):  # (a running total: logging)
            continue
        calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]
        parents = {child: node for node in ast.walk(stmt) for child in ast.iter_child_nodes(node)}
        line = p.where.line
        for c in calls:
            made = _made_from_tensors(c)
            if made is not None:
                out[id(p)] = (f"`{ast.unparse(c)}` at line {line} reads the tensor(s) it is given back to the host to "
                              f"copy their values: make it from them on the device instead ({made})")
                break
            x = _fetched(c)
            parent = parents.get(c)
            if (x is not None and isinstance(parent, ast.BinOp) and not _written_out(c, parents) and not _set_on(stmt)
                    and not _only_written_out(tree, stmt)):
                out[id(p)] = (f"`{ast.unparse(parent)}` at line {line} computes with the number fetched: keep it on "
                              f"the device, `{x}.detach()` in place of `{ast.unparse(c)}` (the same value, with no "
                              "gradient through it, as the number had none)")
                break
    return out


def _set_on(stmt: ast.stmt) -> bool:
    """An assignment into an object or a dict (`group["lr"] = 0.05 * float(scale)`): a setting its
    reader may need as a host number (an optimizer's learning rate)."""
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return any(isinstance(t, (ast.Subscript, ast.Attribute)) for t in targets)


def _only_written_out(tree: ast.Module, stmt: ast.stmt) -> bool:
    """Whether `stmt` assigns one name that the code after it in its function (or module) reads,
    and only to write it out (`_written_out`): the number is logged, not computed with."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    name, end = stmt.targets[0].id, stmt.end_lineno or stmt.lineno
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
              and _spans(n, stmt.lineno)]
    scope = max(scopes, key=lambda n: n.lineno) if scopes else tree  # the innermost
    parents = {child: node for node in ast.walk(scope) for child in ast.iter_child_nodes(node)}
    reads = [n for n in ast.walk(scope) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
             and n.lineno > end]
    return bool(reads) and all(_given_out(n, parents) for n in reads)


def _given_out(node: ast.AST, parents: dict) -> bool:
    """Whether `node` is itself what an output call writes (`print(x)`, `log({"loss": x})`,
    `f"{x:.4f}"`, `"%.4f" % x`), not an operand of arithmetic whose result is written
    (`losses.append(-log_prob * advantage)` computes with `advantage`)."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, (ast.FormattedValue, ast.JoinedStr)):
            return True
        if isinstance(parent, ast.Call):
            f = parent.func
            return node is not f and (f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name)
                                      else None) in _OUTPUT
        if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Mod) and isinstance(parent.left, ast.Constant) \
                and isinstance(parent.left.value, str):
            return True  # ("%.4f" % x: a format)
        if not isinstance(parent, (ast.Dict, ast.Tuple, ast.List, ast.keyword)):
            return False
        node = parent
    return False


def _written_out(node: ast.AST, parents: dict) -> bool:
    """Whether `node` sits in a call that writes values out (print, a logger, a list of values) or
    in a formatted string."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.JoinedStr):
            return True
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in _OUTPUT:
                return True
    return False


def stop_tests(places: list[Any]) -> dict[int, str]:
    """{id(place): advice} for the places whose number a loop's stop test reads: `loss =
    out.item()`, then `if loss < tol: break` further down the same loop (pytorch/examples'
    regression), or the fetch in the test itself (`if decoder_input.item() == EOS_token: break`,
    pytorch/tutorials' seq2seq translation; `while err.item() > tol:`). Logging less often is not
    its fix: the test needs the number. Testing every N rounds does, and the loop may then run up to
    N-1 rounds past where it stopped: the advice says so. A loop that goes round more than once a
    step (a decoder's tokens) is advised in its rounds, with the mask that keeps what the extra
    rounds add out; the step's own loop in steps."""
    out: dict[int, str] = {}
    for p, tree in _fetch_trees(places):
        found = _stop_test(tree, p.where.line)
        if found is None:
            continue
        loop, test = found
        steps = len(getattr(p, "steps", ()) or ())
        rounds = getattr(p, "count", 0) / steps if steps else 1.0
        words = "`while " if isinstance(test, ast.While) else "`if "
        words += f"{ast.unparse(test.test)}` at line {test.lineno}"
        fetched = ("fetches its number from the device" if _spans(test.test, p.where.line)
                   else f"reads the number fetched at line {p.where.line}")
        if rounds < 1.5:
            out[id(p)] = (f"the loop's stop test {words} {fetched} every step: fetch and test it every N steps "
                          "instead (the loop may then run up to N-1 steps past where it stops now), or train for a "
                          "set number of steps")
        else:
            out[id(p)] = (f"the stop test {words} {fetched} each time the loop at line {loop.lineno} goes round "
                          f"({_per_round(rounds)} times a step where it runs), and each fetch waits for the device's "
                          "queued work: test it every N rounds instead, or run the loop its set number of rounds "
                          "with the stop kept on the device as a mask (`done = done | stop`, what each round adds "
                          "weighted by `~done`); either way rounds run past where it stops now: mask out what they "
                          "add to keep what it computes (a dropout in them draws from the random stream, so later "
                          "draws differ)")
    return out


def _per_round(rounds: float) -> str:
    return f"{rounds:.1f}".rstrip("0").rstrip(".")


def _stop_test(tree: ast.Module, line: int) -> tuple[ast.For | ast.While, ast.If | ast.While] | None:
    """(the loop, its stop test) where the number fetched at `line` decides whether the loop goes on:
    the test of a `while`, or of an `if` whose body breaks, holds the fetch itself, or the fetch
    is assigned to a name such a test further down the innermost loop reads."""
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While)) and _spans(n, line)]
    if not loops:
        return None
    loop = max(loops, key=lambda n: n.lineno)  # the innermost
    if isinstance(loop, ast.While) and _spans(loop.test, line):
        return loop, loop
    for test in _own_ifs(loop):
        if any(isinstance(b, ast.Break) for b in test.body) and _spans(test.test, line):
            return loop, test
    stmt = _statement(tree, line)
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return None
    name = stmt.targets[0].id
    for test in _own_ifs(loop):
        if (test.lineno > stmt.lineno and any(isinstance(b, ast.Break) for b in test.body)
                and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(test.test))):
            return loop, test
    return None


def _own_ifs(loop: ast.For | ast.While) -> list[ast.If]:
    """The `if` statements of the loop's own body, not of a loop or function inside it (a `break`
    in one of them ends this loop), in the order of their lines."""
    found, todo = [], list(loop.body) + list(loop.orelse)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                             ast.Lambda)):
            continue
        if isinstance(node, ast.If):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def _spans(node: ast.AST, line: int) -> bool:
    return node.lineno <= line <= (node.end_lineno or node.lineno)
