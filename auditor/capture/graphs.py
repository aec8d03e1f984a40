"""Graph-leak evidence: tensors that carry autograd history and outlive the step that made them.

Right after a step returns, its locals are gone; any non-leaf tensor still alive is held by module
state (a running loss kept as a tensor, outputs appended to a list). If the autograd graph reachable
from those tensors keeps growing from one step boundary to the next, graphs are piling up.
A full scan walks every gc-tracked object (50-100 ms with torch imported), so scans run at a few
sampled boundaries only, and the middle one of a long run reads the named holders only once the
full scans before it found every tensor with history under a name (ScanMemo: 3-10 ms).

State kept inside an nn.Module is module state too: a buffer updated in `forward` without
`torch.no_grad()` (`self.running_mean = 0.9 * self.running_mean + 0.1 * m`) holds a graph per step,
and a queue kept as a buffer (`self.queue = torch.cat([self.queue, k])`) grows without bound. So
modules reachable from the globals are walked too, and their holders are named by module path
(`model.1.running_mean`), with the line of the module's own class that grows them.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import os
import sys
import types
import weakref
from collections import deque
from typing import Any, Optional

import torch

from auditor.capture.frames import is_library, library_verdicts
from auditor.capture.growth_lines import attribute_line, mutation_keys, mutation_lines, parameter_update_lines
from auditor.capture.saved_tensors import saved_of
from auditor.capture.unseen import no_torch_function, untraced

_CONTAINERS = (list, tuple, dict, set, deque)


def _graph_size(tensors: list[torch.Tensor]) -> int:
    seen: set[int] = set()
    keep: list[Any] = []  # keep wrappers alive during the walk so ids stay unique
    stack = [t.grad_fn for t in tensors]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return len(seen)


def graph_bytes(tensors: list[torch.Tensor], budget: int = 200_000) -> int:
    """Bytes of the storages the graphs behind `tensors` saved for their backward, each storage
    once (up to `budget` nodes): what a holder of graph-carrying tensors keeps alive besides its
    own tensors. Saved values that saved-tensor hooks packed (activation checkpointing) are not
    read (`saved_tensors`): then a lower bound."""
    seen: set[int] = set()
    keep: list[Any] = []
    saved: list[torch.Tensor] = []
    stack = [t.grad_fn for t in tensors]
    while stack and len(seen) < budget:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        saved.extend(saved_of(node).tensors)
        stack.extend(n for n, _ in node.next_functions)
    return _nbytes([t for t in saved if not (t.is_leaf and t.requires_grad)])  # (parameters are no activations)


_DEPTH = 3  # a list of tuples of tensors is two levels down; one more for a list inside a row
_BUDGET = 2_000_000  # items looked at per holder: a scan stays well under a second


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors held directly or inside containers a few levels down: a replay buffer is a list (or
    deque) of (obs, action, log_prob) tuples, of dicts, or of small objects, not of bare tensors.
    Parameters are left out unless they carry a history (a list of EMA weights updated in place
    outside `torch.no_grad()`)."""
    out: list[torch.Tensor] = []
    stack = [(value, 0)]
    seen: set[int] = set()
    budget = _BUDGET
    while stack and budget > 0:
        v, depth = stack.pop()
        t = type(v)
        if t is torch.Tensor:  # (exact types first: isinstance of Parameter runs its metaclass's Python)
            out.append(v)
            continue
        if t is torch.nn.Parameter or isinstance(v, torch.Tensor):
            if not isinstance(v, torch.nn.Parameter) or v.grad_fn is not None:
                out.append(v)
            continue
        if depth >= _DEPTH or id(v) in seen:
            continue
        seen.add(id(v))
        # (each container copied in C before it is walked: the program's other threads, or its own
        # trace function called by the walk, may change it meanwhile)
        if isinstance(v, dict):
            items: Any = list(v.values())
        elif isinstance(v, _CONTAINERS):
            items = list(v)
        elif depth and not isinstance(v, (torch.nn.Module, type, types.ModuleType, types.FunctionType)) \
                and isinstance(getattr(v, "__dict__", None), dict):
            items = list(vars(v).values())  # a row that is an object (a dataclass Transition)
        else:
            continue
        for x in items:
            stack.append((x, depth + 1))
            budget -= 1
    return out


