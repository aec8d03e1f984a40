"""`audit run --verify`: fixes proven by re-running the program on a scratch copy of its project.

The project is a copy of the examples' shared setup and one step with three habits (anomaly
detection left on, a per-step peak-stats reset, a running loss kept as a tensor): three fixes of
the kinds the examples produce (a changed line, a statement replaced by `pass`, a `.detach()`)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from conftest import EXAMPLES, ROOT, audit, patch_text

MIXED = '''"""Three habits in one step."""
import torch
from _common import Batches, make

torch.autograd.set_detect_anomaly(True)
loader, model, opt, loss_fn = make(width=64, n=2048)
batches = Batches(loader)
running_loss = 0.0


def step(i):
    global running_loss
    torch.cuda.reset_peak_memory_stats()
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    running_loss += loss
'''
FAST = ("--no-profile", "--no-numerics")


def held_rules(patch: str) -> list[str]:
    """The rules whose fixes fixes.patch holds, as its preamble lists them (one a line)."""
    return sorted({ln.split()[1] for ln in patch.splitlines() if ln.startswith("#   ")})


def project(tmp_path: Path) -> Path:
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(EXAMPLES / "_common.py", proj / "_common.py")
    (proj / "mixed.py").write_text(MIXED)
    return proj


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def verified_run(tmp_path_factory):
    """The mixed project audited once with --verify, 4 steps: (project, its files' hashes before
    the audit and after it, the audit). The tests that verify in-process start from its evidence
    (--verify records the weights digest as --digest does)."""
    tmp = tmp_path_factory.mktemp("verify")
    proj = project(tmp)
    before = tree_hashes(proj)
    a = audit("run", "mixed.py:step", "--steps", "4", *FAST, "--verify", out=tmp / "out", cwd=proj)
    return proj, before, tree_hashes(proj), a


@pytest.mark.slow
def test_verify_proves_each_fix_and_leaves_the_users_tree_alone(verified_run, tmp_path):
    proj, before, after, a = verified_run
    assert a.returncode == 0, a.stderr
    assert after == before  # byte-identical, and no file added (nor __pycache__)
    # (a copy of the run directory: this test rewrites its verified.json and re-renders it)
    shutil.copytree(a.out, tmp_path / "out")
    a = dataclasses.replace(a, out=tmp_path / "out")
    fixes = {f["rule"]: f["fix"] for f in a.findings if f["fix"] and f["fix"]["edits"]}
    assert set(fixes) == {"anomaly-mode", "graph-leak", "peak-stats-reset"}
    for rule, fix in fixes.items():
        v = fix["verified"]
        assert v["status"] == "improved", (rule, v)
        assert v["before"]["finding"] is True and v["after"]["finding"] is False
        assert v["before"]["weights"] == v["after"]["weights"] and len(v["before"]["weights"]) == 64
        assert "weights identical to the unpatched run's" in v["note"]
    assert fixes["graph-leak"]["verified"]["before"]["nodes_per_step"] == 11.0
    assert fixes["peak-stats-reset"]["verified"]["before"]["calls"] == 4
    patch = patch_text(a.out / "fixes.patch")
    assert held_rules(patch) == ["anomaly-mode", "graph-leak", "peak-stats-reset"] and "verification" not in patch
    assert "verify: 3 fix(es) in 1 re-run(s)" in a.stdout
    assert a.stdout.count("improved ") == 3
    assert "verified: improved" in (a.out / "report.html").read_text()
    # the table: one row per re-run, the fixes it held predicted together (the headline's way of
    # adding them up) against the measured saving (the run's time per step before less the re-run's); here
    # one re-run, fixes.patch's, which held every fix
    rows = json.loads((a.out / "verify-table.json").read_text())
    assert len(rows) == 1
    together = rows[0]
    assert sorted(together["fixes"]) == sorted(fixes) and together["together"] and together["run"] == "with the fixes that keep results"
    costs = {f["rule"]: (f["cost"] or {}).get("ms_per_step") for f in a.findings}
    assert costs["anomaly-mode"] > 0  # (anomaly mode's predicted saving: 35% of its backward pass)
    assert costs["graph-leak"] is None  # (a memory fix: the row says why it has no time saving)
    leak = next(f for f in a.findings if f["rule"] == "graph-leak")
    assert {"fix": "graph-leak", "why": leak["cost"]["note"]} in together["unpredicted"]
    assert "Its saving is not predicted: what its fix saves is memory" in leak["message"]
    # (the fixes with a saving, together: here anomaly-mode's alone, the resets being unpriced
    # without a CUDA device)
    assert costs["peak-stats-reset"] is None and together["predicted_ms"] == costs["anomaly-mode"]
    v = fixes["anomaly-mode"]["verified"]
    assert together["measured_ms"] == pytest.approx(v["before"]["run_step_ms"] - v["after"]["run_step_ms"], abs=1e-3)
    assert together["measured_median_ms"] == pytest.approx(v["before"]["median_step_ms"] - v["after"]["median_step_ms"],
                                                           abs=1e-3)
    head = (a.out / "summary.txt").read_text().splitlines()[0]  # (the whole head: --verbose's)
    assert f"up to {together['predicted_ms']:.2f} ms/step recoverable" in head
    assert "verify: predicted against measured saving per step" in a.stdout
    # `audit report DIR` renders the saved verification again; a fix it took out stays out
    saved = json.loads((a.out / "verified.json").read_text())
    assert {c["rule"] for c in saved} == set(fixes)
    for c in saved:
        if c["rule"] == "graph-leak":
            c["verified"]["status"] = "no-change"
    (a.out / "verified.json").write_text(json.dumps(saved))
    r = audit("report", str(a.out), out=a.out, cwd=proj)
    assert r.returncode == 0, r.stderr
    again = {f["rule"]: f["fix"]["verified"] for f in a.findings if f["fix"] and f["fix"]["edits"]}
    assert again["graph-leak"]["status"] == "no-change" and again["anomaly-mode"]["status"] == "improved"
    patch = patch_text(a.out / "fixes.patch")
    assert held_rules(patch) == ["anomaly-mode", "peak-stats-reset"] and "Left out (graph-leak): verification: no-change" in patch
    ev = a.evidence["weights"]
    assert ev["optimizers"] == 1 and ev["tensors"] > 0 and ev["sha256"] == fixes["graph-leak"]["verified"]["before"]["weights"]


@pytest.fixture(scope="module")
def audited(verified_run):
    """The mixed project's audit (verified_run's, with the weights digest), and its results."""
    from auditor.config import load_config
    from auditor.evidence.load import load_paths
    from auditor.rules.engine import run_rules

    proj, _, _, a = verified_run
    assert a.returncode == 0, a.stderr
    ev = load_paths([a.out])
    here = os.getcwd()
    os.chdir(proj)  # (the rules offer edits in the project the audit ran in)
    try:
        return proj, a.out, ev, run_rules(ev, load_config(proj, (), ()))
    finally:
        os.chdir(here)


def _with_edit(results, rule, edit_of):
    """`results` with `rule`'s fix edits replaced by `edit_of(its first edit)`."""
    from auditor.findings import RuleResults

    out = []
    for f in results.findings:
        if f.rule == rule:
            e = f.fix.edits[0]
            f = msgspec.structs.replace(f, fix=msgspec.structs.replace(f.fix, edits=[edit_of(e)]))
        out.append(f)
    return RuleResults(findings=out, skipped=results.skipped, errors=results.errors)


