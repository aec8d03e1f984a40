"""Per-rank evidence of a data-parallel run, merged into one view the distributed rules read.

Why a separate view: every rank of a DDP job runs the same code, so the per-rank rules (host syncs,
DataLoader settings...) are answered by one rank's evidence. What only the ranks *together* can tell
is who waits for whom. A collective finishes on every rank at about the same moment, so the rank
that arrives last spends the least time in it: that time is the transfer itself, and whatever any
other rank spent beyond it was waiting. Matching the same collective across ranks (the k-th
gradient sync of a step, the n-th call at one user line, the k-th NCCL kernel of a ProfilerStep)
needs no shared clock, so ranks on different hosts compare as well as ranks on one host.

Data model (Evidence.ranks, a RankSet; auditor.evidence.ranks.model):
- RankInfo per rank: identity, how it ended, and per step its wall time, where the time went
  (`phases`: data / forward / backward / optimizer / sync / cleanup / other with communication
  taken out, plus `comm`), the time spent in sync points (`comm_ms`) and, after merging, the part of
  it beyond the transfer (`wait_ms`). Explicit collectives are summarised per user line (SiteStat).
- The merged Evidence is the primary rank's (rank 0 when present) with `ranks` added, so
  every existing rule still runs unchanged on one rank and the distributed rules see all of them.

Modules: model (the records: RankSet, RankInfo, RankStep, SiteStat), phases (the phases a rank's
step is split into), runs (one rank from its `audit run` evidence), traces (ranks from profiler
traces whose `distributedInfo` names the rank), combine (matching sync points across ranks),
merge (one Evidence from rank run directories, `DIR/rank-K/evidence.json`, after checking they are
one job's) and view (rank_set: the ranks behind any Evidence). For jobs of many ranks: summary
(RankSummary, one rank's trace or run directory reduced where it is read: only these travel to the
driver), sketch (the primary rank's trace as the driver's reports read it, made by its worker; the
rules that read its events run where it is parsed again, auditor.rules.primary), engines (where the
reduction runs: a local process pool, Ray or Dask), job (which trace
files are a job's ranks, from their headers, and the merge of their summaries) and scale (medians
without one rank, spreads, hosts and lists of ranks for the rules and plots of hundreds of ranks). auditor.evidence.load decides which
inputs of `audit analyze` are ranks of one job; auditor.reports.rank_plots renders the per-rank
table and figure.
"""
