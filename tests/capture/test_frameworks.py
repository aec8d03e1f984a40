"""Trainer frameworks run unmodified (`audit run examples/hf_trainer.py`, `examples/lightning_fit.py`):
their steps are the framework's optimizer steps, what the framework does inside the user's
`trainer.train()` / `trainer.fit()` line is reported as the framework's setting (a config fix), and
no patch edits that line or any file outside the project. Needs the `frameworks` extra."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import EXAMPLES, audit, shared_audit

from auditor.findings import Edit
from auditor.fixes import project_roots, refused_edit

STEPS = 6
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# example -> (its package, the line that calls into the framework, config keys its findings must name)
CASES = {
    "hf_trainer": ("transformers", "trainer.train()",
                   {"TrainingArguments.logging_steps", "TrainingArguments.logging_nan_inf_filter",
                    "batch.attention_mask"}),
    "lightning_fit": ("lightning", "trainer.fit(", {"Trainer.enable_progress_bar"}),
}


@pytest.fixture(scope="module", params=list(CASES))
def framework_audit(request, tmp_path_factory):
    pytest.importorskip(CASES[request.param][0])
    if request.param == "hf_trainer":
        pytest.importorskip("accelerate")
    a = shared_audit(tmp_path_factory, f"framework-{request.param}", "run", f"examples/{request.param}.py",
                     "--steps", str(STEPS), "--no-profile", "--quiet", env=ONE_THREAD)
    return request.param, a


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(text))


@pytest.mark.slow
def test_steps_are_the_frameworks_optimizer_steps(framework_audit):
    name, a = framework_audit
    assert a.returncode == 0, a.stderr[-3000:]
    ev = a.evidence
    assert len(ev["steps"]) == STEPS
    assert ev["program"]["steps_by"] == "optimizer"
    assert ev["program"]["ended_by_audit"] and ev["program"]["exit_code"] is None
    assert "1 per iteration" in ev["program"]["steps_found"], ev["program"]["steps_found"]
    for s in ev["steps"]:  # each step: one optimizer step, one forward pass
        kinds = [t["kind"] for t in s["tallies"] for _ in range(t["count"])]
        assert kinds.count("optimizer") == 1 and kinds.count("forward") == 1, (s["index"], kinds)


@pytest.mark.slow
def test_framework_costs_are_its_settings_at_the_users_call(framework_audit):
    name, a = framework_audit
    _, call, keys = CASES[name]
    example = EXAMPLES / f"{name}.py"
    syncs = a.rule("host-sync")
    assert syncs, [f["rule"] for f in a.findings]
    f = syncs[0]
    assert f["locations"][0]["file"] == str(example) and f["locations"][0]["line"] == _line_of(example, call)
    assert keys <= set(f["fix"]["config"]), f["fix"]
    assert not f["fix"]["edits"] and not f["fix"]["patch"]
    # every sync there is the framework's or its model library's: each site names the functions
    # that made it, and the user's own remedies (an edit of their line) are not advised
    assert all(site["inside"] for site in f["evidence"]["sites"]), f["evidence"]["sites"]
    assert "keep control flow on host values" not in f["fix"]["summary"], f["fix"]["summary"]
    assert "accumulate on the device" not in f["fix"]["summary"], f["fix"]["summary"]
    for finding in a.findings:  # nothing blamed on library files
        assert all("site-packages" not in loc["file"] for loc in finding["locations"]), finding


@pytest.mark.slow
def test_no_patch_edits_the_framework_call(framework_audit):
    """What the framework does inside the user's call is the framework's setting (a config fix): no
    finding of these audits carries a code edit, so no patch is written that could edit the call or
    a file outside the project (the refusal of such edits: the test below)."""
    name, a = framework_audit
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.findings
    assert [f["rule"] for f in a.findings if f["fix"]["edits"] or f["fix"]["patch"]] == []
    assert not (a.out / "fixes.patch").exists()


def test_edits_outside_the_project_or_removing_a_framework_call_are_refused(tmp_path):
    """fixes.refused_edit, which the rule engine applies to every finding's edits."""
    pkg = tmp_path / "venv" / "lib" / "site-packages" / "framework"
    pkg.mkdir(parents=True)
    (pkg / "loop.py").write_text("import torch\n\ndef fit():\n    torch.cuda.empty_cache()\n")
    project = tmp_path / "project"
    project.mkdir()
    train = project / "train.py"
    train.write_text("import gc\nimport torch\nfrom framework import Trainer\n\ntrainer = Trainer()\n"
                     "trainer.fit(model)\ntorch.cuda.empty_cache()\ngc.collect()\n")
    roots = [project]
    other = tmp_path / "elsewhere.py"
    other.write_text("x = 1\n")

    def removal(file: Path, line: int) -> Edit:
        return Edit(file=str(file), start=line, end=line, lines=["pass  # audit: forced cleanup removed"])

    assert refused_edit(removal(pkg / "loop.py", 4), roots)  # a library's file
    assert refused_edit(Edit(file=str(other), start=1, end=1, lines=["x = 2"]), roots)  # outside the project
    assert "calls into a library" in refused_edit(removal(train, 6), roots)  # trainer.fit(model)
    assert refused_edit(removal(train, 7), roots) is None  # torch.cuda.empty_cache(): the call itself
    assert refused_edit(removal(train, 8), roots) is None  # gc.collect()
    assert refused_edit(Edit(file=str(train), start=5, end=5, lines=["trainer = Trainer(x=1)"]), roots) is None
    assert Path.cwd().resolve() in [r.resolve() for r in project_roots("")] or project_roots("")