def _nbytes(tensors: list[torch.Tensor]) -> int:
    storages = {}
    for t in tensors:
        try:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return sum(storages.values())


# nn.Module's own bookkeeping (hook dicts, the parameter/buffer/submodule tables): not user state,
# and the hook dicts hold the auditor's own hooks, whose objects must not be mistaken for holders.
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_PLAIN = frozenset((int, float, bool, str, bytes, type(None)))  # exact types: a set lookup, not isinstance

# name, kind, tensors, owner (class, attribute) or None, and the value itself (for its rows)
Holder = tuple[str, str, list[torch.Tensor], Optional[tuple[type, str]], Any]


def _may_hold_tensors(v: Any) -> bool:
    """Whether a module attribute is worth `_tensors_in`: a tensor, or a container with anything but
    numbers and strings in it. Most attributes are settings (a conv's `kernel_size`, `stride` and
    `padding` tuples), and `_tensors_in` costs ~5 us each: 1.5 ms for a ResNet-sized model, where
    these type checks cost a tenth of that. (An object at this level is not walked by
    `_tensors_in` either.)"""
    t = type(v)
    if t in _PLAIN:
        return False
    if t is tuple or t is list:
        for x in v:
            if type(x) not in _PLAIN:
                return True
        return False
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        v = list(v.values())  # (a copy: see _tensors_in)
    elif not isinstance(v, _CONTAINERS):
        return False
    return not all(type(x) in _PLAIN for x in list(v))


def _module_holders(name: str, root: torch.nn.Module, claimed: set[int]) -> list[Holder]:
    """Buffers and plain (non-parameter) tensor attributes of `root` and its submodules, and
    containers in those attributes, named by module path: `model.1.running_mean`. A parameter is a
    leaf, and no holder, until an in-place update outside `torch.no_grad()` gives it a history: a
    hand-written EMA's `e.mul_(d).add_(p, alpha=1 - d)` on parameters that do not require grad
    chains every step's update onto the last; those are holders too. A submodule reachable twice
    (shared, or from two globals) is reported once, under the first name that reaches it. The last
    item of each holder is (class, attribute): where to look for the line that grows it."""
    out: list[Holder] = []
    for path, mod in root.named_modules():
        if id(mod) in claimed:
            continue
        claimed.add(id(mod))
        prefix = f"{name}.{path}" if path else name
        cls = type(mod)
        for attr, p in mod._parameters.items():
            if p is not None and p.grad_fn is not None:
                out.append((f"{prefix}.{attr}", "Parameter", [p], (cls, attr), p))
        for attr, buf in mod._buffers.items():
            if isinstance(buf, torch.Tensor) and not isinstance(buf, torch.nn.Parameter):
                out.append((f"{prefix}.{attr}", type(buf).__name__, [buf], (cls, attr), buf))
        for attr, v in list(vars(mod).items()):
            if attr in _MODULE_INTERNALS or not _may_hold_tensors(v):
                continue
            found = _tensors_in(v)
            if found:
                out.append((f"{prefix}.{attr}", type(v).__name__, found, (cls, attr), v))
    return out


def _modules_in(value: Any) -> list[tuple[Any, torch.nn.Module]]:
    """(index or key, module) of the nn.Modules directly inside a list, tuple or dict (a global, or
    an attribute of one): a GAN's `nets = [G, D]` holds its state as `model` would (the tensor walk
    does not enter modules)."""
    if type(value) in (list, tuple):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.nn.Module)]
    if type(value) is dict:
        return [(k, v) for k, v in value.items() if isinstance(v, torch.nn.Module)]
    return []


def _holders(module: types.ModuleType | None, claimed: set[int] | None = None) -> list[Holder]:
    """(name, kind, tensors, (class, attribute) or None, value) for the target module's globals (and one
    level of their attributes) that hold tensors other than parameters, and for the state inside
    the nn.Modules among them."""
    if module is None:
        return []
    return _namespace_holders(vars(module), set() if claimed is None else claimed)


