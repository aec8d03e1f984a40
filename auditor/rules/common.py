"""Small helpers several rules share: grouping tallies by place, trends, costs."""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

import numpy as np

from auditor.evidence.model import HOOK, Evidence, Frame, GraphScan, Tally
from auditor.findings import Cost, Location, share_of_step, step_basis_ms


@dataclass
class Place:
    """All tallies of one kind at one source location, across steps."""

    where: Frame | None
    what: str
    steps: set[int] = field(default_factory=set)
    count: int = 0
    ms: float = 0.0
    data: dict = field(default_factory=dict)


def place_key(t: Tally | Place) -> tuple:
    """(what, file, line): the place a tally (or a Place of them) is counted at."""
    return t.what, t.where.file if t.where else None, t.where.line if t.where else None


def by_place(pairs: list[tuple[int, Tally]]) -> list[Place]:
    """Group (step, tally) pairs by (what, file, line); most frequent first."""
    places: dict[tuple, Place] = {}
    for step, t in pairs:
        key = place_key(t)
        p = places.setdefault(key, Place(where=t.where, what=t.what))
        p.steps.add(step)
        p.count += t.count
        p.ms += t.ms
        for k, v in t.data.items():
            p.data.setdefault(k, v)
    return sorted(places.values(), key=lambda p: (-p.count, p.what))


def locations(places: list[Place]) -> list[Location]:
    seen, out = set(), []
    for p in places:
        if p.where and (p.where.file, p.where.line) not in seen:
            seen.add((p.where.file, p.where.line))
            out.append(Location.of(p.where))
    return out


def per_step(x: float) -> str:
    """A count per step for a message, to 3 significant digits and never in exponent form: 8.23,
    0.233, 4, 120. Counts over a few dozen steps support no more (`:g` printed 8.23333)."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    return np.format_float_positional(x, precision=3, fractional=False, trim="-")


def size_text(nbytes: float) -> str:
    """A byte count for a message, in MB (1e6 bytes) from 0.01 MB up and in KB or bytes below, so
    that a 512-byte copy does not read "0.00 MB" beside the megabytes it is listed with."""
    if nbytes >= 10_000:
        return f"{nbytes / 1e6:.2f} MB"
    if nbytes >= 1000:
        return f"{nbytes / 1e3:.1f} KB"
    return f"{nbytes:.0f} bytes"


def steps_run(ev: Evidence) -> int:
    return max(1, len(ev.steps))


def cost_of(ev: Evidence, total_ms: float, measured: bool = True, note: str | None = None) -> Cost:
    """Cost per step of `total_ms` spread over the run, and its share of the median step."""
    per_step = round(total_ms / steps_run(ev), 3)
    return Cost(ms_per_step=per_step, share_of_step=share_of_step(per_step, step_basis_ms(ev)),
                measured=measured, note=note)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation: a trend test that one outlier cannot fake."""
    n = len(xs)
    if n < 3:
        return 0.0

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(n), key=lambda i: v[i])
        r = [0.0] * n
        i = 0
        while i < n:
            j = i
            while j + 1 < n and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


def theil_sen(xs: list[float], ys: list[float]) -> float:
    """Median of pairwise slopes: a robust per-step trend."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    return median(slopes) if slopes else 0.0


def without_spikes(values: list[float], k: float = 6.0) -> list[int]:
    """Indexes of the values that are not isolated spikes: above median + k * MAD (the median
    absolute deviation, at least 2% of the median). A steady trend spreads the values, so its late
    steps stay in; a flat run's garbage-collection pauses and epoch boundaries drop out."""
    if len(values) < 4:
        return list(range(len(values)))
    mid = median(values)
    mad = max(median([abs(v - mid) for v in values]), 0.02 * abs(mid))
    return [i for i, v in enumerate(values) if v <= mid + k * mad]


def trend_ratio(xs: list[float], ys: list[float]) -> float:
    """End over start of the Theil-Sen line through (xs, ys): how much the trend itself grew,
    which one slow step at either end (a garbage collection, an epoch boundary) cannot fake."""
    if len(xs) < 2:
        return 1.0
    slope = theil_sen(xs, ys)
    intercept = median([y - slope * x for x, y in zip(xs, ys)])
    # a steep line may start below zero: it cannot start below the fastest step actually seen
    start = max(intercept + slope * xs[0], min(ys))
    end = intercept + slope * xs[-1]
    return end / start if start > 0 else 1.0


