"""[tool.auditor] in pyproject.toml, --select/--ignore, and `# audit: ignore[...]` comments."""
from __future__ import annotations

import shutil

import pytest

from conftest import EXAMPLES, audit


# examples/forced_cleanup.py's step without its model and optimizer: these tests are of which
# findings the config lets through, not of the rule; the audited program never imports
# torch._dynamo (an optimizer's first call does: ~1.1 s of CPU a run).
FORCED_CLEANUP = """import gc

import torch

w = torch.zeros(3)


def step(i):
    w.add_(1)
    gc.collect()  # expect: forced-cleanup
    torch.cuda.empty_cache()  # expect: forced-cleanup
"""


def make_project(path):
    """A user project in `path` holding the forced-cleanup step (and a copy of the host-sync trainer)."""
    (path / "forced_cleanup.py").write_text(FORCED_CLEANUP)
    for name in ("_common.py", "host_sync.py"):
        shutil.copy(EXAMPLES / name, path / name)
    return path


@pytest.fixture
def project(tmp_path):
    return make_project(tmp_path)


def run(project, *args, name="forced_cleanup"):
    return audit("run", f"{project / name}.py:step", "--steps", "6", "--quiet", "--no-profile", *args,
                 out=project / "out", cwd=project)


def reanalyze(project, *args, run_out=None):
    """The rules again on the saved run (project/out, or `run_out`), with the config of `project`
    (the working directory) as it is now: `audit analyze` reads the same pyproject.toml, flags and
    comments as `audit run` (and costs no new run)."""
    return audit("analyze", str(run_out or project / "out"), "--quiet", *args, out=project / "again", cwd=project)


@pytest.fixture(scope="module")
def fail_on_and_select_run(tmp_path_factory):
    """One run of the forced-cleanup trainer under a pyproject.toml that sets fail-on and gives
    select as one string: (its project, the audit). Two settings that do not touch each other
    (which findings are judged; which severity fails the run), each asserted by its own test."""
    project = make_project(tmp_path_factory.mktemp("fail-on-select"))
    (project / "pyproject.toml").write_text('[tool.auditor]\nfail-on = "warning"\nselect = "forced-cleanup"\n')
    return project, run(project)


def test_pyproject_ignore_and_fail_on(fail_on_and_select_run, tmp_path):
    shared, a = fail_on_and_select_run
    assert a.returncode == 1 and a.rule("forced-cleanup")
    # --quiet: the one closing line on stdout, nothing else
    assert a.stdout.splitlines() == [f"audit: 1 finding(s), run completed; report in {shared / 'out'}"]
    # (judged again from a folder of its own, under a file that also ignores the rule)
    (tmp_path / "pyproject.toml").write_text('[tool.auditor]\nfail-on = "warning"\nignore = ["forced-cleanup"]\n')
    a = reanalyze(tmp_path, run_out=shared / "out")
    assert a.returncode == 0 and not a.rule("forced-cleanup")


def test_rule_options_from_pyproject(example_audit, tmp_path):
    a = example_audit("dataloader_bound")  # (the session's audit: tests/rules/test_examples.py reads it too)
    assert a.rule("dataloader-bound")
    # (a share can be at most 1: a value past it is refused)
    (tmp_path / "pyproject.toml").write_text('[tool.auditor.rules.dataloader-bound]\nmin-share = 0.99\n')
    again = reanalyze(tmp_path, run_out=a.out)
    assert again.returncode == 0 and not again.rule("dataloader-bound"), again.stderr
    # (and without the file, the same evidence judged again keeps it: the option is what removed it)
    (tmp_path / "pyproject.toml").unlink()
    assert reanalyze(tmp_path, run_out=a.out).rule("dataloader-bound")


def test_unknown_option_is_a_usage_error(project):
    (project / "pyproject.toml").write_text('[tool.auditor.rules.host-sync]\nmin-share = 1\n')
    a = run(project, name="host_sync")
    assert a.returncode == 2 and "unknown option(s) for rule host-sync: min-share" in a.stderr
    assert len(a.stderr.strip().splitlines()) == 1