def _namespace_holders(names: dict[str, Any], claimed: set[int]) -> list[Holder]:
    """The holders among the names of one namespace (a module's globals, a function's locals);
    `claimed`: ids of the modules and objects already walked (a local that is another name for a
    global is that global's holder already)."""
    out: list[Holder] = []
    for name, value in list(names.items()):
        if name.startswith("__") or isinstance(value, (types.ModuleType, type, types.FunctionType)):
            continue
        if isinstance(value, torch.nn.Module):
            out.extend(_module_holders(name, value, claimed))
            continue
        for key, mod in _modules_in(value):  # `nets = [G, D]`, `models = {"g": G}`
            out.extend(_module_holders(f"{name}[{key!r}]", mod, claimed))
        if type(value) not in _PLAIN and type(value) is not torch.nn.Parameter:
            if id(value) in claimed:
                continue
            claimed.add(id(value))
        found = _tensors_in(value)
        if found:
            out.append((name, type(value).__name__, found, None, value))
            continue
        claimed.discard(id(value))  # (an object: its attributes are walked once, below)
        out.extend(_attribute_holders(name, value, claimed, 0))
    # a global that is only another name for a module's parameter (the `p` a module-level
    # `for p in ema.parameters():` leaves behind) is that parameter's holder already
    owned = {id(h[2][0]) for h in out if h[1] == "Parameter" and h[3] is not None}
    return [h for h in out if h[3] is not None or not h[2]
            or not all(isinstance(t, torch.nn.Parameter) and id(t) in owned for t in h[2])]


def _user_frames() -> list[types.FrameType]:
    """The frames of the user's functions on this thread's stack, innermost first: at a step
    boundary found inside a running program, the function that holds the training loop (and those
    that called it) is still running, and its locals live on (a running loss kept as a tensor in
    `train()`). Module-level frames are left out: their names are globals, walked as such."""
    out = []
    f: Any = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if code.co_name != "<module>" and not is_library(code.co_filename):
            out.append(f)
        f = f.f_back
    return out


def _local_holders(claimed: set[int], more: list[types.FrameType] = ()) -> list[tuple[Holder, types.FrameType]]:
    """The holders among the locals of the user's running functions (each with its frame), named
    as the function spells them (`total`, `self.losses`); `more`: frames of a traceback (the
    functions an error left), whose locals live while it does."""
    out = []
    for frame in [*_user_frames(), *(f for f in more if f.f_code.co_name != "<module>"
                                     and not is_library(f.f_code.co_filename))]:
        for h in _namespace_holders(dict(frame.f_locals), claimed):
            out.append((h, frame))
    return out


def _closure_holders(functions: list[types.FunctionType], claimed: set[int]) -> list[tuple[Holder, Any]]:
    """The holders among the variables the user's closures keep (a hook's `seen` list, defined in
    `watch()` and filled by the lambda it registers), each with its closure's code: they live as
    long as the closure does, out of reach of any global or running frame."""
    out = []
    for fn in functions:
        names = {}
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                names[var] = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
        for h in _namespace_holders(names, claimed):
            out.append((h, fn.__code__))
    return out


def function_span(code: types.CodeType) -> tuple[int, int]:
    """First and last line of a function's code."""
    lines = [n for _, _, n in code.co_lines() if n is not None]
    return code.co_firstlineno, max(lines, default=code.co_firstlineno)


_OBJECT_DEPTH = 3  # `agent.buffer.items`: a global's object's object's attribute