def _verify(proj, out, ev, results, monkeypatch):
    from auditor import verify
    from auditor.command_options import RunOptions

    monkeypatch.chdir(proj)
    # the weights compare bit for bit: the re-runs get the audited run's thread count (conftest.audit's)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = verify.RunSpec("mixed.py:step", None, (), RunOptions(steps=4, profile=False, numerics=False))
    outcome = verify.verify(ev, results, spec, str(proj / "mixed.py"), out, lambda what: None)
    return verify.amended(results, outcome), outcome


@pytest.mark.slow
def test_a_fix_that_breaks_the_program_is_kept_out_of_the_patch(audited, monkeypatch, tmp_path):
    from auditor.findings import Edit, RuleResults
    from auditor.reports.patch import PatchReport

    proj, out, ev, results = audited
    before = tree_hashes(proj)
    # graph-leak's edit made to raise at run time: the fixes.patch re-run fails, and each fix then
    # runs alone to find the one that broke it
    broken = _with_edit(results, "graph-leak", lambda e: Edit(
        file=e.file, start=e.start, end=e.end, lines=["    raise RuntimeError('broken by its fix')"]))
    broken = RuleResults(findings=[f for f in broken.findings if f.rule != "peak-stats-reset"])
    amended, outcome = _verify(proj, out, ev, broken, monkeypatch)
    status = {f.rule: f.fix.verified.status for f in amended.findings if f.fix and f.fix.verified}
    assert status == {"graph-leak": "failed", "anomaly-mode": "improved"}
    v = next(f.fix.verified for f in amended.findings if f.rule == "graph-leak")
    assert "RuntimeError" in v.note and "broken by its fix" in v.note
    assert outcome.reruns == 3  # fixes.patch, then each of the two alone
    assert "alone: the finding is gone" in next(
        f.fix.verified.note for f in amended.findings if f.rule == "anomaly-mode")
    patch = PatchReport().render(ev, amended, tmp_path)
    assert held_rules(patch) == ["anomaly-mode"]
    assert "Left out (graph-leak): verification: failed" in patch and "raise RuntimeError" not in patch
    assert tree_hashes(proj) == before


