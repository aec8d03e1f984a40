"""collective-wait: ranks blocked in collectives beyond the transfer, and per-step barriers or
metric all-reduces in the training step."""
from __future__ import annotations

from statistics import median
from typing import Iterable

from auditor.evidence import model as m
from auditor.evidence.ranks.combine import compared_steps
from auditor.evidence.ranks.model import RankSet, SiteStat
from auditor.evidence.ranks.scale import NAMED_RANKS, UNKNOWN_HOST, host_of, spread
from auditor.evidence.ranks.view import rank_set
from auditor.rules.base import Option, Options, Rule
from auditor.findings import Cost, Finding, Fix, Location, share_of_step, step_basis_ms

_KIND_LABELS = {"gradients": "DDP's gradient all-reduce", "buffers": "DDP's buffer broadcast",
                "collectives": "explicit collectives", "kernels": "communication kernels"}
_BARRIERS = ("barrier", "monitored_barrier")


class CollectiveWait(Rule):
    """
    What it detects:
        (1) The share of each step the ranks spend blocked in collectives or barriers beyond the
        transfer itself, i.e. waiting for other ranks to arrive. (2) An explicit `dist.barrier()`,
        or an all-reduce of a small tensor (a loss or accuracy for logging), called from the step
        in every step, with the user's line.

    Why it costs:
        A collective returns only when every rank has joined it. Time spent beyond the fastest
        rank's is pure idling, and a barrier or metric all-reduce in every step adds one more
        lockstep point per step (plus, for a metric, the `.item()` that usually follows it), so
        each step's jitter on any rank becomes everybody's wait.

    Example:
        bad:   dist.all_reduce(loss_t); running += loss_t.item()   # every step
        good:  running += loss.detach(); ...; if i % 100 == 0: dist.all_reduce(running)

    Fix:
        Accumulate metrics locally (a detached running sum) and all-reduce them only when logging;
        drop barriers from the step (DDP's gradient all-reduce already keeps ranks in lockstep).
        For waiting in gradient syncs, see rank-straggler for the rank the others wait for.

    Evidence needed:
        A run with the distributed probes (explicit collectives are timed per call at the user's
        line) or per-rank traces. The wait beyond transfer needs two or more ranks: the rank that
        arrives last at a collective waits least, and its time is taken as the transfer.
    """

    id = "collective-wait"
    saves_on = "step"
    title = "Ranks wait in collectives beyond the transfer time"
    severity = "warning"
    category = "performance"
    needs = frozenset({"run", "trace"})
    needs_text = "needs a run that used torch.distributed, or per-rank profiler traces"
    options = (
        Option("min-share", 0.1, "Report (as info) when the ranks spend at least this share of the step waiting "
                                 "in collectives beyond the transfer (median over steps, mean over ranks)."),
        Option("warn-share", 0.25, "... as a warning from this share on."),
        Option("metric-max-bytes", 65536, "An all-reduce/broadcast/all-gather of at most this many bytes per "
                                          "call is taken for a metric, not for training data."),
        Option("min-share-of-steps", 0.8, "Flag an explicit barrier or metric collective called in at least "
                                          "this share of the steps."),
    )

    def skip_reason(self, ev: m.Evidence) -> str | None:
        rs = rank_set(ev)
        if rs is None:
            return self.needs_text
        return None

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        rs = rank_set(ev)
        assert rs is not None
        if len(rs.ranks) >= 2:
            f = self._share(rs, options, step_basis_ms(ev))
            if f is not None:
                yield f
        yield from self._sites(rs, ev, options)

    # -- (1) waiting beyond transfer, all sync points ------------------------------------------
    def _share(self, rs: RankSet, options: Options, basis_ms: float | None) -> Finding | None:
        steps = compared_steps(rs)
        if len(steps) < 2:
            return None
        per_rank: dict[int, list[float]] = {}
        for row in steps.values():
            for r, s in row.items():
                if s.ms > 0:
                    per_rank.setdefault(r, []).append((s.wait_ms or 0.0) / s.ms)
        shares = {r: median(v) for r, v in per_rank.items()}
        mean_share = sum(shares.values()) / len(shares)
        if mean_share < options["min-share"]:
            return None
        step_ms = median(s.ms for row in steps.values() for s in row.values())
        worst = max(shares, key=shares.get)
        worst_steps = [row[worst] for row in steps.values() if worst in row]
        kinds = sorted(((k, median(s.wait_by.get(k, 0.0) for s in worst_steps))
                        for k in {k for s in worst_steps for k in s.wait_by}), key=lambda t: -t[1])
        kind_text = ", ".join(f"{_KIND_LABELS.get(k, k)} {ms:.1f} ms" for k, ms in kinds if ms >= 0.05)
        locs = _wait_locations(rs, worst, kinds)
        ms = round(mean_share * step_ms, 3)
        share = share_of_step(ms, basis_ms)  # (the cost's: of the step the report states, as every cost's)
        host = host_of(rs.get(worst))
        dist = spread(list(shares.values()))
        spread_text = (f"; across the {len(shares)} ranks the share waited is {dist['median']:.0%} at the median, "
                       f"{dist['p90']:.0%} at the 90th percentile" if len(shares) > NAMED_RANKS else "")
        most = sorted(shares, key=lambda r: -shares[r])[:5]
        exposed = [median(x) for r in shares
                   if (x := [row[r].exposed_ms for row in steps.values() if r in row and row[r].exposed_ms is not None])]
        exposed_ms = round(median(exposed), 3) if exposed else None
        exposed_text = (f"; communication no compute hides: {exposed_ms:.1f} ms per step (median rank)"
                        if exposed_ms is not None else "")
        return self.finding(
            "Ranks wait for each other in collectives: find the slow rank. "
            f"Rank {worst}" + (f" (host {host})" if host != UNKNOWN_HOST else "") + f" spends {shares[worst]:.0%} "
            f"of each step waiting in collectives beyond the transfer "
            f"itself (median over {len(steps)} steps); the {len(shares)} ranks wait {ms:.1f} ms per step on "
            f"average" + (f" ({share:.0%} of the run's time)" if share is not None else "") + spread_text
            + exposed_text + (f"; on rank {worst} per step: {kind_text}." if kind_text else "."),
            severity="warning" if mean_share >= options["warn-share"] else "info",
            locations=locs,
            evidence={"share_by_rank": {str(r): round(v, 4) for r, v in sorted(shares.items())},
                      "share_spread": dist, "most_waiting": [{"rank": r, "host": host_of(rs.get(r)),
                                                              "share": round(shares[r], 4)} for r in most],
                      "exposed_comm_ms": exposed_ms,
                      "mean_share": round(mean_share, 4), "wait_ms_by_kind": {k: round(v, 3) for k, v in kinds},
                      "run_step_ms": round(step_ms, 3), "steps_compared": sorted(steps), "source": rs.source},
            cost=Cost(ms_per_step=ms, share_of_step=share, measured=True,
                      note="waiting beyond the fastest rank's time, per rank"),
            fix=Fix(summary="Find what makes ranks arrive at different times (see rank-straggler) and remove "
                            "lockstep points from the step: per-step barriers and metric all-reduces."),
        )

    # -- (2) explicit barriers and metric collectives every step --------------------------------
    def _sites(self, rs: RankSet, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        primary = rs.ranks[0]
        n_steps = max(1, len([s for s in primary.steps if not s.failed]))
        step_ms = step_basis_ms(ev)
        backend = primary.backend or ""
        for st in primary.sites:
            per_call = st.bytes / max(1, st.calls)
            is_barrier = st.op in _BARRIERS
            if not is_barrier and per_call > options["metric-max-bytes"]:
                continue
            if st.steps < options["min-share-of-steps"] * n_steps or st.where is None:
                continue
            waits = [x.wait_ms for info in rs.ranks for x in info.sites
                     if x.op == st.op and x.where and x.where.file == st.where.file
                     and x.where.line == st.where.line and x.wait_ms is not None]
            ms_per_step = st.ms / st.steps
            wait_text = (f", {sum(waits) / len(waits) / st.steps:.2f} ms of it waiting for other ranks"
                         if waits else "")
            what = "barrier" if is_barrier else f"{st.op} of {per_call:.0f} bytes"
            host_only = backend.lower() == "nccl"
            yield self.finding(
                ("A barrier in every step makes ranks wait: remove it. " if is_barrier else
                 "A collective in every step makes ranks wait: run it when logging. ")
                + f"The call dist.{st.op} at {st.where.file.rsplit('/', 1)[-1]}:{st.where.line} ({what}) runs in "
                f"{st.steps} of {n_steps} steps, {st.calls / st.steps:.1f} call(s) per step: "
                f"{ms_per_step:.2f} ms per step on rank {primary.rank}{wait_text}; every call makes each rank "
                f"wait for the slowest one" + (", and is followed by a sync to read it on the host"
                                               if not is_barrier else "") + ".",
                locations=[Location.of(st.where)],
                evidence={"op": st.op, "calls": st.calls, "steps": st.steps, "bytes_per_call": round(per_call),
                          "ms_per_step": round(ms_per_step, 4), "barrier": is_barrier,
                          "wait_ms_total": [round(w, 4) for w in waits], "backend": backend or None},
                cost=Cost(ms_per_step=round(ms_per_step, 4), share_of_step=share_of_step(round(ms_per_step, 4), step_ms),
                          measured=not host_only,
                          note="host time of the call" + (" (NCCL enqueues: the wait shows on the GPU)"
                                                          if host_only else "")),
                fix=Fix(summary="Remove the barrier from the step: DDP's gradient all-reduce already keeps ranks "
                                "in lockstep." if is_barrier else
                        "Accumulate the metric locally (e.g. `running += loss.detach()`) and all-reduce it only "
                        "when logging (every N steps), not in every step."),
            )


def _wait_locations(rs: RankSet, rank: int, kinds: list[tuple[str, float]]) -> list[Location]:
    """Where the waiting rank waits: its backward call for gradient syncs, its forward call for buffer
    broadcasts, and its explicit collective lines, biggest first."""
    info = rs.get(rank)
    if info is None:
        return []
    out: list[Location] = []
    for kind, _ in kinds:
        if kind == "gradients" and "backward" in info.phase_sites:
            out.append(Location.of(info.phase_sites["backward"]))
        elif kind == "buffers" and "forward" in info.phase_sites:
            out.append(Location.of(info.phase_sites["forward"]))
        elif kind == "collectives":
            sites: list[SiteStat] = sorted((s for s in info.sites if s.where), key=lambda s: -(s.wait_ms or 0))
            out.extend(Location.of(s.where) for s in sites[:3])
    seen, unique = set(), []
    for loc in out:
        if (loc.file, loc.line) not in seen:
            seen.add((loc.file, loc.line))
            unique.append(loc)
    return unique