def test_select_and_ignore_flags(project):
    a = run(project, "--select", "host-sync")
    assert a.returncode == 0 and a.findings == []
    assert reanalyze(project).rule("forced-cleanup")  # the run's evidence holds it: --select kept it out
    a = reanalyze(project, "--ignore", "forced-cleanup,host-sync")
    assert a.returncode == 0 and a.findings == []


def test_select_flag_runs_a_rule_the_file_ignores(project):
    """README: `--select` overrides the file. A rule named on the command line runs although the
    file's `ignore` lists it (it was left out without a word); `--ignore` still adds to the file's."""
    (project / "pyproject.toml").write_text('[tool.auditor]\nignore = ["forced-cleanup"]\n')
    a = run(project, "--select", "forced-cleanup,host-sync")
    assert a.returncode == 0 and [f["rule"] for f in a.findings] == ["forced-cleanup"]
    assert not reanalyze(project).rule("forced-cleanup")  # without the flag the file's ignore holds
    a = reanalyze(project, "--select", "forced-cleanup", "--ignore", "forced-cleanup")
    assert a.returncode == 0 and a.findings == []


def test_suppression_comments(project):
    src = project / "forced_cleanup.py"
    lines = src.read_text().splitlines()
    gc_line = next(i for i, ln in enumerate(lines) if ln.strip().startswith("gc.collect()"))
    lines[gc_line] += "  # audit: ignore[forced-cleanup]"
    src.write_text("\n".join(lines) + "\n")
    a = run(project)
    f = a.rule("forced-cleanup")[0]  # the empty_cache line still reports
    assert [loc["line"] for loc in f["locations"]] == [gc_line + 2]
    empty = gc_line + 1
    lines[empty] += "  # audit: ignore"
    src.write_text("\n".join(lines) + "\n")
    a = reanalyze(project)
    assert not a.rule("forced-cleanup") and a.findings_doc["suppressed"] == 1


@pytest.mark.parametrize("toml, message", [
    ('[tool.auditor]\nselect = 5\n', "select must be a list of rule ids, not 5"),
    ('[tool.auditor]\nignore = [1, 2]\n', "ignore must be a list of rule ids"),
    ('[tool.auditor]\nrules = "x"\n', "rules must be tables"),
    ('[tool.auditor.rules]\nhost-sync = 5\n', "rules must be tables"),
    ('[tool]\nauditor = 5\n', "[tool.auditor] must be a table"),
    ('[tool.auditor.rules.dataloader-bound]\nmin-share = "abc"\n',
     "option min-share of rule dataloader-bound must be a number, not 'abc'"),
    ('[tool.auditor.rules.host-sync]\nmin-share-of-steps = true\n', "must be a number, not True"),
    # out of range: a share over 1 (or a negative threshold) would turn the rule off unseen
    ('[tool.auditor.rules.host-sync]\nmin-share-of-steps = 1.5\n',
     "option min-share-of-steps of rule host-sync must be between 0 and 1, not 1.5"),
    ('[tool.auditor.rules.step-slowdown]\nmin-correlation = -0.5\n', "must be between 0 and 1, not -0.5"),
    ('[tool.auditor.rules.dataloader-bound]\nmin-wait-ms = -1\n',
     "option min-wait-ms of rule dataloader-bound must be >= 0, not -1"),
    ('[tool.auditor.rules.forced-cleanup]\nmax-interval = 0\n',
     "option max-interval of rule forced-cleanup must be >= 1, not 0"),
    ('[tool.auditor.rules.grad-explosion]\nclip-percentile = 101\n', "must be between 0 and 100, not 101"),
    # a rise of a share is at most 1; a factor under 1 would ask less of a run under rising load
    ('[tool.auditor.rules.step-slowdown]\nmax-load-rise = 1.5\n',
     "option max-load-rise of rule step-slowdown must be between 0 and 1, not 1.5"),
    ('[tool.auditor.rules.step-slowdown]\nload-slowdown = 0.5\n',
     "option load-slowdown of rule step-slowdown must be >= 1, not 0.5"),
])
def test_a_config_value_of_the_wrong_type_is_a_usage_error(project, toml, message):
    """Caught before anything runs, as one line (it was an internal error, or a rule failing later)."""
    (project / "pyproject.toml").write_text(toml)
    a = run(project)
    assert a.returncode == 2 and message in a.stderr, a.stderr
    assert len(a.stderr.strip().splitlines()) == 1 and not (project / "out").exists()


