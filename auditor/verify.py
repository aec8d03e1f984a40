"""`audit run ... --verify`: each fix proven by re-running the program with it applied.

The project (the git toplevel holding the target, else the current directory) is copied to a
scratch directory, the fixes are applied there with `git apply`, as the user would apply
fixes.patch, and the target is audited again in full with the same options (RunSpec). The re-runs:
one with every fix that keeps results (the settings its fixes give as environment variables
exported); one per fix that changes results and per fix whose edit overlaps another's; each fix of
the first alone when that re-run fails; when the weights differ, an unpatched re-run, then each fix
alone; every improved fix together, as fixes.patch holds them.

A fix is judged on its own finding (same rule, same file) in the re-run that held it (`judge`):
improved (gone, or its cost or count per step down by a quarter), no-change, failed (the patch did
not apply, or the program failed) or changed-results (a fix that keeps results: the weights differ
where two unpatched runs agree). One not improved is taken out of fixes.patch (reports.patch reads
`fix.verified`), the reason said; a fix given only as settings is not verifiable here.

Copied: every file under the project root but SKIP_DIRS and virtual environments; a file larger
than LINK_BYTES (a dataset, a checkpoint) is linked, and read from the user's tree.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click
import msgspec

from auditor.command_options import RunOptions, encode
from auditor.evidence.whole_files import write_whole
from auditor.findings import Finding, Fix, RuleResults, Verified

LINK_BYTES = 64 * 1024 * 1024
KEPT = "with the fixes that keep results"  # (the re-run of every fix that leaves the weights the same)
SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", "audit-out", ".tox", ".nox", ".mypy_cache",
             ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints"}
IMPROVED_FRACTION = 0.75  # a finding still there is improved when its cost fell to this share or less
SLOWER = 1.10  # a median step longer than this times the audited one is called slower in the note
_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


@dataclass
class RunSpec:
    """How the audited run was asked for: what each re-run repeats (TARGET, or -m `module`, the
    program's arguments, `audit run`'s options)."""

    target: str | None
    module: str | None
    script_args: tuple[str, ...]
    options: RunOptions

    def command(self, target: str | None, out: Path) -> list[str]:
        """The re-run's `audit run` of `target` (in the scratch copy) into `out`: the same options,
        quiet, recording the weights' digest, verifying and comparing nothing itself."""
        options = msgspec.structs.replace(self.options, out=out, quiet=True, digest=True, verify=False, baseline=None,
                                          fail_on=None, open_report=False, tensorboard=False, nproc_per_node=None)
        where = ["-m", self.module] if self.module is not None else [target] if target is not None else []
        args = ["--", *self.script_args] if self.script_args else []
        return [sys.executable, "-m", "auditor", "run", *where, "--options-json", encode(options), *args]


@dataclass
class Rerun:
    """One re-run: its outcome as findings.json and evidence.json tell it."""

    ok: bool
    error: str = ""
    findings: list[dict] = field(default_factory=list)
    median_ms: float | None = None
    digest: str | None = None
    cpu_ms: float | None = None  # the median timed step's process CPU time: steadier than wall time under load
    run_ms: float | None = None  # the run's time per step (findings.json's run_time.base_ms): stalls included


@dataclass
class Unit:
    """One re-run that judged fixes, as verify's table measures it: the findings (indices) whose
    edits it held, all of them (a fix applied after another's holds that one's too), the re-run,
    how it was run, and the saving the audit predicted for those fixes together (`predicted_ms`,
    as the headline adds fixes up: auditor.reports.terminal.recoverable)."""

    held: list[int]
    rerun: Rerun
    what: str
    predicted_ms: float | None = None


@dataclass
class Outcome:
    """What --verify did: per finding index its Verified, what it could not verify, the time, the
    re-runs that judged fixes (`units`, one row each in verify's table), and the re-run with every
    fix applied (`together`: None when fewer than two fixes were verified) with the saving the
    audit predicted for them together (the headline's figure)."""

    verified: dict[int, Verified] = field(default_factory=dict)
    unverifiable: list[str] = field(default_factory=list)
    reruns: int = 0
    seconds: float = 0.0
    before_ms: float | None = None
    before_cpu_ms: float | None = None
    before_run_ms: float | None = None
    together: Rerun | None = None
    together_predicted_ms: float | None = None
    units: list[Unit] = field(default_factory=list)
    # A rehearsal's: the re-runs ran on this CPU, so each prediction is of this machine's time (the
    # GPU estimates of its fixes are named apart in the table)
    rehearsed: bool = False