def quarter_medians(values: list[float]) -> tuple[float, float]:
    q = max(1, len(values) // 4)
    return median(values[:q]), median(values[-q:])


def quarter_floors(values: list[float]) -> tuple[float, float]:
    """The fastest value of the first and of the last quarter. Load from other processes only
    adds time to a step, in bursts that come and go: it lifts a quarter's median, but a quarter's
    fastest step stays near the work itself. Work that really grows lifts the floor too."""
    q = max(1, len(values) // 4)
    return min(values[:q]), min(values[-q:])


def on_accelerator(ev: Evidence) -> bool:
    """Whether the audited program really computed on a CUDA device."""
    return ev.environment.cuda_available and ev.environment.device == "cuda"


def spread_scans(scans: list[GraphScan]) -> list[GraphScan]:
    """The first graph scan, the one nearest the middle of the scanned steps and the last, in step
    order. Scans run after steps 1, 4, 16, ... too, so that a run that dies early has two; growth
    is judged over these three, as far apart as the run allows: a leak that adds a graph every
    tenth step is not growth-free between steps 1 and 4, and a buffer that fills by the middle and
    stays full is not growing."""
    scans = sorted(scans, key=lambda s: s.after_step)
    if len(scans) <= 3:
        return scans
    first, last = scans[0], scans[-1]
    mid = (first.after_step + last.after_step) / 2
    middle = min(scans[1:-1], key=lambda s: (abs(s.after_step - mid), s.after_step))
    return [first, middle, last]


def file_name(path: str) -> str:
    """The last part of a path, with either separator: what a message calls a file by."""
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def line_ref(file: str | None, line: int | None, headline_file: str | None) -> str:
    """`line 14` for a site in the file the finding's headline names, `agent.py:39` for one in
    another file: a message listing sites across a package must say which file each is in."""
    if line is None:
        return "line ?"
    if file and headline_file and file != headline_file:
        return f"{file_name(file)}:{line}"
    return f"line {line}"


@dataclass
class PilingHooks:
    """Hooks registered at one line that pile up on the same tensors or modules step after step."""

    what: str  # Tensor.register_hook, Module.register_forward_hook ...
    where: Frame | None
    steps: int  # steps that registered hooks there
    per_step: float  # registrations per step there (median)
    holders: int  # tensors or modules registered on, in the last such step
    first: tuple[int, int]  # (step, hooks held) of the first step that registered there
    last: tuple[int, int]  # ... and of the last

    @property
    def growth(self) -> float:
        """Hooks each holder gained per step, on average."""
        return (self.last[1] - self.first[1]) / max(1, self.last[0] - self.first[0])


def piling_hooks(ev: Evidence, min_steps: int = 3, min_growth: float = 0.5) -> list[PilingHooks]:
    """The lines whose hook registrations pile up: in at least `min_steps` steps, with the most
    hooks one holder has after them growing by `min_growth` a step or more. A hook registered
    every step on a new tensor (an activation of that step) holds one hook each time: not piling."""
    series: dict[tuple, list[tuple[int, Tally]]] = {}
    for step, t in ev.tallies(HOOK):
        series.setdefault(place_key(t), []).append((step, t))
    out = []
    for pairs in series.values():
        pairs.sort(key=lambda p: p[0])
        (s0, t0), (s1, t1) = pairs[0], pairs[-1]
        h0, h1 = int(t0.data.get("held", 0)), int(t1.data.get("held", 0))
        if len(pairs) < min_steps or h1 - h0 < 2 or (h1 - h0) / max(1, s1 - s0) < min_growth:
            continue
        out.append(PilingHooks(what=t1.what, where=t1.where, steps=len(pairs),
                               per_step=median([t.count for _, t in pairs]),
                               holders=int(t1.data.get("holders", 0)), first=(s0, h0), last=(s1, h1)))
    return sorted(out, key=lambda p: -p.last[1])


def hook_phase(what: str) -> str:
    """The pass that runs the hooks a registration adds."""
    return "forward" if "forward" in what else "backward"