@pytest.mark.slow
def test_a_fix_that_changes_the_weights_is_kept_out_of_the_patch(audited, monkeypatch, tmp_path):
    from auditor.findings import Edit, RuleResults
    from auditor.reports.patch import PatchReport

    proj, out, ev, results = audited
    # peak-stats-reset's edit made to change the learning rate: the weights differ, a second
    # unpatched run agrees with the first, so the fix changed the results
    changed = _with_edit(results, "peak-stats-reset", lambda e: Edit(
        file=e.file, start=e.start, end=e.end, lines=["    opt.param_groups[0]['lr'] = 0.5"]))
    changed = RuleResults(findings=[f for f in changed.findings if f.rule == "peak-stats-reset" or not f.fix])
    amended, outcome = _verify(proj, out, ev, changed, monkeypatch)
    v = next(f.fix.verified for f in amended.findings if f.rule == "peak-stats-reset")
    assert v.status == "changed-results", v
    assert v.before["weights"] == ev.weights.sha256 != v.after["weights"]
    assert outcome.reruns == 2  # fixes.patch, then the unpatched program once more
    assert PatchReport().render(ev, amended, tmp_path) == ""


KWARGS_TRAINER = '''"""A trainer whose DataLoader takes num_workers from a dict (0 without a GPU)."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)


class Images(Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(idx)
        img = F.avg_pool2d(torch.rand(1, 3, 72, 72, generator=g), 3, stride=1, padding=1)[0]
        return img[:, :64, :64], idx % 10


kwargs = {"num_workers": 2 if torch.cuda.is_available() else 0}
loader = DataLoader(Images(), batch_size=64, shuffle=True, **kwargs)
model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(100):
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
'''