# --- the scratch copy ----------------------------------------------------------------------------

def project_root(target_file: str | None) -> Path:
    """Where the patches apply (auditor.fixes.repo_root): the git toplevel holding the target's
    file, else the current directory."""
    from auditor.fixes import repo_root

    return repo_root(target_file or Path.cwd())


def copy_project(root: Path, dest: Path, skip: tuple[Path, ...] = ()) -> None:
    """`root` copied to `dest` (see the module's docstring for what is left out or linked)."""
    skip_resolved = {p.resolve() for p in skip}

    def ignore(directory: str, names: list[str]) -> set[str]:
        out = set()
        for n in names:
            p = Path(directory, n)
            if n in SKIP_DIRS or p.resolve() in skip_resolved or (p.is_dir() and (p / "pyvenv.cfg").is_file()):
                out.add(n)
        return out

    def copy(src: str, dst: str) -> None:
        if os.path.getsize(src) > LINK_BYTES:
            os.symlink(os.path.abspath(src), dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(root, dest, symlinks=True, ignore=ignore, copy_function=copy)


# --- one re-run ----------------------------------------------------------------------------------

class Runner:
    """Re-runs the audited target in fresh scratch copies of the project."""

    def __init__(self, spec: RunSpec, target_file: str | None, out: Path) -> None:
        self.spec = spec
        self.root = project_root(target_file)
        self.target_file = target_file
        self.skip = (out,)
        self.scratch = Path(tempfile.mkdtemp(prefix="audit-verify-"))
        self.count = 0
        self.unpatched: Rerun | None = None  # a re-run without any fix, once one is needed
        outside = target_file is not None and self.root not in Path(target_file).resolve().parents
        # (a file outside the directory the patches apply in: its copy would not be patched)
        self.why_not = f"the target is outside {self.root}, where the patches apply" if outside else None

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def _where(self, copy: Path) -> tuple[Path, str | None]:
        """(the re-run's current directory, its TARGET) in `copy`."""
        cwd = Path.cwd().resolve()
        inside = cwd == self.root or self.root in cwd.parents
        run_cwd = copy / cwd.relative_to(self.root) if inside else copy
        target = self.spec.target
        if self.target_file is not None and target is not None:
            scratch_file = copy / Path(self.target_file).resolve().relative_to(self.root)
            attr = target.rpartition(":")[2] if ":" in target and not target.endswith(".py") else ""
            target = f"{scratch_file}:{attr}" if attr and not os.path.isfile(target) else str(scratch_file)
        return run_cwd, target

    def run(self, patches: list[str], env: dict[str, str] | None = None) -> Rerun:
        """A full audit of the target with `patches` (diff texts) applied to a fresh copy."""
        self.count += 1
        copy, out = self.scratch / f"tree-{self.count}", self.scratch / f"out-{self.count}"
        copy_project(self.root, copy, self.skip)
        for i, text in enumerate(patches):
            p = self.scratch / f"patch-{self.count}-{i}.diff"
            p.write_text(text)
            # (the copy is no repository: git must not find one around the scratch directory)
            r = subprocess.run(["git", "apply", "--whitespace=nowarn", str(p)], cwd=copy, capture_output=True,
                               text=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(self.scratch)})
            if r.returncode != 0:
                why = (r.stderr.strip().splitlines() or ["git apply failed"])[0]
                return Rerun(ok=False, error=f"the patch does not apply: {why}")
        run_cwd, target = self._where(copy)
        p = subprocess.run(self.spec.command(target, out), cwd=run_cwd, capture_output=True, text=True,
                           env={**os.environ, **(env or {})})
        return read_rerun(out, p.returncode, p.stderr)


def read_rerun(out: Path, code: int, stderr: str) -> Rerun:
    """A re-run's outcome from its output directory (exit 0 and 1 are a program that ran)."""
    try:
        doc = json.loads((out / "findings.json").read_text())
        ev = json.loads((out / "evidence.json").read_text())
    except (OSError, ValueError):
        doc = ev = None
    if code not in (0, 1) or doc is None:
        ending = (doc or {}).get("ending") or {}
        why = ": ".join(x for x in (ending.get("exception"), ending.get("message")) if x)
        last = [ln for ln in stderr.strip().splitlines() if ln.strip()]
        return Rerun(ok=False, error=f"the patched program failed ({why or (last[-1] if last else f'exit {code}')})")
    weights = ev.get("weights") or {}
    return Rerun(ok=True, findings=doc["findings"], median_ms=doc["steps"]["median_ms"],
                 digest=weights.get("sha256") or None, cpu_ms=median_cpu_ms(ev.get("steps") or []),
                 run_ms=(doc.get("run_time") or {}).get("base_ms"))


