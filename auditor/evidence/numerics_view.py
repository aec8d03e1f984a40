"""`NumericsView`: the numerics collector's per-step records (auditor.evidence.numerics) of one
evidence, joined into the tables the numerics rules read (sites, modules, events)."""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from auditor.evidence.model import Evidence
from auditor.evidence.numerics import (NO_SITE, ModuleInfo, NumericsFinal, NumericsStep, OptStep, ParamList, Site,
                                       num, val)


def _top(names: list[str], norms: list[float], k: int = 5) -> list[list]:
    """The k largest norms, non-finite ones first."""
    bad = [i for i, v in enumerate(norms) if not math.isfinite(v)][:k]
    good = [i for i, v in enumerate(norms) if math.isfinite(v)]
    order = bad + heapq.nlargest(k - len(bad), good, key=lambda i: abs(norms[i]))
    return [[names[i], num(norms[i])] for i in order]


def _top_layers(layers: list[str], norms: list[float], k: int = 5) -> list[list]:
    """Modules by share of the squared gradient norm: [name, norm, share]."""
    sq: dict[str, float] = {}
    for layer, v in zip(layers, norms):
        sq[layer] = sq.get(layer, 0.0) + (v * v if math.isfinite(v) else float("inf"))
    total = sum(sq.values())
    order = sorted(sq.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else float("-inf"))
    return [[layer, num(math.sqrt(s)), round(s / total, 4) if total and math.isfinite(total) else None]
            for layer, s in order[:k]]


@dataclass
class NumericsView:
    """The numerics collector's per-step records joined into tables (sites, modules, events)."""

    steps: list[tuple[int, NumericsStep]] = field(default_factory=list)  # (step index, its record)
    sites: dict[int, Site] = field(default_factory=dict)
    modules: dict[int, ModuleInfo] = field(default_factory=dict)
    param_lists: dict[int, ParamList] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, ev: Evidence) -> NumericsView:
        cached = ev.__dict__.get("_numerics_view")
        if cached is not None:
            return cached
        view = cls()
        for s in ev.steps:
            d = s.numerics
            if d is None:
                continue
            view._tables(d)
            for r in d.opt_steps:
                view._rank_params(r)
            view.steps.append((s.index, d))
        if ev.numerics is not None:
            view._tables(ev.numerics)
        ev.__dict__["_numerics_view"] = view
        return view

    def _tables(self, d: NumericsStep | NumericsFinal) -> None:
        self.sites.update({int(k): v for k, v in d.sites.items()})
        self.modules.update({int(k): v for k, v in d.modules.items()})
        self.param_lists.update({int(k): v for k, v in d.param_lists.items()})
        self.events.extend(d.events)

    def _rank_params(self, r: OptStep) -> None:
        """An optimizer step's gradient norms per parameter (named by the `param_lists` table) ->
        the parameters and layers that dominate them (`top_params`, `top_layers`)."""
        lists = self.param_lists.get(r.grads) if r.top_layers is None else None
        norms = r.grad_norms
        if not lists or not isinstance(norms, list) or len(norms) != len(lists.names):
            return
        values = [v if v is not None else math.nan for v in map(val, norms)]
        r.top_params = _top(lists.names, values)
        r.top_layers = _top_layers(lists.layers, values)

    def site(self, site: int | None) -> Site:
        """The site of an id; NO_SITE (no op, no line) for an id no table names."""
        return self.sites.get(site, NO_SITE) if site is not None else NO_SITE

    def module_name(self, module: int | None) -> tuple[str, str, str] | None:
        """(qualified name, type, root type) of a module id."""
        info = self.modules.get(module) if module is not None else None
        if info is None:
            return None
        return info.name, info.type, info.root

    def opt_steps(self) -> list[tuple[int, OptStep]]:
        return [(i, r) for i, d in self.steps for r in d.opt_steps]

    def hazard_series(self, site: int) -> list[list]:
        return [[i, v] for i, d in self.steps for s, v, *_ in d.hazards if s == site]

    def loss_series(self) -> list[list]:
        return [[i, d.loss] for i, d in self.steps if d.loss is not None]

    def grad_norm_series(self, opt: int | None = None) -> list[list]:
        return [[i, r.grad_norm] for i, r in self.opt_steps()
                if r.grad_norm is not None and (opt is None or r.opt == opt)]

    def events_of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == kind]

    def optimizer_event(self, opt: int | None) -> dict | None:
        """The "optimizer" event of an optimizer id (its type, where it was made, its defaults)."""
        return next((e for e in self.events_of("optimizer") if e.get("opt") == opt), None)
