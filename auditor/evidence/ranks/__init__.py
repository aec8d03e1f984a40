"""Per-rank evidence of a data-parallel run, merged into one view the distributed rules read.

Every rank runs the same code, so per-rank rules read one rank's evidence; what only the ranks
together tell is who waits for whom. A collective ends on every rank at about the same moment, so
the rank that arrives last spends the least time in it: that time is the transfer, and what other
ranks spent beyond it was waiting. Collectives are matched across ranks by their order (the k-th
sync of a step, the n-th call at a user line, the k-th NCCL kernel of a ProfilerStep), so no
shared clock is needed.

The merged Evidence is the primary rank's (rank 0 when present) with `ranks` (a RankSet) added:
every rule still runs on one rank, and the distributed rules see all of them.

Modules: model (RankSet, RankInfo, RankStep, SiteStat), phases (a step's phases), runs (a rank from
its run evidence), traces (ranks from traces' `distributedInfo`), combine (matching sync points),
merge (rank run directories of one job), view (rank_set), summary (RankSummary: what travels to
the driver for many ranks), sketch (the primary rank's trace as the reports read it), engines
(local pool, Ray or Dask), job (which traces are one job's ranks) and scale (statistics over
hundreds of ranks). auditor.evidence.load decides which inputs are ranks of one job.
"""