def median_cpu_ms(steps: list[dict]) -> float | None:
    """The median process CPU time of the timed steps (as Evidence.timed_steps picks them) of
    evidence.json's `steps`; None when the steps carry none."""
    ok = [s for s in steps if not s.get("failed") and not s.get("profiled")]
    if any(s.get("numerics") is not None for s in steps):
        ok = [s for s in ok if s.get("numerics") is None]
    cpu = sorted(s["cpu_ms"] for s in ok if s.get("cpu_ms") is not None)
    if not cpu:
        return None
    mid = len(cpu) // 2
    return round(cpu[mid] if len(cpu) % 2 else (cpu[mid - 1] + cpu[mid]) / 2, 3)


# --- judging a fix -------------------------------------------------------------------------------

def _numbers(evidence: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in evidence.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def measures(f: dict | None, median_ms: float | None) -> dict[str, Any]:
    """What a finding measured, as `before`/`after` show it: whether it is there, its cost per
    step, the run's median step and the finding's evidence numbers (syncs, bytes, nodes)."""
    if f is None:
        return {"finding": False, "median_step_ms": median_ms, "ms_per_step": None}
    cost = f.get("cost") or {}
    return {"finding": True, "median_step_ms": median_ms, "ms_per_step": cost.get("ms_per_step"),
            **_numbers(f.get("evidence") or {})}


def _counts_fell(before: dict[str, Any], after: dict[str, Any]) -> tuple[str, float, float] | None:
    """(key, before, after) of a count the finding makes per step (`syncs_per_step`, `launches_per_step`)
    that fell to IMPROVED_FRACTION of itself or less, none of the others rising: a finding counted, not
    timed (a CPU-only run's syncs), has no cost to compare. None otherwise."""
    keys = [k for k in before if k.endswith("_per_step") and k != "ms_per_step"
            and isinstance(before[k], (int, float)) and isinstance(after.get(k), (int, float))]
    if any(after[k] > before[k] for k in keys):
        return None
    return next(((k, before[k], after[k]) for k in keys if before[k] > 0 and after[k] <= IMPROVED_FRACTION * before[k]),
                None)


def _file_of(f: dict) -> str:
    locs = f.get("locations") or []
    return Path(locs[0]["file"]).name if locs else ""


_KINDS = ("phase", "source", "built")  # evidence keys that tell apart one rule's findings of different kinds


def _kind(f: dict) -> tuple:
    ev = f.get("evidence") or {}
    return tuple(ev.get(k) for k in _KINDS)


def same_finding(before: dict, after: list[dict]) -> dict | None:
    """The re-run's finding of the same rule in the same file (files differ in path: the re-run
    ran in the scratch copy), of the same kind: host-sync's syncs between steps (evidence `phase`)
    are not its syncs in the steps, nor a trace's (`source`) a run's, nor host-built-tensor's random
    draws (`built`) its constants."""
    return next((a for a in after if a["rule"] == before["rule"] and _file_of(a) == _file_of(before)
                 and _kind(a) == _kind(before)), None)


def judge(before: dict, before_median: float | None, rerun: Rerun, what: str, rehearsed: bool = False,
          before_cpu: float | None = None, before_run: float | None = None) -> Verified:
    """A fix's Verified from the re-run that had it applied. The step's time it states is the run's
    time per step (stalls and the time between steps in it: what a fix of those gives back), the
    median step beside it; the median step alone where a run has no run's time."""
    b = {**measures(before, before_median), "median_step_cpu_ms": before_cpu, "run_step_ms": before_run}
    if not rerun.ok:
        return Verified(status="failed", before=b, after={}, note=f"{what}: {rerun.error}")
    match = same_finding(before, rerun.findings)
    a = {**measures(match, rerun.median_ms), "median_step_cpu_ms": rerun.cpu_ms, "run_step_ms": rerun.run_ms}
    step = _step_change(before_median, rerun.median_ms, before_run, rerun.run_ms, rehearsed)
    if match is None:
        return Verified(status="improved", before=b, after=a, note=f"{what}: the finding is gone{step}")
    cb, ca = b.get("ms_per_step"), a.get("ms_per_step")
    if cb and ca is not None and ca <= IMPROVED_FRACTION * cb:
        return Verified(status="improved", before=b, after=a,
                        note=f"{what}: the finding remains, its cost fell from {cb:.2f} to {ca:.2f} ms/step{step}")
    counts = _counts_fell(b, a) if cb is None or ca is None else None
    if counts:
        k, x, y = counts
        return Verified(status="improved", before=b, after=a,
                        note=f"{what}: the finding remains, its {k.replace('_', ' ')} fell from {x:g} to {y:g} "
                             f"(it has no cost to compare: counted, not timed){step}")
    return Verified(status="no-change", before=b, after=a, note=f"{what}: the finding is still there{step}")


def _step_change(mb: float | None, ma: float | None, rb: float | None, ra: float | None, rehearsed: bool) -> str:
    """'; run's time 17.3 -> 7.3 ms/step (median step 5.3 -> 5.6 ms)', '(slower)' where the judged
    figure (the run's time, else the median step) rose past SLOWER times itself."""
    median = f"median step {mb:.1f} -> {ma:.1f} ms" if mb and ma else ""
    if rb and ra:
        text = f"; run's time {rb:.1f} -> {ra:.1f} ms/step" + (f" ({median})" if median else "")
        slower = ra > SLOWER * rb
    else:
        text, slower = (f"; {median}" if median else ""), bool(mb and ma and ma > SLOWER * mb)
    if slower:
        text += " (slower: on this machine; a rehearsal's are CPU timings)" if rehearsed else " (slower)"
    return text


# --- the whole verification ----------------------------------------------------------------------

def env_config(fix: Fix) -> dict[str, str]:
    """The environment variables a fix sets as config (PYTORCH_CUDA_ALLOC_CONF): a re-run exports them."""
    return {k: str(v) for k, v in fix.config.items() if _ENV_NAME.fullmatch(k)}


def verify(evidence: Any, results: RuleResults, spec: RunSpec, target_file: str | None, out: Path,
           progress: Callable[[str], None]) -> Outcome:
    """Verify every fix of `results` (see the module's docstring)."""
    from auditor.fixes import diff_edits
    from auditor.reports.patch import patchable, same_results

    t0 = time.perf_counter()
    outcome = Outcome()
    plain = same_results(results.findings)
    numerics = [f for f in patchable(results.findings) if f not in plain]
    combined = diff_edits([e for f in plain for e in f.fix.edits]).diff  # type: ignore[union-attr]
    in_combined = [f for f in plain if all(_edit_in(e, combined) for e in f.fix.edits)]  # type: ignore[union-attr]
    apart = [f for f in plain if f not in in_combined]
    env_only = [f for f in results.findings if f.fix is not None and not f.fix.edits and env_config(f.fix)]
    for f in results.findings:
        if f.fix is None or f.fix.edits or env_config(f.fix):
            continue
        if f.fix.config:
            outcome.unverifiable.append(f"{f.rule}: settings with no code edit ({', '.join(map(str, f.fix.config))})")
    runner = Runner(spec, target_file, out)
    if runner.why_not:
        outcome.unverifiable.append(f"every fix: {runner.why_not}")
        runner.close()
        return outcome
    v = Verifying.of(evidence, results, runner, outcome, progress, diff_edits)
    try:
        group = in_combined + env_only
        grouped = v.with_results_kept(group, in_combined, combined) if group else None
        for f in apart + numerics:
            v.with_own_edit(f, f in numerics)
        outcome.before_ms, outcome.before_cpu_ms, outcome.before_run_ms = v.median, v.before_cpu, v.before_run
        fixed = [results.findings[i] for i, verified in outcome.verified.items() if verified.status == "improved"]
        if len(fixed) > 1 and grouped is not None and all(f in group for f in fixed):
            outcome.together = grouped  # (they all ran together in that re-run: its row)
        elif len(fixed) > 1:  # every fix that held, together: what the headline predicted
            outcome.together = v.all_together(fixed)
    finally:
        runner.close()

    def priced(held: list[Finding]) -> list[Finding]:  # (in a rehearsal, this machine's time alone)
        return [f for f in held if not (v.rehearsed and _gpu_estimate(f))]

    for u in outcome.units:
        u.predicted_ms = _predicted_together(evidence, results, priced([results.findings[i] for i in u.held]))
    if outcome.together is not None:
        outcome.together_predicted_ms = _predicted_together(evidence, results, priced(fixed))
    outcome.rehearsed = v.rehearsed
    outcome.reruns = runner.count
    outcome.seconds = time.perf_counter() - t0
    return outcome


@dataclass
class Verifying:
    """One verification under way: the audited run's measures (its findings as findings.json has
    them, `docs`, by index), the re-runner, and the outcome so far."""

    results: RuleResults
    runner: Runner
    outcome: Outcome
    progress: Callable[[str], None]
    diff_edits: Callable
    docs: list[dict]
    index: dict[int, int]  # id(finding) -> its index
    median: float | None
    before_cpu: float | None
    before_digest: str | None
    rehearsed: bool
    before_run: float | None = None  # the audited run's time per step (auditor.evidence.run_time)

    @classmethod
    def of(cls, evidence: Any, results: RuleResults, runner: Runner, outcome: Outcome,
           progress: Callable[[str], None], diff_edits: Callable) -> "Verifying":
        from auditor.evidence.run_time import run_time

        median = evidence.shown_median_ms()
        timed = evidence.timed_steps() if hasattr(evidence, "timed_steps") else []
        account = run_time(evidence)
        return cls(results, runner, outcome, progress, diff_edits, [msgspec.to_builtins(f) for f in results.findings],
                   {id(f): i for i, f in enumerate(results.findings)},
                   round(median, 3) if median is not None else None,
                   median_cpu_ms([{"cpu_ms": s.cpu_ms} for s in timed]),
                   evidence.weights.sha256 if evidence.weights is not None and evidence.weights.sha256 else None,
                   bool(evidence.environment.rehearsal), account.base_ms if account is not None else None)

    def judged(self, held: list[Finding], r: Rerun, what: str) -> None:
        """Each of `held` judged by the re-run `r` that held their edits (`what`: how it ran)."""
        for f in held:
            i = self.index[id(f)]
            self.outcome.verified[i] = judge(self.docs[i], self.median, r, what, self.rehearsed, self.before_cpu,
                                             self.before_run)

    def check_weights(self, r: Rerun, fixes: list[Finding]) -> None:
        _check_weights(r, self.before_digest, fixes, self.runner, self.docs, self.index, self.median, self.outcome,
                       self.progress, self.diff_edits)

    def with_results_kept(self, group: list[Finding], in_combined: list[Finding], combined: str) -> Rerun | None:
        """One re-run with the fixes that keep results (and the settings they export); when it fails,
        each fix on its own, to find the one that broke it. Returns the re-run when every fix of
        the group was judged in it."""
        env = {k: v for f in group for k, v in env_config(f.fix).items()}  # type: ignore[arg-type]
        self.progress(f"{KEPT} ({len(group)} fix(es))")
        r = self.runner.run([combined] if in_combined else [], env)
        if not r.ok and len(group) > 1:  # which one broke it: each on its own
            for f in group:
                self.progress(f"{f.rule} alone")
                one = self.runner.run(_own_patch(f, self.diff_edits), env_config(f.fix))  # type: ignore[arg-type]
                self.judged([f], one, "alone")
                self.outcome.units.append(Unit(held=[self.index[id(f)]], rerun=one, what="alone"))
                if one.ok and f in in_combined:
                    self.check_weights(one, [f])
            return None
        self.judged(group, r, KEPT)
        self.outcome.units.append(Unit(held=[self.index[id(f)] for f in group], rerun=r, what=KEPT))
        if r.ok and in_combined:
            self.check_weights(r, in_combined)
        return r

    def with_own_edit(self, f: Finding, numerics: bool) -> None:
        """A fix re-run apart (`numerics`: it changes results; else its edit overlaps another's), re-run
        with its own edit, after those of the fixes it works only after."""
        from auditor.reports.patch import prerequisites

        first = prerequisites(f, self.results.findings)
        waits = [r for r in f.evidence.get("apply_after", []) if r not in {g.rule for g in first}]
        if waits:  # (its fix works only after another's that has no edit to apply first)
            self.outcome.unverifiable.append(f"{f.rule}: its fix works only after {', '.join(waits)}'s, which has "
                                             "no code edit to apply first")
            return
        self.progress(f"{f.rule} (its own edit)")
        r = self.runner.run([p for g in first for p in _own_patch(g, self.diff_edits)] + _own_patch(f, self.diff_edits),
                            env_config(f.fix))  # type: ignore[arg-type]
        what = "with its own edit, which changes results" if numerics else "with its own edit"
        if first:
            what += " after " + ", ".join(f"{g.rule}'s" for g in first)
        self.judged([f], r, what)
        self.outcome.units.append(Unit(held=[self.index[id(g)] for g in [*first, f]], rerun=r, what=what))
        if r.ok and not numerics:  # (a numerics fix changes the weights by design)
            self.check_weights(r, [f])

    def all_together(self, fixed: list[Finding]) -> Rerun:
        """Every fix that held, in one re-run: one diff of all their edits, a fix another depends on
        first; of two edits of one line (pageable-copy's pin_memory and dataloader-bound's workers on
        a DataLoader call) the numerics fix's, which carries both settings, is kept."""
        self.progress(f"every fix together ({len(fixed)})")
        from auditor.reports.patch import patch_order

        ordered = patch_order(fixed, self.results.findings)
        joined = self.diff_edits([e for f in ordered for e in f.fix.edits]).diff  # type: ignore[union-attr]
        patches = [joined] if joined else []
        return self.runner.run(patches, {k: v for f in fixed for k, v in env_config(f.fix).items()})  # type: ignore[arg-type]


def _gpu_estimate(f: Finding) -> bool:
    from auditor.rules._support.gpu_costs import is_gpu_estimate

    return is_gpu_estimate(f.cost)


def _predicted_together(evidence: Any, results: RuleResults, fixed: list[Finding]) -> float | None:
    """What the audit predicted `fixed` save together: the headline's figure of those findings, an
    `info` one among them counted as a warning is (its fix is in the re-run all the same)."""
    from auditor.reports.terminal import recoverable

    held = [msgspec.structs.replace(f, severity="warning") if f.severity == "info" else f for f in fixed]
    return recoverable(evidence, RuleResults(findings=held)).ms


def _edit_in(edit: Any, diff: str) -> bool:
    """Whether the combined patch carries `edit` (its new lines are among the patch's added ones)."""
    added = {ln[1:] for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")}
    return all(ln in added for ln in edit.lines)


def _own_patch(f: Finding, diff_edits: Callable) -> list[str]:
    text = diff_edits(f.fix.edits).diff if f.fix and f.fix.edits else ""  # type: ignore[union-attr]
    return [text] if text else []


def _check_weights(r: Rerun, before: str | None, fixes: list[Finding], runner: Runner, docs: list[dict],
                   index: dict[int, int], median: float | None, outcome: Outcome, progress: Callable[[str], None],
                   diff_edits: Callable) -> None:
    """The fixes that keep results must leave the weights as they were: compare the digests; when they
    differ, an unpatched re-run tells a nondeterministic program from a fix that changed the results."""
    def note(f: Finding, text: str, status: str | None = None) -> None:
        v = outcome.verified[index[id(f)]]
        outcome.verified[index[id(f)]] = msgspec.structs.replace(
            v, status=status or v.status, note=f"{v.note}; {text}",
            before={**v.before, "weights": before}, after={**v.after, "weights": r.digest})

    if before is None or r.digest is None:
        for f in fixes:
            note(f, "weights not compared (no optimizer nor trained module found, or no digest)")
        return
    if r.digest == before:
        for f in fixes:
            note(f, "weights identical to the unpatched run's")
        return
    if runner.unpatched is None:
        progress("the unpatched program again (weights differ)")
        runner.unpatched = runner.run([])
    again = runner.unpatched
    if not again.ok or again.digest != before:
        for f in fixes:
            note(f, "weights not compared: two unpatched runs differ (the program is not deterministic)")
        return
    culprits = fixes
    if len(fixes) > 1:
        culprits = []
        for f in fixes:
            progress(f"{f.rule} alone (weights)")
            one = runner.run(_own_patch(f, diff_edits))
            if one.ok and one.digest != before:
                culprits.append(f)
    for f in fixes:
        if f in culprits:
            note(f, "the weights after the audited steps differ from the unpatched run's", "changed-results")
        else:
            note(f, "weights identical to the unpatched run's (alone)")


def amended(results: RuleResults, outcome: Outcome) -> RuleResults:
    """`results` with each verified fix's `verified` set."""
    findings = []
    for i, f in enumerate(results.findings):
        v = outcome.verified.get(i)
        if v is not None and f.fix is not None:
            f = msgspec.structs.replace(f, fix=msgspec.structs.replace(f.fix, verified=v))
        findings.append(f)
    return RuleResults(findings=findings, skipped=results.skipped, errors=results.errors,
                       suppressed=results.suppressed)


def _brief(m: dict[str, Any]) -> str:
    """A finding's measures on one line: its cost and first evidence numbers (the median step and
    the weights are in the note)."""
    if not m:
        return "-"
    if not m.get("finding"):
        return "gone"
    shown = [(k, v) for k, v in m.items()
             if k not in ("finding", "weights", "median_step_ms", "median_step_cpu_ms", "run_step_ms")
             and v is not None][:3]
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown) or "reported"


def echo(results: RuleResults, outcome: Outcome) -> None:
    """The terminal's verification block: each fix's status and numbers, what was taken out of
    the patch files and why, what could not be verified, and the time it took."""
    if not outcome.verified and not outcome.unverifiable:
        click.echo("verify: no fix to verify")
        return
    click.echo(f"verify: {len(outcome.verified)} fix(es) in {outcome.reruns} re-run(s), {outcome.seconds:.1f} s")
    for i, v in sorted(outcome.verified.items()):
        f = results.findings[i]
        click.echo(f"  {v.status:<15} {f.rule}: {_brief(v.before)} -> {_brief(v.after)}")
        if v.status != "improved":
            click.echo(f"    taken out of fixes.patch: {v.note}")
        else:
            click.echo(f"    {v.note}")
    for text in outcome.unverifiable:
        click.echo(f"  not verifiable here: {text}")
    rows = table(results, outcome)
    if rows:
        click.echo("verify: predicted against measured saving per step, per re-run (ms; predicted: the saving "
                   "of the fixes it held, together; measured: the run's time per step before less the re-run's, "
                   "stalls and the time between steps in it; cpu time: the median step's on the process's CPU "
                   "clock, which other processes' load does not stretch)")
        click.echo(f"  {'predicted':>10}{'measured':>10}{'ratio':>8}{'cpu time':>10}  fixes the re-run held (together)"
                   "; run")
        for row in rows:
            pred, meas, ratio, cpu = (f"{row[k]:.2f}" if row[k] is not None else "-"
                                      for k in ("predicted_ms", "measured_ms", "ratio", "measured_cpu_ms"))
            fixes = " + ".join(row["fixes"]) or row["fix"]
            if row["fix"] == "every fix together" or (row["together"] and len(row["fixes"]) > 1):
                fixes = f"every fix together: {fixes}"
            unpriced = f" (no time saving predicted for {', '.join(u['fix'] for u in row['unpredicted'])})" \
                if row["unpredicted"] else ""
            click.echo(f"  {pred:>10}{meas:>10}{ratio:>8}{cpu:>10}  {fixes}{unpriced}; {row['run']}")


def table(results: RuleResults, outcome: Outcome) -> list[dict[str, Any]]:
    """verify's table, one row per re-run that judged fixes, and one for every fix together where
    that is a re-run of its own. A row is what one re-run measured against what the audit predicted
    for the fixes it held, together: `fixes`, every fix whose edits the re-run held (a fix applied
    after another's holds that one's too), `fix` their names joined; `predicted_ms`, the saving per
    step the audit predicted for them together, as the headline adds fixes up (not the cost of one
    of them: one re-run measures all of its fixes at once), in a rehearsal of this
    machine's time alone; `unpredicted`, those of them with no predicted time saving here, and why
    (no estimate; a rehearsal's GPU estimate, which a re-run on the CPU does not measure); `measured_ms`,
    the run's time per step before less the re-run's (the median step's where a run has none),
    `measured_median_ms` the median step's, and `measured_cpu_ms` the median step's on the process's
    CPU clock; predicted over measured (`ratio`); `run`, how the re-run ran; `together`, whether it
    held every fix that improved."""
    rows = []
    for u in outcome.units:
        held = [results.findings[i] for i in u.held]
        statuses = {outcome.verified[i].status for i in u.held if i in outcome.verified}
        status = "failed" if not u.rerun.ok else statuses.pop() if len(statuses) == 1 else "mixed"
        rows.append(_row(" + ".join(f.rule for f in held), held, status, u.predicted_ms, u.rerun, outcome,
                         u.what, outcome.together is u.rerun))
    t = outcome.together
    if t is not None and not any(u.rerun is t for u in outcome.units):
        fixed = [results.findings[i] for i, v in sorted(outcome.verified.items()) if v.status == "improved"]
        rows.append(_row("every fix together", fixed, "ok" if t.ok else "failed", outcome.together_predicted_ms, t,
                         outcome, "all their edits" if t.ok else t.error, True))
    return rows


def _row(name: str, held: list[Finding], status: str, pred: float | None, r: Rerun, outcome: Outcome, run: str,
         together: bool) -> dict[str, Any]:
    b, cb, rb = outcome.before_ms, outcome.before_cpu_ms, outcome.before_run_ms
    median = round(b - r.median_ms, 3) if r.ok and b is not None and r.median_ms is not None else None
    meas = round(rb - r.run_ms, 3) if r.ok and rb is not None and r.run_ms is not None else median
    cpu = round(cb - r.cpu_ms, 3) if r.ok and cb is not None and r.cpu_ms is not None else None
    unpredicted = [{"fix": f.rule, "why": _why_unpredicted(f)} for f in held
                   if f.cost is None or f.cost.ms_per_step is None]
    gpu = [f for f in held if outcome.rehearsed and _gpu_estimate(f)]
    unpredicted += [{"fix": f.rule, "why": f"a GPU's time ({f.cost.ms_per_step:g} ms/step {f.cost.note}), which "  # type: ignore[union-attr]
                     "this rehearsal's re-run on the CPU does not measure: not in the prediction"} for f in gpu]
    return {"fix": name, "fixes": [f.rule for f in held], "status": status, "predicted_ms": pred,
            "measured_ms": meas, "measured_median_ms": median, "measured_cpu_ms": cpu,
            "ratio": round(pred / meas, 3) if pred is not None and meas else None,
            "unpredicted": unpredicted, "run": run, "together": together}


def _why_unpredicted(f: Finding) -> str:
    note = f.cost.note if f.cost is not None else None
    return note or "its finding carries no time cost"


def amend_run(evidence: Any, results: RuleResults, spec: RunSpec, target_file: str | None, out: Path,
              quiet: bool, done: list) -> RuleResults:
    """auditor.app.finish's amend for `audit run --verify`: verify, and return the results the
    reports render (each fix's `verified` set). `done` receives (results, outcome) for echo_done;
    a run that did not end well is not verified."""
    from auditor.evidence.model import ended_well

    if not ended_well(evidence.ending):
        done.append(None)
        return results

    def progress(what: str) -> None:
        if not quiet:
            click.echo(f"audit: verify: re-running {what} ...", err=True)

    if shutil.which("git") is None:
        done.append("not run: git is not installed (the patches are applied with `git apply`, as you would)")
        return results
    try:
        outcome = verify(evidence, results, spec, target_file, out, progress)
    except KeyboardInterrupt:  # (the reports of the audit itself are still written)
        done.append("interrupted: no fix verified")
        return results
    amended_results = amended(results, outcome)
    save(out, amended_results)
    save_table(out, table(results, outcome))
    done.append((amended_results, outcome))
    return amended_results


def echo_done(done: list) -> None:
    """The verification block after the summary (or why there is none)."""
    if not done or done[0] is None:
        click.echo("verify: not run (the audited run did not complete)")
    elif isinstance(done[0], str):
        click.echo(f"verify: {done[0]}")
    else:
        echo(*done[0])


# --- the verification kept with the run ----------------------------------------------------------

SAVED = "verified.json"  # in the run directory: what `audit report DIR` renders again


class SavedCheck(msgspec.Struct):
    """One fix's verification as saved with the run: which finding (rule, its first location,
    the fix's summary) and what was measured."""

    rule: str
    file: str
    line: int
    summary: str
    verified: Verified


def _key(f: Finding) -> tuple[str, str, int, str]:
    loc = f.locations[0] if f.locations else None
    return f.rule, loc.file if loc else "", loc.line if loc else 0, f.fix.summary if f.fix else ""


def save(out: Path, results: RuleResults) -> None:
    """verified.json: each verified fix, for the reports `audit report DIR` writes again."""
    checks = [SavedCheck(*_key(f), verified=f.fix.verified) for f in results.findings
              if f.fix is not None and f.fix.verified is not None]
    write_whole(out / SAVED, msgspec.json.encode(checks))


TABLE = "verify-table.json"  # in the run directory: verify's predicted against measured savings


def save_table(out: Path, rows: list[dict[str, Any]]) -> None:
    """verify-table.json, written whole (auditor.evidence.whole_files)."""
    write_whole(out / TABLE, msgspec.json.encode(rows))


def saved_amend(run_dir: Path) -> Callable[[Any, RuleResults], RuleResults] | None:
    """The amend that gives a re-rendered run its saved verification (None when it has none or
    it cannot be read): a fix verification took out stays out of the patch files."""
    try:
        checks = msgspec.json.decode((run_dir / SAVED).read_bytes(), type=list[SavedCheck])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    by_key = {(c.rule, c.file, c.line, c.summary): c.verified for c in checks}

    def amend(evidence: Any, results: RuleResults) -> RuleResults:
        findings = []
        for f in results.findings:
            v = by_key.get(_key(f))
            if v is not None and f.fix is not None:
                f = msgspec.structs.replace(f, fix=msgspec.structs.replace(f.fix, verified=v))
            findings.append(f)
        return RuleResults(findings=findings, skipped=results.skipped, errors=results.errors,
                           suppressed=results.suppressed)

    return amend