@pytest.mark.slow
def test_a_slow_trainer_dataloader_is_fixed_in_the_frameworks_arguments(framework_audit):
    """The Trainer builds its DataLoader from `TrainingArguments`: the wait for data is named at the
    user's `trainer.train()` line with the framework's settings as config (dataloader-bound fell back
    to DataLoader keywords, which the user never writes there), and nothing is edited."""
    name, a = framework_audit
    if name != "hf_trainer":
        pytest.skip("the Lightning example's DataLoader is the user's own")
    [f] = a.rule("dataloader-bound")
    example = EXAMPLES / f"{name}.py"
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(example), _line_of(example, "trainer.train()"))]
    assert f["fix"]["config"]["TrainingArguments.dataloader_num_workers"] >= 1
    assert not any(k.startswith("DataLoader.") for k in f["fix"]["config"]), f["fix"]["config"]
    assert not f["fix"]["edits"] and "dataloader_num_workers=0" in f["message"]
    # 8 examples a batch, each read in 20 ms while the step waits
    assert f["evidence"]["median_wait_ms"] >= 8 * 20


def test_a_library_installed_with_pip_target_on_pythonpath_is_not_the_users_code(tmp_path):
    """A package imported from a directory of installed distributions outside site-packages (`pip
    install --target vendor`, put on PYTHONPATH: as torchvision was, auditing pytorch/examples
    siamese_network) is a library: a sync inside it is the user's line that called it, not a line
    of the library's (which the audit may not read, and a patch may not edit)."""
    vendor = tmp_path / "vendor"
    (vendor / "vlib").mkdir(parents=True)
    (vendor / "vlib-1.0.dist-info").mkdir()
    (vendor / "vlib" / "__init__.py").write_text("def peek(t):\n    return t.item()\n")
    prog = tmp_path / "prog.py"
    prog.write_text("import torch\nimport vlib\n\nmodel = torch.nn.Linear(4, 1)\n"
                    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nx = torch.randn(8, 4)\n"
                    "for _ in range(6):\n    loss = model(x).pow(2).mean()\n    opt.zero_grad()\n"
                    "    loss.backward()\n    opt.step()\n    vlib.peek(loss)\n")
    a = audit("run", str(prog), "--steps", "6", "--no-profile", "--no-numerics", "--quiet", out=tmp_path / "out",
              cwd=tmp_path, env={"PYTHONPATH": str(vendor)}, process=True)
    assert a.returncode == 0, a.stderr[-3000:]
    syncs = [t for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == "sync"]
    assert syncs and {(t["where"]["file"], t["where"]["line"]) for t in syncs} == {(str(prog), 12)}
    # the finding names the library function that made the sync, and no remedy of the user's own
    [f] = a.rule("host-sync")
    assert "Tensor.item x1/step at line 12 (inside vlib/__init__.py:peek)" in f["message"], f["message"]
    assert f["evidence"]["sites"][0]["inside"] == ["vlib/__init__.py:peek"]
    assert f["fix"]["summary"].startswith("the Tensor.item at line 12 is made inside vlib/__init__.py:peek, library "
                                          "code the line calls: no edit of the line removes it"), f["fix"]["summary"]
    assert not f["fix"]["edits"]


@pytest.mark.slow
def test_an_attention_mask_left_out_is_no_sync(tmp_path, tmp_path_factory):
    """transformers reads each forward's attention_mask back to the host (`padding_mask.all()` in
    masking_utils) to drop an all-ones mask for SDPA's fastest kernel: the example's batches carry an
    all-ones mask, and the finding says to leave it out where no token is padding. Left out, the model
    builds no mask and those syncs are gone; the Trainer's own NaN/Inf test of the loss stays."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    source = (EXAMPLES / "hf_trainer.py").read_text()
    masked = '"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": i % 2'
    assert masked in source
    (tmp_path / "unmasked.py").write_text(source.replace(masked, '"input_ids": ids, "labels": i % 2'))
    runs = {"masked": shared_audit(tmp_path_factory, "framework-hf_trainer", "run", "examples/hf_trainer.py",
                                   "--steps", str(STEPS), "--no-profile", "--quiet", env=ONE_THREAD),
            "unmasked": audit("run", str(tmp_path / "unmasked.py"), "--steps", str(STEPS), "--no-profile", "--quiet",
                              out=tmp_path / "unmasked", env=ONE_THREAD)}
    found = {}
    for name, a in runs.items():
        assert a.returncode == 0, a.stderr[-3000:]
        (found[name],) = [f for f in a.rule("host-sync") if "outside" not in (f["cost"]["note"] or "")]
    masked_f, unmasked_f = found["masked"], found["unmasked"]
    inside = lambda f: {i for site in f["evidence"]["sites"] for i in site["inside"]}  # noqa: E731
    assert "transformers/masking_utils.py:_ignore_bidirectional_mask_sdpa" in inside(masked_f)
    assert masked_f["fix"]["config"]["batch.attention_mask"] == "left out where no token is padding"
    assert "can leave `attention_mask` out of the inputs" in masked_f["fix"]["summary"]
    assert not any("masking_utils" in i for i in inside(unmasked_f)), unmasked_f["evidence"]["sites"]
    assert "batch.attention_mask" not in unmasked_f["fix"]["config"]
    assert unmasked_f["evidence"]["syncs_per_step"] < masked_f["evidence"]["syncs_per_step"]