def _attribute_holders(name: str, obj: Any, claimed: set[int], depth: int) -> list[Holder]:
    """Holders among the attributes of `obj` (a global, or an object of the user's own class inside
    one), named by attribute path: `trainer.stats`, `agent.buffer.items` (a replay buffer object
    whose deque keeps every transition's value with its graph). The owner of an attribute of the
    user's own object is (its class, attribute): the class's own methods grow it
    (`self.items.append(...)`), and two buffers of two classes that both say `self.items` are each
    located in their own class."""
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict) or id(obj) in claimed:
        return []
    claimed.add(id(obj))
    out: list[Holder] = []
    for attr, v in list(attrs.items()):
        path = f"{name}.{attr}"
        if isinstance(v, torch.nn.Module):  # `trainer.model`
            out.extend(_module_holders(path, v, claimed))
            continue
        for key, mod in _modules_in(v):  # `trainer.nets = [G, D]`
            out.extend(_module_holders(f"{path}[{key!r}]", mod, claimed))
        found = _tensors_in(v)
        if found:
            out.append((path, type(v).__name__, found, (type(obj), attr) if depth or _users_object(obj) else None, v))
            bound = state_bound(obj, attr)
            if bound is not None:
                _BOUNDS[id(v)] = bound
        elif depth + 1 < _OBJECT_DEPTH and _users_object(v):
            out.extend(_attribute_holders(path, v, claimed, depth + 1))
    return out


_BOUNDS: dict[int, dict[str, Any]] = {}  # id of a holder's value -> the most it can hold (state_bound), per scan


def state_bound(obj: Any, attr: str) -> dict[str, Any] | None:
    """The most bytes `obj.<attr>` can ever hold, where a library states it: LBFGS keeps at most
    `history_size` (direction, step) pairs of the flattened parameters in its state, and a few
    vectors of that size besides (the direction, the previous gradient, the step; torch/optim/
    lbfgs.py): its state fills to (2 * history_size + 3) flat vectors, then stays. None: no bound
    known."""
    if attr != "state" or not isinstance(obj, torch.optim.LBFGS):
        return None
    group = obj.param_groups[0]
    flat = sum(p.numel() * p.element_size() for p in group["params"])
    size = int(group["history_size"])
    return {"bytes": (2 * size + 3) * flat, "why": f"LBFGS keeps at most history_size={size} (direction, step) "
                                                   f"pairs of its {flat:,} bytes of parameters"}


def _users_object(v: Any) -> bool:
    """An instance of a class defined in the user's code (a ReplayBuffer), not a library's (an
    optimizer, whose state is not the user's to detach) nor a class, function or module."""
    if isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType)) or type(v) in _PLAIN:
        return False
    if not isinstance(getattr(v, "__dict__", None), dict):
        return False
    mod = sys.modules.get(type(v).__module__)
    if str(getattr(getattr(mod, "__spec__", None), "name", "")).startswith("auditor."):
        return False  # (the child's own `__main__`, whose `__file__` is the step file's)
    file = getattr(mod, "__file__", None)
    return bool(file) and not is_library(file)


def _graph_stores(value: dict, source_file: str, name: str, lines: list[int]) -> list[dict[str, Any]]:
    """Each line of the step that stores into an entry of the dict holder `value` that carries a
    graph now: [{"file", "line", "key", "rows"}] (rows: row_parts of that entry). Several lines can
    fill one holder (a running loss at one, outputs appended at the next): each is named and patched."""
    keys = mutation_keys(source_file, name)
    out = []
    for line in lines:
        key = keys.get(line)
        if key is None or key not in value or not any(t.grad_fn is not None for t in _tensors_in(value[key])):
            continue
        out.append({"file": source_file, "line": line, "key": key, "rows": row_parts(value[key])})
    return out


def step_lines(fn: Any, source_file: str | None) -> tuple[int, int] | None:
    """First and last line of the step function's code, where it is defined in `source_file` (the
    file the scans read); None otherwise (another file, a callable object, a builtin)."""
    code = getattr(fn, "__code__", None)
    if code is None or not source_file or os.path.realpath(code.co_filename) != os.path.realpath(source_file):
        return None
    lines = [n for _, _, n in code.co_lines() if n is not None]
    return (code.co_firstlineno, max(lines)) if lines else None


_ROW_SAMPLE = 256  # rows looked at per holder: the newest, where a leak adds its rows