@pytest.mark.slow
def test_a_dataloader_kwargs_dict_computing_num_workers_is_left_to_the_user(tmp_path):
    """A whole program (the script form): `DataLoader(..., **kwargs)` whose dict computes
    num_workers per machine. A keyword edit on the call would raise TypeError (the value given
    twice), and the dict's expression is the user's choice: the fix says where to set it, no patch
    edits the call, and --verify has nothing to run."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text(KWARGS_TRAINER)
    before = tree_hashes(proj)
    a = audit("run", "train.py", "--steps", "6", "--no-profile", "--no-rehearse", "--verify", out=tmp_path / "out",
              cwd=proj)
    assert a.returncode == 0, a.stderr
    assert tree_hashes(proj) == before
    f = a.rule("dataloader-bound")
    assert f, a.stdout
    fix = f[0]["fix"]
    # the dict's value is an expression (`2 if torch.cuda.is_available() else 0`): the user's own
    # choice per machine, so the fix says where to set it and the patch leaves it alone
    assert fix["edits"] == [] and fix["verified"] is None
    assert "The call takes num_workers from `**kwargs`: set num_workers=2 there; the patch leaves it alone" \
        in fix["summary"]
    patch = a.out / "fixes.patch"
    assert not patch.exists() or "DataLoader(" not in patch.read_text()


# --- the judging, without re-running anything ------------------------------------------------------

def _finding(ms=None, **evidence):
    return {"rule": "x", "locations": [{"file": "/p/train.py", "line": 3}], "cost": {"ms_per_step": ms},
            "evidence": evidence}


def test_judge_reads_the_findings_of_the_two_runs():
    from auditor.verify import Rerun, judge

    before = _finding(40.0, syncs_per_step=2.0, flag=True)
    gone = judge(before, 100.0, Rerun(ok=True, findings=[], median_ms=60.0, cpu_ms=45.0, run_ms=70.0),
                 "with fixes.patch", before_cpu=80.0, before_run=150.0)
    # (the median step's process CPU time beside it: verify's table measures the saving on both clocks)
    assert gone.status == "improved" and gone.after == {"finding": False, "median_step_ms": 60.0, "ms_per_step": None,
                                                        "median_step_cpu_ms": 45.0, "run_step_ms": 70.0}
    assert gone.before == {"finding": True, "median_step_ms": 100.0, "ms_per_step": 40.0, "syncs_per_step": 2.0,
                           "median_step_cpu_ms": 80.0, "run_step_ms": 150.0}
    # the step's time stated is the run's time per step (stalls in it), the median step beside it
    assert gone.note == "with fixes.patch: the finding is gone; run's time 150.0 -> 70.0 ms/step (median step 100.0 -> 60.0 ms)"
    # a fix of stalls: the median step rises a little, the run's time falls: not slower
    stalls = judge(before, 10.0, Rerun(ok=True, findings=[], median_ms=12.0, run_ms=12.5), "w", before_run=40.0)
    assert stalls.note == "w: the finding is gone; run's time 40.0 -> 12.5 ms/step (median step 10.0 -> 12.0 ms)"
    slower = judge(before, 10.0, Rerun(ok=True, findings=[], median_ms=9.0, run_ms=50.0), "w", before_run=40.0)
    assert slower.note.endswith("run's time 40.0 -> 50.0 ms/step (median step 10.0 -> 9.0 ms) (slower)")
    # a run with no run's time: the median step alone
    # the same rule in the same file of the scratch copy is the same finding
    moved = dict(_finding(12.0), locations=[{"file": "/tmp/audit-verify-1/tree-1/train.py", "line": 5}])
    smaller = judge(before, 100.0, Rerun(ok=True, findings=[moved], median_ms=70.0), "w")
    assert smaller.status == "improved" and "its cost fell from 40.00 to 12.00 ms/step" in smaller.note
    same = judge(before, 100.0, Rerun(ok=True, findings=[_finding(35.0)], median_ms=130.0), "w")
    assert same.status == "no-change" and same.note.endswith("median step 100.0 -> 130.0 ms (slower)")
    other_file = dict(_finding(35.0), locations=[{"file": "/p/other.py", "line": 3}])
    assert judge(before, 100.0, Rerun(ok=True, findings=[other_file], median_ms=90.0), "w").status == "improved"
    failed = judge(before, 100.0, Rerun(ok=False, error="the patch does not apply: corrupt patch"), "w")
    assert failed.status == "failed" and failed.after == {} and failed.note == "w: the patch does not apply: corrupt patch"


def test_read_rerun_says_why_the_patched_program_failed(tmp_path):
    from auditor.verify import read_rerun

    (tmp_path / "findings.json").write_text(json.dumps({"findings": [], "steps": {"median_ms": 5.0},
                                                        "ending": {"exception": "ValueError", "message": "bad"}}))
    (tmp_path / "evidence.json").write_text(json.dumps({"weights": {"sha256": "ab"}}))
    assert read_rerun(tmp_path, 3, "").error == "the patched program failed (ValueError: bad)"
    ok = read_rerun(tmp_path, 1, "")  # (exit 1: --fail-on of the user's config; the program ran)
    assert ok.ok and ok.digest == "ab" and ok.median_ms == 5.0
    assert read_rerun(tmp_path / "none", 4, "x\naudit: internal error: boom\n").error == \
        "the patched program failed (audit: internal error: boom)"


def test_copy_project_leaves_out_vcs_venvs_caches_and_outputs(tmp_path, monkeypatch):
    from auditor import verify

    src, dest = tmp_path / "src", tmp_path / "dest"
    for rel in ("train.py", "pkg/mod.py", ".git/HEAD", "venv/pyvenv.cfg", "venv/lib/x.py", "pkg/__pycache__/m.pyc",
                "audit-out/run/findings.json", "runs/out/evidence.json", "data/big.bin"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    monkeypatch.setattr(verify, "LINK_BYTES", len("data/big.bin") - 1)
    verify.copy_project(src, dest, skip=(src / "runs" / "out",))
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["data/big.bin", "pkg/mod.py", "train.py"]
    assert (dest / "data" / "big.bin").is_symlink() and not (dest / "train.py").is_symlink()


def test_verify_is_refused_for_a_launch(tmp_path):
    a = audit("run", "examples/clean.py:step", "--verify", "--nproc-per-node", "2", out=tmp_path / "out")
    assert a.returncode == 2 and a.stderr.strip() == \
        "audit: error: --verify re-runs a single process; it does not apply to a distributed launch"


class _Runs:
    """A stand-in Runner: each run() returns the next of `reruns`."""

    def __init__(self, *reruns):
        self.reruns, self.calls, self.unpatched = list(reruns), [], None

    def run(self, patches, env=None):
        self.calls.append(patches)
        return self.reruns.pop(0)


def _weights_outcome(runner, after_digest, fixes=("a", "b")):
    from auditor.findings import Finding, Fix, Verified
    from auditor.verify import Outcome, Rerun, _check_weights

    found = [Finding(rule=r, severity="warning", title="", message="", fix=Fix(summary=r)) for r in fixes]
    index = {id(f): i for i, f in enumerate(found)}
    outcome = Outcome(verified={i: Verified(status="improved", note="with fixes.patch: the finding is gone")
                                for i in range(len(found))})
    _check_weights(Rerun(ok=True, digest=after_digest), "w0", found, runner, [], index, 1.0, outcome,
                   lambda what: None, lambda edits: type("P", (), {"diff": "d"})())
    return [outcome.verified[i] for i in range(len(found))]


def test_weights_that_differ_blame_the_fix_only_when_the_program_is_deterministic():
    from auditor.verify import Rerun

    same = _weights_outcome(_Runs(), "w0")
    assert [v.status for v in same] == ["improved", "improved"]
    assert same[0].before["weights"] == same[0].after["weights"] == "w0"
    # two unpatched runs differ: no fix is blamed, and no per-fix run is made
    runs = _Runs(Rerun(ok=True, digest="w-other"))
    flaky = _weights_outcome(runs, "w1")
    assert [v.status for v in flaky] == ["improved", "improved"] and len(runs.calls) == 1
    assert "two unpatched runs differ (the program is not deterministic)" in flaky[0].note
    # the unpatched program agrees with the audit: each fix alone finds the one that changed them
    runs = _Runs(Rerun(ok=True, digest="w0"), Rerun(ok=True, digest="w0"), Rerun(ok=True, digest="w2"))
    blamed = _weights_outcome(runs, "w1")
    assert [v.status for v in blamed] == ["improved", "changed-results"] and len(runs.calls) == 3
    assert blamed[1].note.endswith("the weights after the audited steps differ from the unpatched run's")
    assert "weights identical to the unpatched run's (alone)" in blamed[0].note


MODULE_TRAINER = """import torch
from ._common import Batches, make

