"""Edits that move per-step work where it costs less: a logging statement run every N steps, a
Dataset's device copy moved out of `__getitem__` (dataset_copy_out); and what loop, if any, runs a
line many times a step (what launch-bound's advice follows).

`every_n_steps` guards a statement that only writes out (print, a logger, a progress bar, a writer's
add_scalar) with `if i % N == 0:`, where `i` is the counter of the loop the statement runs in: `for
i in range(...)`, `for i, batch in enumerate(...)`, or either wrapped in a progress bar
(`tqdm(range(...))`, `trange(...)`), the innermost such loop whose body takes the optimizer step
(calls `.step()`): a gradient-accumulation loop inside it restarts each step. The statement's values
are then fetched from the device at one step in N. Nothing else changes: the statement computes
nothing the program reads afterwards (an expression statement whose result is dropped), so the
training does the same work.

No edit when the statement shares a line with another, spans lines holding a string (its text would
be re-indented), is not an output call, or has no such loop around it within its function (a closure
called by an optimizer has none: its loop is another function's).
"""
from __future__ import annotations

import ast

from auditor.findings import Edit

# Calls whose only effect is to write values out: the last name of the called expression.
OUTPUT_CALLS = frozenset({"print", "info", "debug", "warning", "log", "write", "set_postfix", "set_description",
                          "add_scalar", "add_scalars", "log_metrics", "log_dict"})
_RANGES = frozenset({"range", "trange", "enumerate", "count"})


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _counter(loop: ast.For) -> str | None:
    """The step counter a `for` loop binds: `i` of `for i in range(n)`, `for i, b in enumerate(xs)`,
    `for i in tqdm(range(n))` / `trange(n)` (None for any other loop)."""
    it = loop.iter
    while isinstance(it, ast.Call) and _name(it.func) in ("tqdm",) and it.args:  # a progress bar around it
        it = it.args[0]
    if not isinstance(it, ast.Call) or _name(it.func) not in _RANGES:
        return None
    if _name(it.func) == "enumerate":
        t = loop.target
        if isinstance(t, ast.Tuple) and t.elts and isinstance(t.elts[0], ast.Name):
            return t.elts[0].id
        return None
    return loop.target.id if isinstance(loop.target, ast.Name) else None


def _assigned_in(body: list[ast.stmt], name: str) -> bool:
    """Whether `name` is rebound inside the loop's body (then it is no step counter)."""
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
    return False


def _steps_in(body: list[ast.stmt]) -> bool:
    """Whether a loop's body takes an optimizer step (`.step()`): its counter counts steps, where an
    inner loop's (gradient accumulation, whose body runs backward) restarts each step."""
    return any(isinstance(n, ast.Call) and _name(n.func) == "step" for stmt in body for n in ast.walk(stmt))


def every_n_steps(file: str, line: int, n: int = 50) -> Edit | None:
    """The output statement spanning `line` guarded with `if COUNTER % n == 0:` (see the module's
    docstring), or None where that is not known to be safe."""
    from auditor.fixes import parse_file

    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, lines = parsed
    stmts = [s for s in ast.walk(tree) if isinstance(s, ast.stmt) and not hasattr(s, "body")
             and s.lineno <= line <= (s.end_lineno or s.lineno)]
    if len(stmts) != 1 or not isinstance(stmts[0], ast.Expr) or not isinstance(stmts[0].value, ast.Call):
        return None
    stmt = stmts[0]
    if _name(stmt.value.func) not in OUTPUT_CALLS:
        return None
    start, end = stmt.lineno, stmt.end_lineno or stmt.lineno
    if lines[start - 1][:stmt.col_offset].strip() or lines[end - 1][stmt.end_col_offset or 0:].split("#")[0].strip():
        return None  # another statement or a block's header shares its lines
    if end > start and any(isinstance(c, (ast.Constant, ast.JoinedStr)) and c.lineno != (c.end_lineno or c.lineno)
                           for c in ast.walk(stmt)):
        return None  # a string across lines: indenting it would change its text
    parents = _parents(tree)
    node: ast.AST = stmt
    counter = None
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return None  # the loop around it is another function's
        if isinstance(node, ast.For):
            counter = _counter(node)
            if counter is not None and _steps_in(node.body) and not _assigned_in(node.body, counter):
                break
            counter = None
    if counter is None:
        return None
    indent = lines[start - 1][:stmt.col_offset]
    unit = "\t" if "\t" in indent else "    "
    body = [unit + ln if ln.strip() else ln for ln in lines[start - 1:end]]
    return Edit(file=file, start=start, end=end, lines=[f"{indent}if {counter} % {n} == 0:", *body])