def _has_graph(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.grad_fn is not None


def _rows_of(value: Any) -> list[Any] | None:
    """The newest rows of a buffer: items of a list, deque or set, values of a dict (the items of
    its values, when these are lists it appends to)."""
    if isinstance(value, (list, tuple)):
        return list(value[-_ROW_SAMPLE:])
    if isinstance(value, deque):
        return list(itertools.islice(reversed(value), _ROW_SAMPLE))
    if isinstance(value, dict):
        entries = list(itertools.islice(reversed(value.values()), _ROW_SAMPLE))
        if entries and all(isinstance(e, (list, deque)) for e in entries):
            # a dict of buffers (`history["loss"].append(loss)`): their items are the rows
            return [r for e in entries for r in _rows_of(e) or []][:_ROW_SAMPLE]
        return entries
    if isinstance(value, (set, frozenset)):
        return list(itertools.islice(value, _ROW_SAMPLE))
    return None


def _row_kind(row: Any) -> str:
    if isinstance(row, torch.Tensor):
        return "tensor"
    if isinstance(row, (tuple, list)):
        return "tuple"
    if isinstance(row, dict):
        return "dict"
    if _users_object(row) or dataclasses.is_dataclass(row):
        return "object"
    return "other"


def row_parts(value: Any) -> dict[str, Any] | None:
    """Where the graphs sit in a buffer's rows (a list, deque or dict of tuples, dicts or small
    objects): the tuple positions, dict keys or attributes that hold a tensor with a grad_fn. The
    fix detaches just those where a row is pushed (`(s, a, r, value.detach())`): the row's other
    items may be numbers, which have no `.detach()`. None when the items are tensors (or the holder
    is no container); kind "mixed" when rows differ, "nested" true when a graph sits deeper than
    a row's own items: no patch can be derived then."""
    rows = _rows_of(value)
    if not rows:
        return None
    kinds = {_row_kind(r) for r in rows}
    if kinds == {"tensor"}:
        return None
    if len(kinds) > 1 or kinds & {"other"}:
        return {"kind": "mixed", "graph": [], "nested": False}
    kind = kinds.pop()
    graph: set[Any] = set()
    nested, sizes, classes, fields = False, set(), set(), None
    for row in rows:
        items = list(enumerate(row) if kind == "tuple" else row.items() if kind == "dict" else vars(row).items())
        for key, x in items:
            if _has_graph(x):
                graph.add(key)
            elif not isinstance(x, torch.Tensor) and type(x) not in _PLAIN \
                    and any(t.grad_fn is not None for t in _tensors_in((x,))):
                nested = True
        if kind == "tuple":
            sizes.add(len(row))
        classes.add(type(row))
    cls = classes.pop() if len(classes) == 1 else None
    if cls is not None and kind == "tuple" and hasattr(cls, "_fields"):  # a namedtuple
        fields = list(cls._fields)
    elif cls is not None and kind == "object" and dataclasses.is_dataclass(cls):
        fields = [f.name for f in dataclasses.fields(cls) if f.init]  # (the constructor's order)
    spelled = {k for k in graph if type(k) in (str, int)}
    nested |= spelled != graph  # (a key a patch cannot spell: a tuple, an object)
    graph = spelled
    named = cls is not None and cls not in (tuple, list, dict)
    return {"kind": kind, "class": cls.__name__ if named else None, "size": sizes.pop() if len(sizes) == 1 else None,
            "fields": fields, "graph": sorted(graph, key=lambda k: (isinstance(k, str), k)), "nested": nested}


_WATCH_KEY = "auditor.graph-leak"
_backpropagated: set[str] = set()  # holders a backward ran through after a scan saw them keep a graph


def _ran_backward(names: set[str], *_: Any) -> None:
    _backpropagated.update(names)


def _watch_backward(name: str, tensors: list[torch.Tensor]) -> None:
    """Hook the node behind each graph-carrying tensor a holder keeps, once: a backward that later
    runs through it (a loss over the log-probs stored in an episode, at its end) means the graph is
    kept to be used, so `.detach()` where it is stored would change the gradients, not only free
    memory. The hook only records; it holds the holder's name, no tensor. (A hook costs ~12 us to
    place, so each scan hooks a holder's newest tensors only, which an episode's loss would use.)"""
    for t in tensors:
        node = t.grad_fn
        try:
            meta = node.metadata
            names = meta.get(_WATCH_KEY)
            if names is None:
                names = meta[_WATCH_KEY] = set()
                node.register_prehook(functools.partial(_ran_backward, names))
        except (AttributeError, RuntimeError, TypeError):
            continue
        names.add(name)


class ScanMemo:
    """What one run's full scans found, which decides whether a later scan may look at the named
    holders only (`scan(..., memo=, named_only=True)`).

    A full scan walks every gc-tracked object (~290k with torch imported: 25 ms for gc.get_objects,
    ~35 ms to pick out the tensors and functions, memory-bound: no C-level filter is faster), to
    count every live tensor with a grad_fn, named or not, and to find the user's closures. Once
    FULL full scans in a row have found every such tensor inside a named holder (a global, a
    running function's local, a closure's variable, and what they reach), what the program keeps
    across steps lives under its names: a later scan reads those holders (and the closures the last
    full scan found) and counts the graph-carrying tensors among them, the count a full scan would
    give. A run in which a full scan meets a tensor with history outside every holder keeps full
    scans to its end. The cost of being wrong: a graph kept outside every name that first appears
    after those scans (after step 16 of a long audit) is counted by the last scan (a full one), not
    the middle one."""

    FULL = 3

    def __init__(self) -> None:
        self.full = 0  # full scans so far
        self.unnamed = False  # a full scan met a tensor with history outside every holder
        self.closures: list[weakref.ref] = []  # the user's closures at the last full scan

    def named_only(self) -> bool:
        return self.full >= self.FULL and not self.unnamed


def scan(module: types.ModuleType | None, source_file: str | None,
         step: tuple[int, int] | None = None, frames: list[types.FrameType] = (),
         memo: ScanMemo | None = None, named_only: bool = False) -> dict[str, Any]:
    """Count live graph-carrying tensors and the graph behind them; name the globals holding tensors
    (with their bytes, for memory-growth) and the lines that grow them; for a buffer of rows, where
    in a row the graph sits; and whether a backward ran through what a holder kept since an earlier
    scan saw it. Run with torch-function dispatch off: a mode on the stack (the user's, the default
    device's) would see every read of every live tensor. `memo`: the run's ScanMemo, which a full
    scan updates; `named_only`: the caller allows this scan to read the named holders only, which
    it does when the memo says their count is the full one (see ScanMemo). The program's own trace
    function is off meanwhile (unseen.untraced): the walk is thousands of calls of the auditor's."""
    with no_torch_function(), untraced():
        return _scan(module, source_file, step, frames, memo,
                     named_only and memo is not None and memo.named_only())


_PICKED = frozenset((torch.Tensor, torch.nn.Parameter, types.FunctionType))  # what a scan looks at
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # (the exact types a full scan counts)


def _scan(module: types.ModuleType | None, source_file: str | None, step: tuple[int, int] | None,
          frames: list[types.FrameType] = (), memo: ScanMemo | None = None, named: bool = False) -> dict[str, Any]:
    live: list[torch.Tensor] = []
    if named:  # (the holders are walked below; the closures are those the last full scan found)
        closures = [f for f in (r() for r in memo.closures) if f is not None]
    else:
        # (one pass over every gc-tracked object, ~300k with torch._dynamo imported: 25 ms of the
        # pass is gc.get_objects itself on a 2.4 GHz EPYC, and a frozenset lookup of each type is
        # ~15% faster than three identity tests)
        function = types.FunctionType
        picked = [o for o in gc.get_objects() if type(o) in _PICKED]
        live = [t for t in picked if type(t) is not function and t.grad_fn is not None]
        # (each file's verdict read from is_library's cache inline: a call per closure, tens of
        # thousands a scan, is what a trace function of the program's (sys.settrace) would see)
        known = library_verdicts
        closures = [f for f in picked if type(f) is function and f.__closure__
                    and not (known[n] if (n := f.__code__.co_filename) in known else is_library(n))]
        del picked
    claimed: set[int] = set()
    _BOUNDS.clear()
    found: list[tuple[Holder, types.FrameType | types.CodeType | None]] = [(h, None) for h in _holders(module, claimed)]
    found += _local_holders(claimed, list(frames))
    found += _closure_holders(closures, claimed)
    held = {id(t): t for (_, _, tensors, _, _), _ in found for t in tensors
            if type(t) in _TENSORS and t.grad_fn is not None}
    # a view held keeps its base alive (`newvalue = value_head(x).view(-1)`): the base is held too
    held.update({id(b): b for b in [t._base for t in held.values()]
                 if b is not None and type(b) in _TENSORS and b.grad_fn is not None})
    if named:
        live = list(held.values())
    elif memo is not None:
        memo.full += 1
        memo.unnamed = memo.unnamed or any(id(t) not in held for t in live)
        memo.closures = [weakref.ref(f) for f in closures]
    del held
    holders = [_holder_entry(h, frame, source_file, step) for h, frame in found]
    return {"tensors": len(live), "graph_nodes": _graph_size(live), "holders": holders}


def _holder_entry(holder: Holder, frame: types.FrameType | types.CodeType | None, source_file: str | None,
                  step: tuple[int, int] | None) -> dict[str, Any]:
    """The scan's record of one holder of tensors: its size, its graphs, and the line that grows it."""
    from auditor.capture.rehearsal.device import CUDA_MARK  # (here: that module imports the probes)
    name, kind, tensors, owner, value = holder
    where, function, file, span, lines = None, "", source_file, step, []
    closure = isinstance(frame, types.CodeType)  # a closure's variable: grown by the closure, as `name`
    if frame is not None:  # a local: grown by its own function, as `name`
        code = frame if closure else frame.f_code
        function = getattr(code, "co_qualname", code.co_name)
        file, span = code.co_filename, function_span(code)
        if closure:  # (named by the function that defines it: `watch`, not `watch.<locals>.<lambda>`)
            function = function.split(".<locals>")[0]
    # a module's attribute is grown by its class's own methods, as `self.<attr>`; failing that
    # (or for a global), by the script, as `name` (`model.cache.append(out)` in the step)
    at = attribute_line(*owner) if owner is not None else None
    if at:
        where = {"file": at[0], "line": at[1], "function": ""}
    elif file:
        lines = mutation_lines(file, name, span)
        if frame is not None:  # (only the function's own lines spell its local)
            lines = [n for n in lines if span[0] <= n <= span[1]]
        if not lines and kind == "Parameter":
            lines = parameter_update_lines(file, name)
        if lines:
            where = {"file": file, "line": lines[0], "function": function}
    with_graph = [t for t in tensors if t.grad_fn is not None]
    # (only the step function's own lines, when it is known: other functions of the file that
    # store into the same entry did not run in the step)
    stores = (_graph_stores(value, file, name, [n for n in lines if span is None or span[0] <= n <= span[1]])
              if with_graph and file and not at and isinstance(value, dict) and len(lines) > 1 else [])
    entry = {"name": name, "kind": kind, "tensors": len(tensors), "graph_tensors": len(with_graph),
             "nodes": _graph_size(with_graph), "bytes": _nbytes(tensors), "where": where,
             # on the GPU (or meant for it, in CUDA rehearsal, where they live in process memory)
             "device_bytes": _nbytes([t for t in tensors if t.is_cuda or getattr(t, CUDA_MARK, False)])}
    if with_graph:
        # the activations its graphs saved (on the GPU when its own tensors are)
        entry["graph_bytes"] = graph_bytes(with_graph)
        _watch_backward(name, with_graph[:_ROW_SAMPLE])  # (the newest: the walk meets them first)
        entry["rows"] = row_parts(value)
    if frame is not None:
        entry["function"] = function  # a local of this function (its qualified name)
        if closure:
            entry["closure"] = True  # kept by a closure the function made
    if id(value) in _BOUNDS:
        entry["bound_bytes"], entry["bound_why"] = _BOUNDS[id(value)]["bytes"], _BOUNDS[id(value)]["why"]
    if len(stores) > 1:
        entry["stores"] = stores
        entry["where"] = {"file": file, "line": stores[0]["line"], "function": function}
    if name in _backpropagated:
        entry["backpropagated"] = True
    return entry
