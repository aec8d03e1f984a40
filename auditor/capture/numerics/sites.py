"""The collector's tables of call sites, modules and parameter names, sent to the parent once.

A site is (op, the user's line that made the call): step records refer to sites and modules by
id, and each table entry goes out once, in the first step record (or the final record) after it
was made (`_new_tables`).
"""
from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from auditor.capture.frames import call_span, code_kinds, library_code, user_call
from auditor.capture.numerics.ops import _module_op_name, _op_name


class Tables:
    """Mixin of Numerics: its sites, modules and parameter names tables."""

    def _new_tables(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.sent_sites < len(self.site_info):
            out["sites"] = {str(s["id"]): s for s in self.site_info[self.sent_sites:]}
            self.sent_sites = len(self.site_info)
        if self.sent_lists < len(self.param_lists):
            out["param_lists"] = {str(i): self.param_lists[i] for i in range(self.sent_lists, len(self.param_lists))}
            self.sent_lists = len(self.param_lists)
        if self.sent_modules < len(self.module_info):
            out["modules"] = {str(m["id"]): m for m in self.module_info[self.sent_modules:]}
            self.sent_modules = len(self.module_info)
        return out

    def _site(self, op: Any, depth: int, hazard: str | None = None) -> int:
        """The site of a call `depth` frames up: the op at the user's line. A call made by library
        code inside a library module (Linear inside Sequential) has the user's line of that
        module's call, found once by the module pre-hook, not per call. A call made straight from
        the user's code is looked up by its instruction (code object and offset), which names the
        same site every time: no walk, no line number worked out, on the path every call takes."""
        f = sys._getframe(depth)
        code = f.f_code
        kind = code_kinds.get(id(code))
        if kind == 0:  # (a user's code object: code_kinds keeps it, so its id names it)
            key = (op, id(code), f.f_lasti)
            try:
                sid = self.instr_sites.get(key)
            except TypeError:  # an unhashable callable
                return self._site_at(op, user_call(f), hazard, f)
            if sid is None:
                sid = self.instr_sites[key] = self._site_at(op, user_call(f), hazard, f)
            return sid
        w = self.wstack[-1] if self.wstack else None
        if w is not None and library_code(code):
            return self._site_at(op, w, hazard)
        return self._site_at(op, user_call(f), hazard, f)

    def _site_at(self, op: Any, where: Any, hazard: str | None = None, frame: Any = None) -> int:
        """Intern (op, the user's call): sites are sent once, steps refer to them by id. `op` is a
        name, a called function or a module class, named once, when its site is new; the same op
        reached through another callable shares the site. A `where` from user_call also holds the
        call's instruction: its columns are found in `frame`'s stack when the site is new."""
        key = (op, where)
        try:
            sid = self.sites.get(key)
        except TypeError:  # an unhashable callable
            op = _op_name.__wrapped__(op)
            key = (op, where)
            sid = self.sites.get(key)
        if sid is None:
            name = op if isinstance(op, str) else _module_op_name(op) if isinstance(op, type) else _op_name(op)
            sid = self.sites.get((name, where))
            if sid is None:
                sid = len(self.site_info)
                self.sites[(name, where)] = sid
                info = {"id": sid, "op": name, "where": _where(where, call_span(frame, where) if frame else None)}
                if hazard:
                    info["hazard"] = hazard
                self.site_info.append(info)
            self.sites[key] = sid
        return sid

    def _module_id(self, module: torch.nn.Module) -> int:
        entry = self.modules.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry[1]
        if not self.mstack:  # a root call: name every submodule and parameter from here
            root = type(module).__name__
            for qual, sub in module.named_modules(remove_duplicate=False):
                e = self.modules.get(id(sub))
                if e is None or e[0]() is not sub:
                    self._add_module(sub, qual, root)
            held = None  # the global holding the root, for the root's own parameters
            for qual, p in module.named_parameters(remove_duplicate=False):
                owner = qual.rpartition(".")[0]
                if not owner and held is None:
                    held = _global_holding(module, sys._getframe(2)) or ""
                if not owner and held:
                    qual, owner = f"{held}.{qual}", held
                self.param_names[id(p)] = (weakref.ref(p), qual, owner or root)
            entry = self.modules.get(id(module))
            if entry is not None:
                return entry[1]
        parent = self.module_info[self.mstack[-1]] if self.mstack else None
        qual = f"{parent['name']}.{type(module).__name__}".lstrip(".") if parent else ""
        return self._add_module(module, qual, parent["root"] if parent else type(module).__name__)

    def _add_module(self, module: torch.nn.Module, qual: str, root: str) -> int:
        mid = len(self.module_info)
        self.modules[id(module)] = (weakref.ref(module), mid)
        self.module_info.append({"id": mid, "name": qual, "type": type(module).__name__, "root": root})
        return mid

    def param_name(self, p: torch.Tensor) -> str | None:
        e = self.param_names.get(id(p))
        return e[1] if e is not None and e[0]() is p else None

    def param_layer(self, p: torch.Tensor) -> str | None:
        """The qualified name of the module owning `p` (the root's class name for its own)."""
        e = self.param_names.get(id(p))
        return e[2] if e is not None and e[0]() is p else None

    def event(self, kind: str, where: Any, **data: Any) -> None:
        """A configuration event (optimizer made, state loaded, autocast entered ...), sent with the step."""
        self.events.append({"event": kind, "step": self.step if self.stepping else -1,
                            "where": _where(where), **data})


def _global_holding(obj: Any, frame: Any) -> str | None:
    """The name of a global of the user's code calling at `frame` (or above it) that holds `obj`.
    A root module's own parameters are named `weight`, `bias` by the module itself: two layers
    held by two globals (`emb`, `proj`), each called on its own, name their gradients
    `emb.weight`, `proj.weight`, as a root module holding both would, not `weight` twice."""
    f = frame
    while f is not None and library_code(f.f_code):
        f = f.f_back
    if f is None:
        return None
    for name, v in f.f_globals.items():
        if v is obj and not name.startswith("__"):
            return name
    return None


def _where(w: Any, span: tuple[int, int, int, int] | None = None) -> dict | None:
    if not w:
        return None
    out = {"file": w[0], "line": w[1], "function": w[2]}
    if span is not None:  # where on the line the call is: (line, end line, column, end column)
        out["span"] = list(span)
    return out