def loop_around(file: str, line: int) -> str | None:
    """What runs the statement on `line` many times in one call of its function: "parameters" for
    a `for` loop over `.parameters()` / `.named_parameters()` / `param_groups` (an update per
    parameter), "layers" when only loops over a module's own submodules do (`for layer in
    self.layers`, `enumerate(self.blocks)`: each round runs other weights, nothing to batch), "loop"
    for any other `for`/`while` loop or comprehension around it in its function, None when none
    does (a line run once per call, such as a forward's elementwise ops) or the file cannot be read."""
    from auditor.fixes import parse_file

    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, _ = parsed
    parents = _parents(tree)
    stmts = [s for s in ast.walk(tree) if isinstance(s, ast.stmt) and s.lineno <= line <= (s.end_lineno or s.lineno)]
    if not stmts:
        return None
    node: ast.AST = max(stmts, key=lambda s: s.lineno)  # the innermost statement spanning the line
    found = None
    for inner in ast.walk(node):  # a comprehension on the line itself
        if isinstance(inner, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) and inner.lineno <= line:
            found = "loop"
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)):
            break
        if isinstance(node, ast.For):
            names = {_name(n.func) for n in ast.walk(node.iter) if isinstance(n, ast.Call)}
            names |= {n.attr for n in ast.walk(node.iter) if isinstance(n, ast.Attribute)}
            if names & {"parameters", "named_parameters", "param_groups"}:
                return "parameters"
            found = "layers" if _over_submodules(node.iter) and found in (None, "layers") else "loop"
        elif isinstance(node, ast.While):
            found = "loop"
    return found


def _over_submodules(it: ast.expr) -> bool:
    """An iterable of a module's own attributes: `self.layers`, `self.transformer.h`, and those in
    `enumerate`, `zip` or `reversed`."""
    if isinstance(it, ast.Call) and _name(it.func) in ("enumerate", "zip", "reversed") and it.args:
        return all(_over_submodules(a) for a in it.args)
    while isinstance(it, ast.Attribute):
        it = it.value
    return isinstance(it, ast.Name) and it.id == "self"


# --- a Dataset's device copy moved out of __getitem__ -------------------------------------------

_COPIES = ("cuda", "to")