def test_select_as_one_string_and_an_empty_select_flag(fail_on_and_select_run, tmp_path):
    shared, a = fail_on_and_select_run
    assert a.returncode == 1 and [f["rule"] for f in a.findings] == ["forced-cleanup"]  # (1: fail-on warning)
    # `--select "$RULES"` with RULES unset must not silently turn every rule off (judged from a
    # folder without a pyproject.toml)
    for empty in ("", ","):
        a = reanalyze(tmp_path, "--select", empty, "--fail-on", "info", run_out=shared / "out")
        assert a.returncode == 2 and "--select: no rule id given" in a.stderr


def test_options_arrive_typed_with_their_declared_defaults():
    """A rule's check receives its declared options, each the config's value (a whole number given
    for a float option as a float) or its default, read by attribute or by name; an option the
    rule does not declare is an error, not a default."""
    from auditor.config import Config, ConfigError
    from auditor.rules.gpu_idle import GpuIdle

    defaults = Config().options_for(GpuIdle)
    assert dict(defaults) == {o.name: o.default for o in GpuIdle.options}
    assert defaults.min_idle_share == defaults["min-idle-share"] == 0.3 and defaults.gaps == 5
    given = Config(rule_options={"gpu-idle": {"min-idle-share": 1}}, source="pyproject.toml").options_for(GpuIdle)
    assert given.min_idle_share == 1.0 and isinstance(given.min_idle_share, float)
    with pytest.raises(AttributeError, match="no option 'min-share'"):
        given.min_share  # noqa: B018
    with pytest.raises(ConfigError, match="unknown option"):
        Config(rule_options={"gpu-idle": {"min-share": 0.5}}, source="pyproject.toml").options_for(GpuIdle)
    with pytest.raises(ConfigError, match="must be between 0 and 1"):
        Config(rule_options={"gpu-idle": {"min-idle-share": 1.5}}, source="pyproject.toml").options_for(GpuIdle)


def test_the_engine_writes_the_skip_reason_from_what_a_rule_needs():
    """The kind of evidence a rule needs and its wording are the engine's; a rule's own hook adds
    what else it needs of evidence of that kind."""
    from auditor.evidence.model import Evidence
    from auditor.rules.engine import needs_text, skip_reason
    from auditor.rules.registry import all_rules

    assert needs_text(frozenset({"run"})) == "needs a run (`audit run`), not a recording"
    assert needs_text(frozenset({"trace"})) == "needs a profiler trace with CUDA activity"
    assert needs_text(frozenset({"run", "checkpoint"})) == \
        "needs a run (`audit run`), or a checkpoint (`audit checkpoint FILE`)"
    rules = all_rules()
    recording = Evidence(source="trace")
    assert skip_reason(rules["anomaly-mode"](), recording) == "needs a run (`audit run`), not a recording"
    assert skip_reason(rules["step-slowdown"](), recording) == "needs per-step times from a run"
    assert skip_reason(rules["oom-risk"](), recording) == \
        "needs a CUDA memory snapshot (torch.cuda.memory._dump_snapshot pickle)"
    assert skip_reason(rules["anomaly-mode"](), Evidence(source="run")) is None
    assert skip_reason(rules["grad-explosion"](), Evidence(source="run")) == \
        "the run has no numerics evidence (`--no-numerics`, or no step ran)"
