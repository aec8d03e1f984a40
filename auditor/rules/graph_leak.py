"""graph-leak: tensors carrying autograd history survive from step to step, so graphs pile up."""
from __future__ import annotations

import ast
from typing import Any, Iterable

from auditor.evidence import model as m
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Edit, Finding, Fix, Location
from auditor.rules._support.holders import holder_key, holder_label
from auditor.rules._support.scans import spread_scans
from auditor.fixes import binds_torch, parse_file


def _constructs(node: ast.AST) -> bool:
    """`Transition(obs, logp, r)`: a call of a capitalised name makes an object (a row), not a tensor."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return name[:1].isupper()


def _accumulates(node: ast.Assign) -> bool:
    """`x = x + e` (or `- e`), `stats["loss"] = stats["loss"] + loss`: a running total, patched as
    `x += e` is (`e.detach()`: its value is unchanged), not as a recurrent state `h = f(h)`."""
    v = node.value
    return (len(node.targets) == 1 and isinstance(v, ast.BinOp) and isinstance(v.op, (ast.Add, ast.Sub))
            and ast.unparse(v.left) == ast.unparse(node.targets[0]))


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _row_items(value: ast.expr, rows: dict[str, Any]) -> list[ast.expr] | None:
    """The expressions of a pushed row that hold its graphs, as the scan saw the rows (`rows`: the
    tuple positions, dict keys or dataclass fields with a grad_fn): `value` in `(s, a, r, value)`,
    `{"v": value}`, `Transition(obs, logp, 1.0)`. None when the row as spelled here cannot be
    matched to that (a `*rest`, another length, a key from `**extra`, a graph nested deeper)."""
    graph, kind, fields = rows.get("graph") or [], rows.get("kind"), rows.get("fields")
    if not graph or rows.get("nested"):
        return None
    if kind == "tuple" and isinstance(value, (ast.Tuple, ast.List)):
        elts = value.elts
        if any(isinstance(e, ast.Starred) for e in elts) or rows.get("size") not in (None, len(elts)) \
                or not all(isinstance(i, int) and i < len(elts) for i in graph):
            return None
        return [elts[i] for i in graph]
    if kind == "dict" and isinstance(value, ast.Dict):
        by_key = {k.value: v for k, v in zip(value.keys, value.values) if isinstance(k, ast.Constant)}
        return [by_key[k] for k in graph] if all(k in by_key for k in graph) else None
    if isinstance(value, ast.Call) and _constructs(value) and fields and rows.get("class") == _callee(value):
        # a namedtuple or a dataclass: its fields are the constructor's parameters, in order
        if any(isinstance(a, ast.Starred) for a in value.args) or any(k.arg is None for k in value.keywords):
            return None
        keywords = {k.arg: k.value for k in value.keywords}
        out = []
        for part in graph:
            name = fields[part] if isinstance(part, int) and part < len(fields) else part
            if name not in fields:
                return None
            i = fields.index(name)
            arg = value.args[i] if i < len(value.args) else keywords.get(name)
            if arg is None:
                return None
            out.append(arg)
        return out
    return None


def _with_detach(file: str, lines: list[str], start: int, end: int, exprs: list[ast.expr]) -> Edit:
    """Lines start..end with `.detach()` after each of `exprs` (parenthesised first unless a single
    term: `(a + b).detach()`). Columns are UTF-8 byte offsets, as ast gives them."""
    text = [ln.encode() for ln in lines[start - 1:end]]
    for e in sorted(exprs, key=lambda e: (e.lineno, e.col_offset), reverse=True):
        simple = isinstance(e, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
        i, j = e.end_lineno - start, e.lineno - start  # type: ignore[operator]
        text[i] = text[i][:e.end_col_offset] + (b".detach()" if simple else b").detach()") + text[i][e.end_col_offset:]
        if not simple:
            text[j] = text[j][:e.col_offset] + b"(" + text[j][e.col_offset:]
    return Edit(file=file, start=start, end=end, lines=[t.decode() for t in text])


def _detach_edit(file: str, line: int, rows: dict[str, Any] | None = None) -> tuple[Edit | None, bool]:
    """(edit, changes_numerics): `x += e` -> `x += e.detach()`, `xs.append(e)` -> `xs.append(e.detach())`,
    `h = f(h)` -> `h = f(h).detach()` (that last one truncates backprop through time: numerics change);
    an in-place update (`self.rm.mul_(0.9).add_(0.1 * m)`) goes under `torch.no_grad()` on its line,
    as running statistics are updated (numerics change: its history is cut). A row pushed into a
    buffer (`rows`: where the scan saw its graphs) has just those items detached:
    `xs.append((s, a, r, value.detach()))`, `{"v": value.detach()}`; a row pushed whole by name
    (`self.items.append(row)`) has nothing to detach at that line."""
    parsed = parse_file(file)
    if parsed is None:
        return None, False
    tree, lines = parsed
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) != line or not isinstance(node, ast.stmt):
            continue
        text = lines[line - 1]
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and node.value.args \
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr in ("append", "insert"):
            value = node.value.args[-1]
            if rows is not None:  # the buffer's items are rows, not tensors
                items = _row_items(value, rows)
                return (_with_detach(file, lines, line, node.end_lineno or line, items) if items else None), False
            numerics = False
        elif isinstance(node, ast.Assign) and rows is not None and all(isinstance(t, ast.Subscript) for t in node.targets):
            items = _row_items(node.value, rows)  # `cache[i] = (x, out)`: a row stored by key
            return (_with_detach(file, lines, line, node.end_lineno or line, items) if items else None), False
        elif getattr(node, "end_lineno", None) != line:
            continue
        elif isinstance(node, ast.AugAssign):
            value, numerics = node.value, False
        elif isinstance(node, ast.Assign) and _accumulates(node):
            value, numerics = node.value.right, False  # `x = x + e` is `x += e`
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, (ast.Tuple, ast.List)) for t in node.targets):
                return None, False  # (`out, h = rnn(x, h)`: the call returns a tuple, which has no .detach())
            value, numerics = node.value, True
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr.endswith("_"):
            if not binds_torch(lines):
                return None, False  # (`torch.no_grad` would not be defined in this file)
            indent = text[:len(text) - len(text.lstrip())]
            return Edit(file=file, start=line, end=line,
                        lines=[f"{indent}with torch.no_grad(): {text.lstrip()}"]), True
        else:
            continue
        if isinstance(value, (ast.Tuple, ast.List, ast.Dict, ast.Set)) or _constructs(value):
            return None, False  # a row of a buffer: its items may be numbers, which have no .detach()
        if value.end_lineno != line:
            return None, False
        return _with_detach(file, lines, line, line, [value]), numerics
    return None, False


def _placed_edit(h: dict, edit: Edit | None, changes: bool, used: list[str], edits: list[Edit]) -> bool:
    """Keep the edit of one line that stores into holder `h` (whether it changes numerics), unless a
    later backward runs through what `h` keeps: its graphs are used, and a `.detach()` where they
    are stored is no fix that leaves results alone (cutting a recurrent state's history, which does
    change them, is still marked as one that changes results)."""
    if h.get("backpropagated") and not (edit and changes):
        if h["name"] not in used:
            used.append(h["name"])
        return False
    if edit:
        edits.append(edit)
    return bool(edit) and changes


def _holder_names(holders: list[dict]) -> str:
    """`total`, `model.1.running_mean`; parameters given a history are counted per global, as
    "`ema`'s parameters (161)": an EMA of a ResNet would otherwise list every one."""
    params: dict[str, int] = {}
    at: dict[str, str] = {}
    names = []
    for h in holders:
        if h.get("kind") == "Parameter" and "." in h["name"]:
            root = h["name"].split(".", 1)[0]
            if root not in params:
                names.append(root)
            params[root] = params.get(root, 0) + 1
        else:
            names.append(holder_label(h))
            if h.get("stores"):  # filled at several lines: each named
                at[names[-1]] = f" (stored into at lines {', '.join(str(w['line']) for w in h['stores'])})"
    return ", ".join(f"`{n}`'s parameters ({params[n]})" if n in params else f"{n}{at.get(n, '')}" for n in names)


# Why a leak's fix has no time saving to predict: `.detach()` (or a step under torch.no_grad())
# takes no kernel, copy or sync out of the step; each kept operation stops recording one autograd
# node, a few microseconds of host time (a CPU loop of the README demo's step timed `total += loss`
# the same with and without it, within the timer's noise)
NO_TIME_SAVED = ("what its fix saves is memory, the graphs kept alive: it takes no kernel, copy or sync out of the "
                 "step, only the autograd node each kept operation records (microseconds)")


class GraphLeak(Rule):
    """
    What it detects:
        Non-leaf tensors (tensors with a grad_fn) that are still alive after a step returns, and an
        autograd graph behind them that grows from one step boundary to the next: a running loss
        kept as a tensor (`total += loss`), outputs appended to a list without `.detach()`, a
        recurrent state carried across steps without detaching, a module buffer updated in
        `forward` outside `torch.no_grad()` (`self.running_mean = 0.9 * self.running_mean + 0.1 * m`,
        or in place: `self.running_mean.mul_(0.9).add_(0.1 * m)`), the parameters of a hand-written
        EMA updated in place outside `torch.no_grad()` (`e.mul_(d).add_(p, alpha=1 - d)`: each
        update chains onto the last). Modules are found in the target's globals, their attributes,
        and lists, tuples and dicts of them (`nets = [G, D]`). And a step that dies of "Trying to
        backward through the graph a second time" while such state holds a tensor with history:
        the state carried an earlier step's graph into this step's backward.

    Why it costs:
        Each step's whole graph, with the activations it saved, stays reachable from the survivor.
        Memory grows every step until the run dies of OOM, and any backward through the chain gets
        slower every step.

    Example:
        bad:   running_loss += loss              # keeps every step's graph
        good:  running_loss += loss.detach()     # or loss.item() when you log

    Fix:
        Detach what you keep: `.detach()` (stays on device, no sync) or `.item()` when logging;
        update a module's running statistics under `torch.no_grad()`.
        The patch adds `.detach()` at the line that grows the holder (for a module's attribute,
        the line of its class that assigns `self.<attr>`); an in-place update of a module's
        attribute is put under `torch.no_grad()` on its line. A row pushed into a buffer has only
        the items that carry a graph detached: `buf.append((s, a, r, value.detach()))`,
        `{"v": value.detach()}`, `Transition(obs, logp.detach(), r)` (a namedtuple or dataclass).
        No patch where a later backward runs through what the holder keeps (an episode's loss over
        its stored log-probs): those graphs are used, and detaching them would change the gradients.

    Evidence needed:
        A run: scans of live tensors with a grad_fn at three or more step boundaries (graph size
        per scan: growth between two is not yet a trend, and is reported as not judged) and the module globals holding them, including buffers and tensor attributes of the
        nn.Modules among them (named by module path: `model.1.running_mean`); for a buffer of rows,
        which tuple positions, keys or fields hold the graphs; whether a backward ran through a
        holder's tensors after a scan saw them.
    """

    id = "graph-leak"
    title = "Autograd graphs survive across steps and pile up"
    severity = "warning"
    category = "memory"
    needs = frozenset({"run"})
    options = (Option("min-nodes-per-step", 1.0, "Graph growth (autograd nodes per step) that counts as a leak."),)

    def skip_reason(self, ev: m.Evidence) -> str | None:
        if len(ev.graph_scans) >= 3 or _freed_graph_scan(ev):
            return None
        if len(ev.graph_scans) == 2:
            return _two_scans(ev.graph_scans)
        if ev.steps and ev.steps[-1].index + 1 < ev.requested_steps:  # (the run ended early)
            scanned = ", ".join(str(s.after_step) for s in ev.graph_scans) or "none"
            return (f"needs graph scans at three or more step boundaries; the run ended in step {ev.steps[-1].index} "
                    f"of {ev.requested_steps}, before its second scan (scanned after step: {scanned})")
        return "needs graph scans at three or more step boundaries (run >= 3 steps)"

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        failed = _freed_graph_scan(ev)
        if failed is not None:
            yield self._freed(ev, failed)
        if len(ev.graph_scans) < 3:
            return
        scans = spread_scans(ev.graph_scans)
        nodes = [s.graph_nodes for s in scans]
        if not all(b > a for a, b in zip(nodes, nodes[1:])):
            return
        span = scans[-1].after_step - scans[0].after_step
        rate = (nodes[-1] - nodes[0]) / span if span else 0.0
        if rate < options.min_nodes_per_step:
            return
        first_holders = {holder_key(h): h for h in scans[0].holders}
        growing = [h for h in scans[-1].holders
                   if h.get("nodes", 0) > first_holders.get(holder_key(h), {}).get("nodes", 0)]
        locs, edits, numerics, used, placed = [], [], False, [], set()
        for h in growing:
            # each line that stores a graph into the holder (a dict filled at several lines), else its one line
            stores = h.get("stores") or [{**w, "rows": h.get("rows")}] if (w := h.get("where")) else []
            if not stores and h.get("backpropagated"):
                used.append(h["name"])
            for w in stores:
                if (w["file"], w["line"]) in placed:  # (an EMA's parameters share their update's line)
                    continue
                placed.add((w["file"], w["line"]))
                locs.append(Location(file=w["file"], line=w["line"], code=w.get("code", "")))
                edit, changes = _detach_edit(w["file"], w["line"], w.get("rows"))
                numerics = _placed_edit(h, edit, changes, used, edits) or numerics
        names = _holder_names(growing) or "tensors outside the target module's globals (and the modules they reach)"
        summary = "Detach what you keep across steps (`.detach()`, or `.item()` when logging)."
        if used:
            summary += (f" But a later backward ran through what {', '.join(f'`{n}`' for n in used)} "
                        f"{'keeps' if len(used) == 1 else 'keep'}: those graphs are used, and `.detach()` where "
                        f"they are stored would change the gradients, so no patch is offered there. Let go of "
                        f"each once the backward that uses it has run (clear the buffer after it), or keep a "
                        f"bounded window.")
        yield self.finding(
            "Steps keep old autograd graphs alive: detach what you store. "
            f"Autograd graphs kept alive across steps grew from {nodes[0]} to {nodes[-1]} nodes between steps "
            f"{scans[0].after_step} and {scans[-1].after_step} ({rate:.1f} nodes per step), held by {names}.",
            locations=locs,
            evidence={"scans": [{"after_step": s.after_step, "tensors": s.tensors, "graph_nodes": s.graph_nodes}
                                for s in sorted(ev.graph_scans, key=lambda s: s.after_step)],
                      "compared_steps": [s.after_step for s in scans],
                      "nodes_per_step": round(rate, 2),
                      "holders": [{"name": h["name"], "kind": h["kind"], "tensors": h["tensors"], "nodes": h["nodes"],
                                   **({"function": h["function"]} if h.get("function") else {}),
                                   **({"rows": h["rows"]} if h.get("rows") else {}),
                                   **({"lines": [w["line"] for w in h["stores"]]} if h.get("stores") else {}),
                                   "backpropagated": bool(h.get("backpropagated"))}
                                  for h in growing]},
            cost=Cost(ms_per_step=None, share_of_step=None, measured=False, note=NO_TIME_SAVED),
            fix=Fix(summary=summary, edits=edits, changes_numerics=numerics),
        )

    def _freed(self, ev: m.Evidence, scan: m.GraphScan) -> Finding:
        """A step that died of "Trying to backward through the graph a second time" while module
        state held tensors with autograd history: the state carried one step's graph into the next
        step's backward, which met it freed. One scan is proof enough: the error says what a
        growing graph would only have suggested."""
        holders = [h for h in scan.holders if h.get("graph_tensors")]
        locs, placed = [], set()
        for h in holders:
            w = h.get("where")
            if w and (w["file"], w["line"]) not in placed:
                placed.add((w["file"], w["line"]))
                locs.append(Location(file=w["file"], line=w["line"], code=w.get("code", "")))
        names = _holder_names(holders)
        return self.finding(
            "A tensor carried to the next step keeps its graph: detach it. "
            f"Step {scan.after_step}'s backward ran into a graph an earlier backward had already freed (\"Trying to "
            f"backward through the graph a second time\"): {names} carr{'ies' if len(holders) == 1 else 'y'} a "
            "tensor with autograd history from one step into the next.",
            locations=locs,
            evidence={"step": scan.after_step, "exception": ev.ending.exception,
                      "holders": [{"name": h["name"], "kind": h["kind"], "tensors": h["tensors"],
                                   "graph_tensors": h["graph_tensors"], "nodes": h["nodes"]} for h in holders]},
            cost=None,
            fix=Fix(summary="Detach what the step carries over to the next at the step boundary (`h = h.detach()`; "
                            "an LSTM's state is a pair: detach both h and c). retain_graph=True would silence the "
                            "error but backpropagate through every earlier step, and fail once the optimizer has "
                            "changed weights those steps saved."))


SECOND_TIME = "backward through the graph a second time"


def _freed_graph_scan(ev: m.Evidence) -> m.GraphScan | None:
    """The scan after a step that died backpropagating into a freed graph, when module state held
    tensors with autograd history then."""
    e = ev.ending
    if e.status != "raised" or SECOND_TIME not in (e.message or ""):
        return None
    return next((s for s in ev.graph_scans if s.failed and s.after_step == e.step
                 and any(h.get("graph_tensors") for h in s.holders)), None)


def _two_scans(scans: list[m.GraphScan]) -> str | None:
    """Two scans say nothing of a trend: graphs a step keeps once (the last loss, a window of the
    last few outputs, the first step's lazily made state) grow between the first two boundaries
    and then stay. Growth needs a third scan to confirm it; two that show none are judged (no
    leak), two that show growth are reported as not judged."""
    a, b = sorted(scans, key=lambda s: s.after_step)
    if b.graph_nodes <= a.graph_nodes:
        return None
    return (f"could not be judged from two graph scans: kept graphs grew from {a.graph_nodes} to {b.graph_nodes} "
            f"nodes between steps {a.after_step} and {b.after_step}, and a third scan is needed to tell growth "
            f"that goes on from graphs kept once (run more steps: scans run after steps 1, 4, 16, ..., the middle "
            f"and the last)")