def _module_names(tree: ast.Module) -> set[str]:
    """The names bound at the module's top level (assignments, imports, defs): what code anywhere
    in the file may read."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
    return out


def _bound_once(tree: ast.Module, name: str) -> ast.expr | None:
    """The value `name` is given by its only binding, a plain `name = value` (None otherwise)."""
    stores = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)]
    assigns = [a for a in ast.walk(tree) if isinstance(a, ast.Assign) and len(a.targets) == 1
               and isinstance(a.targets[0], ast.Name) and a.targets[0].id == name]
    return assigns[0].value if len(stores) == 1 and len(assigns) == 1 else None


def _passes_items(tree: ast.Module, name: str) -> bool:
    """Whether `name` is a generator defined in the file that yields its one argument's items as
    they are (`def cycle(dl): while True: for x in dl: yield x`)."""
    fn = next((f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == name), None)
    if fn is None or len(fn.args.args) != 1:
        return False
    param = fn.args.args[0].arg
    loops = {f.target.id for f in ast.walk(fn) if isinstance(f, ast.For) and isinstance(f.iter, ast.Name)
             and f.iter.id == param and isinstance(f.target, ast.Name)}
    yields = [y for y in ast.walk(fn) if isinstance(y, (ast.Yield, ast.YieldFrom))]
    return bool(yields) and all(isinstance(y, ast.Yield) and isinstance(y.value, ast.Name) and y.value.id in loops
                                for y in yields)


def _loads(tree: ast.Module, name: str) -> list[ast.Name]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]


def dataset_copy_out(file: str, line: int) -> list[Edit] | None:
    """The edits moving the device copy a Dataset's `__getitem__` returns (`return x.cuda()`, or
    `.to(device)` with a device any line of the file can name) to where its items are used: each
    `next(loader)` of a DataLoader over it (directly, or through a generator of the file that
    yields the loader's batches as they are, such as `cycle`) copies the batch, pinned
    (`pin_memory=True` on the DataLoader, `non_blocking=True` on the copy); each `for b in loader`
    copies `b` first thing in its body; each item read from the dataset itself (`ds[i]`,
    `random.choice(ds)`) is copied as `__getitem__` did. The values the program computes with are
    the same. None unless every use of the class, its datasets and their loaders is one of these
    (a collate_fn, a subclass, a loader passed elsewhere: no edit)."""
    from auditor.fixes import parse_file

    parsed = parse_file(file)
    if parsed is None:
        return None
    tree, lines = parsed
    parents = _parents(tree)
    found = _getitem_copy(tree, parents, line)
    if found is None:
        return None
    ret, copy, cls = found
    src = "\n".join(lines)
    whole, base = ast.get_source_segment(src, copy) or "", ast.get_source_segment(src, copy.func.value) or ""
    call_text = "." + whole[len(base):].lstrip(". \t")
    pinned_text = call_text[:-1] + (", " if copy.args else "") + "non_blocking=True)"
    # the class: only instantiated, each instance bound once
    if any(isinstance(c, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == cls.name for b in c.bases)
           for c in ast.walk(tree)):
        return None
    uses = _dataset_uses(tree, parents, cls, call_text, pinned_text)
    if uses is None:
        return None
    appends, inserts, loader_calls = uses
    if not loader_calls and not appends:
        return None
    return _copy_edits(file, lines, ret, copy, base, appends, inserts, loader_calls)


def _getitem_copy(tree: ast.Module, parents: dict[ast.AST, ast.AST],
                  line: int) -> tuple[ast.Return, ast.Call, ast.ClassDef] | None:
    """The `return x.cuda()` (or `.to(device)` with a device the module names) of a Dataset's
    `__getitem__` on `line`, and its class."""
    ret = next((r for r in ast.walk(tree) if isinstance(r, ast.Return) and r.lineno == line), None)
    if ret is None or not isinstance(ret.value, ast.Call) or not isinstance(ret.value.func, ast.Attribute):
        return None
    copy = ret.value
    fn, cls = parents.get(ret), None
    while fn is not None and not isinstance(fn, ast.FunctionDef):
        fn = parents.get(fn)
    cls = parents.get(fn) if fn is not None else None
    if fn is None or fn.name != "__getitem__" or not isinstance(cls, ast.ClassDef) or copy.func.attr not in _COPIES:
        return None
    known = _module_names(tree)
    if copy.keywords or any(not isinstance(a, ast.Constant) and not (isinstance(a, ast.Name) and a.id in known)
                            for a in copy.args):
        return None  # (a device read from `self` or the method's locals: not nameable outside it)
    return ret, copy, cls


def _dataset_uses(tree: ast.Module, parents: dict[ast.AST, ast.AST], cls: ast.ClassDef, call_text: str,
                  pinned_text: str) -> tuple[list[tuple[ast.expr, str]], list[tuple[ast.For, str]], list[ast.Call]] | None:
    """Where the copy goes at each use of the class's datasets and their loaders: (after an expression,
    first thing in a loop, the DataLoader calls to pin); None where a use is none of these."""
    appends: list[tuple[ast.expr, str]] = []  # (node, text to put after it)
    inserts: list[tuple[ast.For, str]] = []
    loader_calls: list[ast.Call] = []
    for use in _loads(tree, cls.name):
        made = parents.get(use)
        assign = parents.get(made)
        if not (isinstance(made, ast.Call) and made.func is use and isinstance(assign, ast.Assign)
                and len(assign.targets) == 1 and isinstance(assign.targets[0], ast.Name)):
            return None
        dataset = assign.targets[0].id
        if _bound_once(tree, dataset) is not made:
            return None
        for d in _loads(tree, dataset):
            p = parents.get(d)
            if isinstance(p, ast.Call) and _name(p.func) == "len":
                continue
            if isinstance(p, ast.Subscript) and p.value is d:
                appends.append((p, call_text))
                continue
            if isinstance(p, ast.Call) and _name(p.func) == "choice" and p.args == [d]:
                appends.append((p, call_text))
                continue
            if not (isinstance(p, ast.Call) and _name(p.func) == "DataLoader" and p.args and p.args[0] is d
                    and not any(k.arg in ("collate_fn", None) for k in p.keywords)):
                return None
            loader_calls.append(p)
            holder = parents.get(p)
            if isinstance(holder, ast.Call) and holder.args == [p] and _passes_items(tree, _name(holder.func) or ""):
                holder_value, holder = holder, parents.get(holder)
            else:
                holder_value = p
            if not (isinstance(holder, ast.Assign) and len(holder.targets) == 1
                    and isinstance(holder.targets[0], ast.Name)):
                return None
            loader = holder.targets[0].id
            if _bound_once(tree, loader) is not holder_value:
                return None
            for u in _loads(tree, loader):
                q = parents.get(u)
                if isinstance(q, ast.Call) and _name(q.func) == "next" and q.args == [u]:
                    appends.append((q, pinned_text))
                    continue
                loop = q if isinstance(q, ast.For) and q.iter is u else None
                if loop is None and isinstance(q, ast.Call) and _name(q.func) == "enumerate" and q.args == [u] \
                        and isinstance(parents.get(q), ast.For) and parents[q].iter is q:
                    loop = parents[q]
                target = loop.target if loop is not None else None
                if isinstance(target, ast.Tuple) and q is not u and len(target.elts) == 2:
                    target = target.elts[1]
                if loop is None or not isinstance(target, ast.Name):
                    return None
                inserts.append((loop, f"{target.id} = {target.id}{pinned_text}"))
    return appends, inserts, loader_calls


def _copy_edits(file: str, lines: list[str], ret: ast.Return, copy: ast.Call, base: str,
                appends: list[tuple[ast.expr, str]], inserts: list[tuple[ast.For, str]],
                loader_calls: list[ast.Call]) -> list[Edit] | None:
    """The text edits: the return loses its copy; each use gains one (line by line, from the right)."""
    from auditor.fixes import edit_call_kwargs

    new_lines = list(lines)
    spans = [(ret.lineno, copy.col_offset, copy.end_col_offset, base)]
    spans += [(n.end_lineno, n.end_col_offset, n.end_col_offset, text) for n, text in appends]
    if any(copy.lineno != copy.end_lineno or n.lineno != n.end_lineno for n, _ in [(copy, "")] + appends):
        return None
    for ln, a, b, text in sorted(spans, key=lambda s: (s[0], s[1]), reverse=True):
        raw = new_lines[ln - 1].encode("utf-8")  # (ast's columns are UTF-8 byte offsets)
        new_lines[ln - 1] = (raw[:a] + text.encode("utf-8") + raw[b:]).decode("utf-8")
    edits = [Edit(file=file, start=i, end=i, lines=[new]) for i, (old, new) in enumerate(zip(lines, new_lines), 1)
             if old != new]
    for loop, text in inserts:
        first = loop.body[0]
        if lines[first.lineno - 1][:first.col_offset].strip():
            return None  # (`for b in dl: step(b)`: the body shares the header's line)
        edits.append(Edit(file=file, start=first.lineno, end=first.lineno - 1,
                          lines=[lines[first.lineno - 1][:first.col_offset] + text]))
    for dl in loader_calls:
        pin = edit_call_kwargs(file, dl.lineno, ("DataLoader",), {"pin_memory": "True"})
        if pin is not None:
            if any(e.start <= pin.end and pin.start <= e.end for e in edits):
                return None
            edits.append(pin)
    return sorted(edits, key=lambda e: (e.start, e.end))