loader, model, opt, loss_fn = make(width=64, n=2048)
batches = Batches(loader)
for i in range(1000):
    torch.cuda.reset_peak_memory_stats()
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
"""


@pytest.mark.slow
def test_verify_a_module_program_compares_its_weights(tmp_path):
    """`-m pkg.train -- ARGS`: the re-run is the same module in the copy; the weights of a whole
    program are taken from the optimizers found at its steps' ends (its `__main__` is freed by the
    time it has run)."""
    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "pkg" / "__init__.py").write_text("")
    shutil.copy(EXAMPLES / "_common.py", proj / "pkg" / "_common.py")
    (proj / "pkg" / "train.py").write_text(MODULE_TRAINER)
    before = tree_hashes(proj)
    a = audit("run", "-m", "pkg.train", "--steps", "4", *FAST, "--select", "peak-stats-reset", "--verify",
              "--", "--flag", out=tmp_path / "out", cwd=proj)
    assert a.returncode == 0, a.stderr
    assert tree_hashes(proj) == before
    assert a.evidence["weights"]["optimizers"] == 1
    v = a.rule("peak-stats-reset")[0]["fix"]["verified"]
    assert v["status"] == "improved" and v["after"]["finding"] is False, v
    assert v["before"]["weights"] == v["after"]["weights"] == a.evidence["weights"]["sha256"]
    assert "weights identical to the unpatched run's" in v["note"]


def test_a_target_outside_the_patch_root_is_not_verifiable(tmp_path, monkeypatch):
    from auditor.command_options import RunOptions
    from auditor.verify import Runner, RunSpec

    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path / "here")  # (no git repository: the patches apply at the current directory)
    r = Runner(RunSpec(str(tmp_path / "there" / "train.py"), None, (), RunOptions(steps=3)), str(tmp_path / "there" / "train.py"),
               tmp_path / "out")
    try:
        assert r.why_not == f"the target is outside {(tmp_path / 'here').resolve()}, where the patches apply"
    finally:
        r.close()
    inside = Runner(RunSpec("train.py", None, (), RunOptions(steps=3)), str(tmp_path / "here" / "train.py"),
                    tmp_path / "out")
    inside.close()
    assert inside.why_not is None


def test_a_fix_verification_took_out_is_in_no_patch_nor_sarif_and_its_card_says_why(tmp_path):
    from test_reporters import make_case

    from auditor.findings import RuleResults, Verified
    from auditor.reports.html import HtmlReport
    from auditor.reports.patch import PatchReport
    from auditor.reports.sarif import SarifReport

    case = make_case(tmp_path)
    with_edits = [f for f in case.results.findings if f.fix and f.fix.edits and not f.fix.changes_numerics]
    assert with_edits
    out = with_edits[0]
    failed = Verified(status="failed", before={"finding": True, "calls": 50}, after={},
                      note="with fixes.patch: the patched program failed (TypeError: boom)")
    findings = [msgspec.structs.replace(f, fix=msgspec.structs.replace(f.fix, verified=failed)) if f is out else f
                for f in case.results.findings]
    results = RuleResults(findings=findings, skipped=case.results.skipped, errors=case.results.errors)
    patch = PatchReport().render(case.evidence, results, tmp_path)
    assert f"Left out ({out.rule}): verification: failed: with fixes.patch: the patched program failed" in patch
    assert not [ln for ln in patch.splitlines() if ln.startswith("#   ") and ln.split()[1] == out.rule]
    sarif = json.loads(SarifReport().render(case.evidence, results, tmp_path))
    assert not [r for r in sarif["runs"][0]["results"] if r["ruleId"] == out.rule and r.get("fixes")]
    page = HtmlReport().render(case.evidence, results, tmp_path)
    page = page if isinstance(page, str) else page.decode()
    assert "verified: failed</strong> (with fixes.patch: the patched program failed (TypeError: boom)): taken " \
           "out of fixes.patch" in page


def test_environment_variables_in_a_fixs_config_are_exported_for_its_rerun():
    from auditor.findings import Fix
    from auditor.verify import env_config

    fix = Fix(summary="s", config={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "DataLoader.num_workers": 4,
                                   "log_every_n_steps": 50})
    assert env_config(fix) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_the_table_has_a_row_per_rerun_naming_the_fixes_it_held():
    """A re-run of fixes.patch holds all of its fixes: one row, predicted as those fixes together
    (Unit.predicted_ms), the ones with no time saving named with why; in a rehearsal a GPU estimate
    is named apart (a re-run on the CPU does not measure it); a fix re-run on its own is its own row."""
    from auditor.findings import Cost, Finding, Fix, Verified
    from auditor.verify import Outcome, Rerun, Unit, table

    sync = Cost(ms_per_step=0.01, share_of_step=None, measured=False,
                note="estimated for an A100 SXM4 80GB (the default): 1 synchronising call(s)/step x 10 us")
    leak = Cost(ms_per_step=None, share_of_step=None, measured=False, note="what its fix saves is memory")
    found = [Finding(rule="peak-stats-reset", severity="warning", title="", message="", cost=sync, fix=Fix(summary="")),
             Finding(rule="graph-leak", severity="warning", title="", message="", cost=leak, fix=Fix(summary="")),
             Finding(rule="dataloader-bound", severity="warning", title="", message="", fix=Fix(summary=""),
                     cost=Cost(ms_per_step=40.0, share_of_step=None))]
    patch, alone = Rerun(ok=True, median_ms=99.5, cpu_ms=90.0), Rerun(ok=True, median_ms=60.0, cpu_ms=70.0)
    outcome = Outcome(verified={0: Verified(status="improved"), 1: Verified(status="improved"),
                                2: Verified(status="improved")}, before_ms=100.0, before_cpu_ms=91.0,
                      units=[Unit(held=[0, 1], rerun=patch, what="with fixes.patch"),
                             Unit(held=[2], rerun=alone, what="with its own edit", predicted_ms=40.0)],
                      rehearsed=True)
    from auditor.findings import RuleResults

    rows = table(RuleResults(findings=found), outcome)
    assert [r["fixes"] for r in rows] == [["peak-stats-reset", "graph-leak"], ["dataloader-bound"]]
    first, second = rows
    assert first["fix"] == "peak-stats-reset + graph-leak" and first["predicted_ms"] is None
    assert first["measured_ms"] == 0.5 and first["measured_cpu_ms"] == 1.0 and first["ratio"] is None
    assert first["measured_median_ms"] == 0.5  # (no run's time on either side: the median step's saving)
    assert [u["fix"] for u in first["unpredicted"]] == ["graph-leak", "peak-stats-reset"]
    assert "which this rehearsal's re-run on the CPU does not measure" in first["unpredicted"][1]["why"]
    assert second["predicted_ms"] == 40.0 and second["measured_ms"] == 40.0 and second["ratio"] == 1.0
    assert second["unpredicted"] == [] and second["status"] == "improved" and not second["together"]
    # with the run's time on both sides, the saving measured is its own (stalls in it), the median's beside it
    stalled = Rerun(ok=True, median_ms=101.0, cpu_ms=90.0, run_ms=110.0)
    outcome = dataclasses.replace(outcome, before_run_ms=150.0,
                                  units=[Unit(held=[2], rerun=stalled, what="with its own edit", predicted_ms=40.0)])
    (row,) = table(RuleResults(findings=found), outcome)
    assert (row["measured_ms"], row["measured_median_ms"], row["ratio"]) == (40.0, -1.0, 1.0)


@pytest.mark.slow
def test_a_fix_of_workers_started_every_epoch_is_measured_by_the_runs_time(tmp_path):
    """tests/data/run_time/epoch_restarts.py: 2 DataLoader workers started again at each of its
    epochs, every 8 steps; worker-restarts' persistent_workers=True re-run. The epoch starts are
    between steps, out of the median step: the saving verify measures is the run's time per step,
    before less the re-run's, the median step's beside it."""
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "run_time" / "epoch_restarts.py", proj / "epoch_restarts.py")
    a = audit("run", "epoch_restarts.py", "--steps", "40", "--verify", out=tmp_path / "out", cwd=proj,
              env={"OMP_NUM_THREADS": "1"})
    assert a.returncode == 0, a.stderr[-3000:]
    (f,) = a.rule("worker-restarts")
    v = f["fix"]["verified"]
    assert v["status"] == "improved" and v["after"]["finding"] is False, v
    before, after = v["before"], v["after"]
    assert before["run_step_ms"] == a.findings_doc["run_time"]["base_ms"]
    assert before["median_step_ms"] == a.findings_doc["steps"]["median_ms"]
    assert (f"the finding is gone; run's time {before['run_step_ms']:.1f} -> {after['run_step_ms']:.1f} ms/step "
            "(median step ") in v["note"]
    assert "(slower" not in v["note"]
    # (its own row: on a loaded machine dataloader-bound may be found too, and re-run apart)
    rows = json.loads((tmp_path / "out" / "verify-table.json").read_text())
    (row,) = [r for r in rows if r["fixes"] == ["worker-restarts"]]
    assert row["predicted_ms"] == f["cost"]["ms_per_step"]
    assert row["measured_ms"] == pytest.approx(before["run_step_ms"] - after["run_step_ms"], abs=1e-3)
    assert row["measured_median_ms"] == pytest.approx(before["median_step_ms"] - after["median_step_ms"], abs=1e-3)
    # the epoch starts gone: most of what was predicted comes back, in the run's time, not the median's
    assert row["measured_ms"] > 0.5 * row["predicted_ms"] and row["measured_ms"] > row["measured_median_ms"]
    assert "measured: the run's time per step before less the re-run's" in a.stdout
