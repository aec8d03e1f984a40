"""Every example trainer, audited for real: its rule fires at the marked lines with the right numbers,
and the clean trainer stays silent at warning level."""
from __future__ import annotations

import shutil
import subprocess
from statistics import median

import pytest

from conftest import EXAMPLES, assert_phases, audit, expected_lines, graded_severity, patch_text, printed_figures

STEPS = 30


def the_finding(a, rule_id):
    found = a.rule(rule_id)
    assert a.returncode == 0, a.stderr
    assert len(found) == 1, [f["rule"] for f in a.findings]
    f = found[0]
    lines = expected_lines(EXAMPLES / f"{rule_id.replace('-', '_')}.py", rule_id)
    assert lines, "example has no # expect marker"
    example = str(EXAMPLES / f"{rule_id.replace('-', '_')}.py")
    assert {(loc["file"], loc["line"]) for loc in f["locations"]} >= {(example, n) for n in lines}
    return f


def tallies(a, kind):
    return [(s["index"], t) for s in a.evidence["steps"] for t in s["tallies"] if t["kind"] == kind]


def timed_steps(a) -> list[dict]:
    """The steps the reported median step is of (Evidence.median_basis), recomputed from the
    evidence: not profiled, not failed, and, where the run checked numerics on some steps, none of
    those."""
    ok = [s for s in a.evidence["steps"] if not s["profiled"] and not s["failed"]]
    checked = any(s["numerics"] is not None for s in a.evidence["steps"])
    return [s for s in ok if s["numerics"] is None] if checked else ok


def test_clean_trainer_is_silent(example_audit):
    a = example_audit("clean")
    assert a.returncode == 0, a.stderr
    assert [f for f in a.findings if f["severity"] != "info"] == []
    doc = a.findings_doc
    assert doc["steps"]["count"] == STEPS and len(doc["steps"]["per_step_ms"]) == STEPS
    assert doc["ending"]["status"] == "completed"
    # the checks' own time per step, as the collector measured it, inside the checked steps; the
    # summary states the cost measured between checked and timed steps instead
    checked = sorted(s["numerics"]["check_in_step_ms"] for s in a.evidence["steps"] if s["numerics"])
    check = doc["steps"]["numerics_check_median_ms"]
    cost = doc["steps"]["own_cost"]
    assert check == round(median(checked), 3) and 0 < check < cost["checked_ms"]
    # a 30-step audit: 4 profiled (3-6), 11 checked (0-2, 7-14), 15 timed (schedule.dense_steps)
    assert cost["timed_steps"] == list(range(15, 30)) and cost["profiled_steps"] == [3, 4, 5, 6]
    assert f"with numerics checks {cost['checked_ms']:.2f} ms median" in (a.out / "summary.txt").read_text()
    # with the numerics collector on, its hooks time the forward and optimizer phases (the probes'
    # own hooks are taken out): one tally per outermost module call and per optimizer step
    assert_phases(a, EXAMPLES / "clean.py", {"Sequential": 12, "CrossEntropyLoss": 12}, {"AdamW": 14})



def test_anomaly_mode(example_audit):
    a = example_audit("anomaly_mode")
    f = the_finding(a, "anomaly-mode")
    assert f["evidence"]["steps_with_anomaly"] == STEPS
    assert "set_detect_anomaly(False)" in "".join(e["lines"][0] for e in f["fix"]["edits"])
    # its predicted saving: 35% of the median backward pass of the steps it was on in (every step)
    backward = {}
    for i, t in tallies(a, "backward"):
        backward[i] = backward.get(i, 0.0) + t["ms"]
    expected = 0.35 * median(backward.values())
    assert f["cost"]["ms_per_step"] == pytest.approx(expected, abs=2e-3) and f["cost"]["measured"] is False
    saved, share = printed_figures(r"saves about ([\d.]+) ms per step \((\d+)% of the run's time\)", f["message"])
    assert saved == pytest.approx(expected, abs=0.006)
    assert share == round(100 * f["cost"]["ms_per_step"] / a.findings_doc["run_time"]["base_ms"])


def test_retained_graph(example_audit):
    a = example_audit("retained_graph")
    f = the_finding(a, "retained-graph")
    assert f["evidence"]["retained_unused"] == 4 * STEPS  # ACCUM micro-batches per step
    assert f["evidence"]["per_step"] == 4.0
    # the saved activations of one micro-batch: at least its 64x512 hidden activations (float32)
    assert f["evidence"]["saved_bytes"] >= 64 * 512 * 4
    assert "retain_graph" not in f["fix"]["edits"][0]["lines"][0]
    # `loss` is reassigned per micro-batch: each graph dies at the next one, so one graph's saved
    # activations are held past its backward at a time, not four
    assert f["evidence"]["alive_at_once"] == 1
    held = f["evidence"]["saved_bytes"] / 2**20
    assert f["cost"]["note"].startswith(
        f"memory: {held:.2f} MiB of saved activations held past their backward (1 graph alive at once); ")
    assert f["cost"]["measured"] is True
    # its predicted saving: that memory, and why no step time is predicted, in its message
    assert f["evidence"]["memory_saved_bytes"] == pytest.approx(f["evidence"]["saved_bytes"], abs=1)
    assert f"Its fix frees {held:.2f} MiB per step; it saves no step time that can be predicted" in f["message"]


def test_sampler_epoch(example_audit):
    """200 samples, 2 replicas, batch 25: 4 batches per epoch, so 30 steps start 8 epochs, all with
    epoch 0; the patch sets the epoch before the line that starts each new epoch's first batch."""
    a = example_audit("sampler_epoch")
    f = the_finding(a, "sampler-epoch")
    assert (f["evidence"]["epochs_started"], f["evidence"]["epochs_repeated"]) == (8, 7)
    assert f["evidence"]["epoch_values"] == [0] * 8
    assert "started 8 epochs and 7 of them repeated" in f["message"]
    assert [e["lines"] for e in f["fix"]["edits"]] == [["        sampler.set_epoch(epoch)"]]
    patch = patch_text(a.out / "fixes.patch")
    assert "sampler.set_epoch(epoch)" in patch and "#   sampler-epoch sampler_epoch.py:" in patch
    assert "[changes results: review it]" in patch.split("#   sampler-epoch ")[1].splitlines()[0]


# Three trainers that retain graphs, each with its own model and its backward(retain_graph=True)
# at its own line, in one step (retained-graph judges each line on its own: the graphs it watches,
# and how many of them are alive at once, are counted per line; no graph of one runs into
# another's). One audit (4 steps, unprofiled, no numerics checks) serves the three tests.
RETAINING = """import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
rnn = nn.GRU(8, 16, batch_first=True)
head = nn.Linear(16, 1)
rnn_opt = torch.optim.SGD([*rnn.parameters(), *head.parameters()], lr=1e-2)
ACCUM = 3
lstm = nn.LSTM(8, 16, batch_first=True)
lstm_head = nn.Linear(16, 1)
lstm_opt = torch.optim.SGD([*lstm.parameters(), *lstm_head.parameters()], lr=1e-2)
state = None


def kept():
    opt.zero_grad()
    losses = []
    for _ in range(3):
        losses.append(model(torch.randn(64, 32)).pow(2).mean())
        losses[-1].backward(retain_graph=True)  # KEPT LINE
    opt.step()
    return float(sum(l.detach() for l in losses))


def carried():
    rnn_opt.zero_grad()
    h = None
    for micro in range(ACCUM):  # the state runs on through the micro-batches, undetached
        y, h = rnn(torch.randn(4, 5, 8), h)
        loss = head(y).pow(2).mean() / ACCUM
        loss.backward(retain_graph=True)  # CARRIED LINE: the next micro-batch's backward needs it
    rnn_opt.step()


def detached():
    global state
    if state is not None:
        state = (state[0].detach(), state[1].detach())
    y, state = lstm(torch.randn(4, 5, 8), state)
    loss = lstm_head(y).pow(2).mean()
    lstm_opt.zero_grad()
    loss.backward(retain_graph=True)  # DETACHED LINE
    lstm_opt.step()


def step(i):
    kept()
    carried()
    detached()
"""


def marked(source: str, marker: str) -> int:
    return next(n for n, t in enumerate(source.splitlines(), 1) if marker in t)


@pytest.fixture(scope="module")
def retaining(tmp_path_factory):
    """RETAINING audited once: (its file, the audit)."""
    tmp = tmp_path_factory.mktemp("retaining")
    trainer = tmp / "retaining.py"
    trainer.write_text(RETAINING)
    a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--no-numerics", "--quiet", out=tmp / "out")
    assert a.returncode == 0, a.stderr
    return trainer, a


def retained_at(a, trainer, marker: str) -> dict:
    """The one retained-graph finding located at the line holding `marker` (and nowhere else)."""
    line = marked(RETAINING, marker)
    [f] = [g for g in a.rule("retained-graph") if (str(trainer), line) in {(loc["file"], loc["line"]) for loc in g["locations"]}]
    assert [loc["line"] for loc in f["locations"]] == [line]
    return f


def test_retained_graphs_kept_together_are_counted_together(retaining):
    """Losses kept in a list hold every micro-batch's graph to the step's end: three at once."""
    trainer, a = retaining
    assert len(a.rule("retained-graph")) == 3  # (one per line: KEPT, CARRIED, DETACHED)
    f = retained_at(a, trainer, "# KEPT LINE")
    ev = f["evidence"]
    assert ev["alive_at_once"] == 3 and ev["per_step"] == 3.0
    assert ev["saved_bytes"] >= 64 * 256 * 4  # at least the hidden activations of one micro-batch
    assert f["cost"]["note"].startswith(f"memory: {3 * ev['saved_bytes'] / 2**20:.2f} MiB of saved activations")


def test_retained_graphs_some_reused_get_no_patch_that_breaks_them(retaining):
    """Micro-batches carry a state, so each backward but the last one's graph is backpropagated
    again by the next: only the last graph of a step is retained for nothing. The finding stands
    (one unused graph a step), but dropping retain_graph from the line would make the second
    micro-batch's backward fail: no edit, and the fix says to keep it for the reused calls.
    Before, fixes.patch (said to change no result) dropped it, and the patched trainer raised."""
    trainer, a = retaining
    f = retained_at(a, trainer, "# CARRIED LINE")
    ev = f["evidence"]
    assert (ev["retained_unused"], ev["retaining_calls"], ev["reused"]) == (4, 12, 8)
    assert f["fix"]["edits"] == [] and f["fix"]["patch"] is None
    assert "8 of 12 calls" in f["fix"]["summary"]
    # fixes.patch (which holds the other two lines' edits) leaves this line alone
    # fixes.patch drops the flag at the other two lines, and leaves this one alone
    source = RETAINING.splitlines()
    removed = [ln[1:] for ln in patch_text(a.out / "fixes.patch").splitlines() if ln[:1] == "-" and ln[:3] != "---"]
    assert removed == [source[marked(RETAINING, m) - 1] for m in ("# KEPT LINE", "# DETACHED LINE")], removed


TBPTT = """import torch
from torch import nn

torch.manual_seed(0)
lstm = nn.LSTM(8, 16, batch_first=True)
head = nn.Linear(16, 1)
opt = torch.optim.SGD([*lstm.parameters(), *head.parameters()], lr=1e-2)
state = None


def step(i):
    global state
    if state is not None:
        state = (state[0].detach(), state[1])
    y, state = lstm(torch.randn(4, 5, 8), state)
    loss = head(y).pow(2).mean()
    opt.zero_grad()
    loss.backward(retain_graph=True)  # RETAIN LINE
    opt.step()
"""


def test_a_graph_the_next_steps_backward_runs_into_is_carried_not_unused(tmp_path, retaining):
    """Truncated BPTT that detaches h but not the LSTM's cell state c, with retain_graph=True added
    to silence "Trying to backward through the graph a second time": step 1's backward runs into
    step 0's graph and fails (the optimizer changed weights it saved). The graph was judged at the
    end of its own step only: "kept 1 graphs alive that no later backward used", and fixes.patch
    (said to change no result) dropped the flag, which brings the other error back. Now it is
    named as carried into the next step, with no patch; with c detached the flag is only unused."""
    line = next(n for n, t in enumerate(TBPTT.splitlines(), 1) if "RETAIN LINE" in t)
    (tmp_path / "tbptt.py").write_text(TBPTT)
    a = audit("run", f"{tmp_path / 'tbptt.py'}:step", "--steps", "4", "--no-profile", "--no-numerics", "--quiet",
              out=tmp_path / "out")
    assert a.returncode == 3 and a.evidence["ending"]["step"] == 1, a.stderr
    [f] = a.rule("retained-graph")
    assert [loc["line"] for loc in f["locations"]] == [line]
    ev = f["evidence"]
    assert (ev["carried"], ev["retaining_calls"], ev["retained_unused"]) == (1, 1, 0)
    assert "the next step's backward ran into" in f["message"] and "detach both h and c" in f["fix"]["summary"]
    assert f["fix"]["edits"] == [] and f["fix"]["patch"] is None
    assert not (tmp_path / "out" / "fixes.patch").exists()
    # the state detached whole (RETAINING's third trainer): each step's graph is its own, retained
    # for nothing, and patched
    trainer, b = retaining
    g = retained_at(b, trainer, "# DETACHED LINE")
    assert "carried" not in g["evidence"] and g["evidence"]["retained_unused"] == 4
    assert [e["start"] for e in g["fix"]["edits"]] == [marked(RETAINING, "# DETACHED LINE")]


def test_graph_leak(example_audit):
    a = example_audit("graph_leak")
    f = the_finding(a, "graph-leak")
    scans = f["evidence"]["scans"]
    nodes = [s["graph_nodes"] for s in scans]
    # scanned after steps 1, 16 (in the middle third: the middle scan) and the last, and after the
    # profiled window (steps 3-6) in place of step 4 (it falls inside it); growth judged over 1, 16, 29
    assert [s["after_step"] for s in scans] == [1, 6, 16, 29]
    assert nodes == sorted(set(nodes)) and f["evidence"]["compared_steps"] == [1, 16, 29]
    per_step = (nodes[-1] - nodes[0]) / (scans[-1]["after_step"] - scans[0]["after_step"])
    assert f["evidence"]["nodes_per_step"] == pytest.approx(per_step, abs=0.01)
    assert f["evidence"]["holders"][0]["name"] == "running_loss"
    assert f["fix"]["edits"][0]["lines"][0].strip().startswith("running_loss += loss.detach()")


def test_host_sync_counts_each_site_on_cpu_as_info(example_audit):
    a = example_audit("host_sync")
    f = the_finding(a, "host-sync")
    assert f["severity"] == "info"  # a CPU-only program: reads counted, nothing said of accelerators
    assert f["cost"]["measured"] is False and f["cost"]["ms_per_step"] is None
    sites = {s["what"]: s for s in f["evidence"]["sites"]}
    assert sites["Tensor.item"]["count"] == STEPS and sites["int(Tensor)"]["count"] == STEPS
    assert f["evidence"]["syncs_per_step"] == 2.0


AMP_TRAINER = """import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""
# The same trainer twice in one step, each half with its own model, optimizer and scaler: a fused
# optimizer's (its scaler's step checks found_inf on the device) and a foreach one's (fused
# refuses foreach=True). Each half's GradScaler.step is at its own line.
FUSED_BESIDE_FOREACH = """import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
fused_model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
fused_opt = torch.optim.AdamW(fused_model.parameters(), lr=1e-3, fused=True)
fused_scaler = torch.amp.GradScaler("cpu")
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
scaler = torch.amp.GradScaler("cpu")
x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))


def step():
    fused_opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(fused_model(x), y)
    fused_scaler.scale(loss).backward()
    fused_scaler.step(fused_opt)  # FUSED STEP
    fused_scaler.update()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)  # FOREACH STEP
    scaler.update()
"""


def _amp_audit(tmp_path_factory, name: str, source: str):
    """SOURCE as amp_trainer.py alone in a fresh git repository, audited for 6 steps, unprofiled."""
    tmp = tmp_path_factory.mktemp(name)
    subprocess.run(["git", "init", "-q"], cwd=tmp, check=True)
    trainer = tmp / "amp_trainer.py"
    trainer.write_text(source)
    a = audit("run", f"{trainer}:step", "--steps", "6", "--no-profile", "--quiet", out=tmp / "out")
    assert a.returncode == 0, a.stderr
    return trainer, a


@pytest.fixture(scope="module")
def amp_unfused(tmp_path_factory):
    """AMP_TRAINER audited once: (its file, the audit)."""
    return _amp_audit(tmp_path_factory, "amp_unfused", AMP_TRAINER)


@pytest.fixture(scope="module")
def amp_fused_beside_foreach(tmp_path_factory):
    """FUSED_BESIDE_FOREACH audited once: (its file, the audit)."""
    return _amp_audit(tmp_path_factory, "amp_fused_foreach", FUSED_BESIDE_FOREACH)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_grad_scaler_step_sync_is_the_users_unless_the_optimizer_is_fused(fused, request):
    """GradScaler.step reads found_inf with .item() inside torch: the user's own line pays for it,
    every step, and a fused optimizer (the fix) takes the check on the device instead (beside a
    foreach optimizer's step, which syncs at its own line)."""
    trainer, a = request.getfixturevalue("amp_fused_beside_foreach" if fused else "amp_unfused")
    (f,) = a.rule("host-sync")
    if fused:
        lines = FUSED_BESIDE_FOREACH.splitlines()
        fused_at, foreach_at = (next(n for n, t in enumerate(lines, 1) if mark in t)
                                for mark in ("# FUSED STEP", "# FOREACH STEP"))
        assert [(s["what"], s["line"], s["count"]) for s in f["evidence"]["sites"]] == [("GradScaler.step", foreach_at, 6)]
        assert fused_at not in {loc["line"] for loc in f["locations"]}
        return
    (site,) = f["evidence"]["sites"]
    assert (site["what"], site["line"], site["count"]) == ("GradScaler.step", 17, 6)
    assert f["locations"][0]["file"] == str(trainer)
    assert f["fix"]["config"] == {"optimizer": {"fused": True}} and "fused=True" in f["fix"]["summary"]


@pytest.mark.parametrize("kwargs", ["", ", foreach=True"], ids=["plain", "foreach"])
def test_grad_scaler_step_sync_gets_a_fused_patch_marked_as_changing_results(tmp_path, kwargs, request):
    """The GradScaler.step sync's fix named fused=True but had no patch: now fixes.patch (marked as
    changing results: fused kernels round slightly differently) adds fused=True to the optimizer the step is given,
    and the patched trainer audits without the sync. An optimizer asking for foreach=True, which
    fused refuses, is left alone (beside a fused one, whose step does not sync)."""
    trainer, a = request.getfixturevalue("amp_fused_beside_foreach" if kwargs else "amp_unfused")
    source = trainer.read_text()
    (f,) = a.rule("host-sync")
    assert [s["what"] for s in f["evidence"]["sites"]] == ["GradScaler.step"]
    opt_line = source.splitlines().index(f"opt = torch.optim.AdamW(model.parameters(), lr=1e-3{kwargs})") + 1
    if kwargs:
        assert "amp_trainer.py" not in patch_text(a.out / "fixes.patch")
        assert f["fix"]["edits"] == [] and "fused=True to the optimizer at line" not in f["fix"]["summary"]
        return
    assert f["fix"]["changes_numerics"] and [e["start"] for e in f["fix"]["edits"]] == [opt_line]
    assert f"fixes.patch adds fused=True to the optimizer at line {opt_line}" in f["fix"]["summary"]
    assert f"#   host-sync amp_trainer.py:{opt_line} [changes results: review it]" in patch_text(a.out / "fixes.patch")
    # applied to a copy of the trainer (the shared audit's folder is read, never written)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    trainer = tmp_path / "amp_trainer.py"
    trainer.write_text(source)
    subprocess.run(["git", "apply", str(a.out / "fixes.patch")], cwd=tmp_path, check=True)
    assert (trainer.read_text().splitlines()[opt_line - 1]
            == "opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)")
    after = audit("run", f"{trainer}:step", "--steps", "6", "--no-profile", "--quiet", out=tmp_path / "after")
    assert after.returncode == 0, after.stderr
    assert after.rule("host-sync") == []


SUMMARY_WRITER = """import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
x, y = torch.randn(256, 32), torch.randn(256, 1)
writer = SummaryWriter({logdir!r})


def step(i):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    writer.add_scalar("loss", loss, i)  # a tensor: fetched from the device at every call
"""


def test_summary_writer_fetching_a_tensor_is_the_users_sync(tmp_path):
    """torch.utils.tensorboard ships inside torch, but it is a logger the user calls: its
    `.cpu()` of the logged tensor is a sync at the user's add_scalar line (counted once, not
    again for the `.numpy()` of the host copy)."""
    trainer = tmp_path / "tb_logging.py"
    trainer.write_text(SUMMARY_WRITER.format(logdir=str(tmp_path / "logs")))
    a = audit("run", f"{trainer}:step", "--steps", "5", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("host-sync")
    [site] = f["evidence"]["sites"]
    line = SUMMARY_WRITER.splitlines().index(
        '    writer.add_scalar("loss", loss, i)  # a tensor: fetched from the device at every call') + 1
    assert (site["what"], site["line"], site["count"]) == ("SummaryWriter: Tensor.cpu", line, 5)
    assert f["evidence"]["syncs_per_step"] == 1.0 and "SummaryWriter.add_* every N steps" in f["fix"]["summary"]


NEW_ITERATOR_EACH_STEP = """import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(2048, 32), torch.randn(2048, 1))
loader = DataLoader(data, batch_size=128, shuffle=True, num_workers=2)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)


def step():
    x, y = next(iter(loader))  # a new iterator: its two workers start every step
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


def test_a_new_dataloader_iterator_every_step(tmp_path):
    """`next(iter(loader))` in the step starts the loader's workers every step (and stops the last
    ones): that time is the step's data wait too, and the finding says where the iterator is made
    and that making it once is the fix."""
    trainer = tmp_path / "reiter.py"
    trainer.write_text(NEW_ITERATOR_EACH_STEP)
    a = audit("run", f"{trainer}:step", "--steps", "6", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("dataloader-bound")
    ev = f["evidence"]
    assert ev["iterator_per_step"] is True and ev["steps_making_an_iterator"] == 6
    made = sorted(sum(t["ms"] for t in s["tallies"] if t["kind"] == "data-iter") for s in a.evidence["steps"])
    assert ev["median_iterator_ms"] == pytest.approx((made[2] + made[3]) / 2, abs=1e-3) and made[0] > 0
    iter_line = NEW_ITERATOR_EACH_STEP.splitlines().index(
        "    x, y = next(iter(loader))  # a new iterator: its two workers start every step") + 1
    assert (str(trainer), iter_line) in {(loc["file"], loc["line"]) for loc in f["locations"]}
    assert f"made in 6 of 6 steps at line {iter_line}" in f["message"] and "2 worker processes" in f["message"]
    assert f["fix"]["summary"].startswith("Make the iterator once, outside the step")
    # the wait now holds most of the step: starting workers, then waiting for their first batch
    assert f["cost"]["share_of_step"] > 0.5


def test_peak_stats_reset_on_a_cpu_machine(example_audit):
    a = example_audit("peak_stats_reset")
    f = the_finding(a, "peak-stats-reset")
    assert f["evidence"]["calls"] == STEPS and f["evidence"]["steps_with_reset"] == STEPS
    env = a.findings_doc["environment"]
    assert env["cuda_standins"] is True and any("idle device" in n for n in env["notes"])
    standin_calls = [t for _, t in tallies(a, "cuda-standin") if t["what"] == "torch.cuda.reset_peak_memory_stats"]
    assert sum(t["count"] for t in standin_calls) == STEPS


def test_forced_cleanup_cost_is_the_measured_time(example_audit):
    """gc.collect()'s time is its cost; without a CUDA device empty_cache() frees nothing, so its
    time (the stand-in's) is not a cost: it is counted, and said to cost on a GPU."""
    a = example_audit("forced_cleanup")
    f = the_finding(a, "forced-cleanup")
    calls = {c["what"]: c for c in f["evidence"]["calls"]}
    assert calls["gc.collect"]["count"] == STEPS and calls["torch.cuda.empty_cache"]["count"] == STEPS
    assert calls["gc.collect"]["timed"] and not calls["torch.cuda.empty_cache"]["timed"]
    # read over the steps the median step is of (the timed ones: the checked and profiled steps'
    # calls run under the audit's own work), each of which collected
    timed = {s["index"] for s in timed_steps(a)}
    per_step: dict[int, float] = {}
    for step, t in tallies(a, "gc-collect"):
        if step in timed:
            per_step[step] = per_step.get(step, 0.0) + t["ms"]
    assert set(per_step) == timed
    # the median collection, a share of the run's time per step; no cost exceeds that time: on a
    # loaded machine it can, and the engine caps it there
    cost = round(median(per_step.values()), 3)
    base = a.findings_doc["run_time"]["base_ms"]
    assert f["cost"]["ms_per_step"] == pytest.approx(min(cost, base), rel=1e-3)
    assert f["cost"]["share_of_step"] == pytest.approx(min(cost, base) / base, rel=1e-2)
    if cost > base:
        assert f["cost"]["note"].startswith("capped at the run's time per step")
    # (the rule takes the median of the unrounded timings, the evidence holds each rounded: the
    # printed cost is this one to within its last digit)
    [printed] = printed_figures(rf"^Forced cleanup runs in the step: remove it or run it rarely\. "
                                rf"In this run gc\.collect\(\) ran {STEPS} times in {STEPS} steps, costing ([\d.]+) ms per step",
                                f["message"])
    assert printed == pytest.approx(cost, abs=0.006), f["message"]
    assert f"torch.cuda.empty_cache() ran {STEPS} times in {STEPS} steps: on a GPU each call waits" in f["message"]


EVAL_CALLBACK = """import torch
from torch import nn

model = nn.Linear(32, 4).to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 32, device="cuda")


def evaluate(i):
    if (i + 1) % 5 == 0:
        with torch.no_grad():
            model(x)
        torch.cuda.empty_cache()


def step(i):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    evaluate(i)
"""


def test_empty_cache_without_a_device_is_estimated_not_timed(tmp_path):
    """A rehearsed GPU trainer whose eval callback empties the cache every 5 steps: the call is
    answered by a stand-in that frees nothing, so its time is no cost: its cost is the device
    model's estimate instead. It was reported as 'costing
    0.00 ms per step (0.0% of the median step)', and the headline as 'up to 0.00 ms/step
    recoverable (0%)'."""
    trainer = tmp_path / "callback.py"
    trainer.write_text(EVAL_CALLBACK)
    a = audit("run", f"{trainer}:step", "--steps", "10", "--no-profile", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    (f,) = a.rule("forced-cleanup")
    assert f["locations"] == [{"file": str(trainer), "line": 13, "code": "torch.cuda.empty_cache()", "note": ""}]
    assert f["evidence"]["calls"][0]["count"] == 2
    # rehearsed: not the stand-in's time but the device model's estimate, 0.2 calls a step x the
    # default A100 row's 10 us sync, shown as such (never "0.00 ms")
    assert f["cost"]["ms_per_step"] == 0.002 and f["cost"]["measured"] is False
    assert "A100 SXM4 80GB (the default" in f["cost"]["note"]
    assert f["message"].startswith("Forced cleanup runs in the step: remove it or run it rarely. In this run "
                                   "torch.cuda.empty_cache() ran 2 times in 10 steps: on a GPU each call waits")
    summary = (a.out / "summary.txt").read_text()  # (the whole lines: --verbose's)
    # (0.2 calls a step x 10 us, graded on the step predicted on the GPU)
    assert f["severity"] == graded_severity(f, a.findings_doc)
    assert "0.00 ms" not in summary and "(0.002 ms/step, 0%, estimated)" in summary


def test_dataloader_bound_share_and_fix(example_audit):
    a = example_audit("dataloader_bound")
    f = the_finding(a, "dataloader-bound")
    # the waits per step, read over the steps the headline's median is of (the timed steps: none of
    # the numerics checks, not profiled), judged on their share of those steps' time; the cost's
    # share is of the run's time per step (findings.json's run_time.base_ms)
    timed = timed_steps(a)
    waits = [sum(t["ms"] for t in s["tallies"] if t["kind"] in ("data-wait", "data-iter")) for s in timed]
    # (over their time less what other processes' load took of it, which the waits leave out too)
    assert sum(waits) / sum(max(s["ms"] - (s["waited_ms"] or 0.0), w) for s, w in zip(timed, waits)) >= 0.25
    assert f["cost"]["ms_per_step"] == pytest.approx(sum(waits) / len(waits), abs=1e-3)
    share = f["cost"]["ms_per_step"] / a.findings_doc["run_time"]["base_ms"]
    assert f["cost"]["share_of_step"] == pytest.approx(share, abs=1e-4)
    # the message prints the cost's share (the one every report prints)
    assert f"({f['cost']['share_of_step']:.0%} of the run's time)" in f["message"]
    assert f["evidence"]["settings"]["num_workers"] == 0
    assert f["fix"]["config"]["DataLoader.num_workers"] >= 2
    assert "num_workers=" in "\n".join(f["fix"]["edits"][0]["lines"])
    # workers draw random augmentations from their own seeds: not a fix that leaves results alone
    assert f["fix"]["changes_numerics"] is True
    patch = patch_text(a.out / "fixes.patch")
    assert "num_workers=" in patch and "#   dataloader-bound " in patch
    assert "[changes results: review it]" in patch.split("#   dataloader-bound ")[1].splitlines()[0]


def test_step_slowdown(example_audit):
    a = example_audit("step_slowdown")
    f = the_finding(a, "step-slowdown")
    # judged on the process's CPU time (a CPU run), which other test workers' load does not scatter
    ev = f["evidence"]
    assert ev["trend_ratio"] >= 1.3 and ev["cpu_ratio"] >= 1.3 and ev["cpu_spearman"] >= 0.6
    # the growing line is the forward over every sample seen: that call is named, at its line
    assert f["evidence"]["growing_phase"]["kind"] == "forward" and f["evidence"]["growing_phase"]["line"] == 21


def test_hook_leak(example_audit):
    """A clipping hook registered on each of the model's 6 parameters in every step: one more on each
    per step, counted at its line."""
    a = example_audit("hook_leak")
    f = the_finding(a, "hook-leak")
    ev = f["evidence"]
    assert (ev["what"], ev["steps"], ev["calls_per_step"], ev["holders"]) == ("Tensor.register_hook", STEPS, 6, 6)
    assert ev["held_first"] == {"step": 0, "hooks": 1} and ev["held_last"] == {"step": STEPS - 1, "hooks": STEPS}
    assert ev["growth_per_step"] == 1.0 and f["cost"] is None
    assert "register the hook once, at setup" in f["fix"]["summary"].lower()


SPIKE_AT_THE_END = """
import sys, time
sys.path.insert(0, {examples!r})
from _common import Batches, make

loader, model, opt, loss_fn = make()
batches = Batches(loader)


def step(i):
    x, y = batches.next()
    opt.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    opt.step()
    if i >= {last} - 1:  # two slow steps at the end (a collection, a checkpoint): CPU work, no trend
        t = time.process_time()
        while time.process_time() - t < 0.25:
            pass
"""


def test_step_slowdown_ignores_slow_steps_at_the_end(tmp_path):
    from conftest import audit

    steps = 20
    trainer = tmp_path / "spike.py"
    trainer.write_text(SPIKE_AT_THE_END.format(examples=str(EXAMPLES), last=steps - 1))
    a = audit("run", f"{trainer}:step", "--steps", str(steps), "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    from auditor.rules._support.trends import quarter_medians

    used = [s for s in a.evidence["steps"] if not s["profiled"] and s["index"] >= 2]
    assert len(used) >= 12  # enough steps for the rule to judge (its min-steps)
    first, last = quarter_medians([s["ms"] for s in used])
    assert last / first >= 1.3  # the case is exercised: the ratio gate alone would not stop it
    assert a.rule("step-slowdown") == []


CACHED_OUTPUTS = """import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(512, 256)
outputs = {{}}
recent = []


def step(i):
    opt.zero_grad()
    out = model(x)
    out.pow(2).mean().backward()
    opt.step()
    outputs[i] = out.detach()  # kept forever: 512 KiB a step
    recent.append(out.detach())
    if len(recent) > {cap}:  # a bounded buffer: full after {cap} steps, then it stops growing
        recent.pop(0)
"""


def test_a_small_steady_leak_in_module_state_is_flagged(tmp_path):
    """0.5 MiB a step into a dict: too little for the process memory to prove over a short audit
    (the RSS thresholds want 32 MiB), but the tensors one module-level name holds are counted
    exactly, and they grew at every scan: the finding names the dict and the line that fills it.
    A buffer that fills to its cap and stays there is not named."""
    trainer = tmp_path / "cache.py"
    trainer.write_text(CACHED_OUTPUTS.format(cap=4))
    a = audit("run", f"{trainer}:step", "--steps", "30", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("memory-growth")
    [holder] = f["evidence"]["holders"]
    scans = sorted(a.evidence["graph_scans"], key=lambda s: s["after_step"])
    assert holder["name"] == "outputs"
    assert holder["growth_bytes"] == 512 * 256 * 4 * (scans[-1]["after_step"] - scans[0]["after_step"])
    line = CACHED_OUTPUTS.splitlines().index("    outputs[i] = out.detach()  # kept forever: 512 KiB a step") + 1
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(trainer), line)]
    assert "`outputs` grew by" in f["message"] and "`recent`" not in f["message"]


KEPT_OUTPUTS = """import torch
from torch import nn

model = nn.Linear(256, 512).to("DEVICE")
x = torch.randn(256, 256, device="DEVICE")
outs = []


def step(i):
    out = model(x)
    out.sum().backward()
    outs.append(out.detach())  # KEPT: 512 KiB a step
"""


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_memory_growth_says_gpu_memory_for_gpu_tensors_in_rehearsal(tmp_path, device):
    """In CUDA rehearsal a list of the GPU's outputs was reported as process memory ("Process
    memory (RSS) grew") with a generic "detach and move to CPU": on the GPU the program is written
    for, that growth is device memory. The held tensors meant for the GPU are now said to be GPU
    tensors and GPU memory, and the fix names the list and what to keep instead; the same program
    on the CPU keeps the host wording."""
    source = KEPT_OUTPUTS.replace("DEVICE", device)
    trainer = tmp_path / "kept.py"
    trainer.write_text(source)
    a = audit("run", f"{trainer}:step", "--steps", "30", "--no-profile", "--no-numerics", "--quiet",
              out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("memory-growth")
    [holder] = f["evidence"]["holders"]
    scans = sorted(a.evidence["graph_scans"], key=lambda s: s["after_step"])
    grown = 256 * 512 * 4 * (scans[-1]["after_step"] - scans[0]["after_step"])
    assert (holder["name"], holder["growth_bytes"]) == ("outs", grown)
    line = source.splitlines().index("    outs.append(out.detach())  # KEPT: 512 KiB a step") + 1
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(trainer), line)]
    assert f["fix"]["summary"].startswith("`outs` keeps a tensor from every step")
    assert "clear `outs` at each epoch's end" in f["fix"]["summary"]
    if device == "cpu":
        assert holder["device_growth_bytes"] == 0 and not f["evidence"]["gpu_tensors_in_rehearsal"]
        assert "GPU" not in f["message"] + f["fix"]["summary"]
        return
    assert holder["device_growth_bytes"] == grown and f["evidence"]["gpu_tensors_in_rehearsal"]
    assert f"`outs` grew by {grown / 2**20:.0f} MiB of GPU tensors" in f["message"], f["message"]
    assert "GiB of GPU memory." in f["message"] and "every step on the GPU" in f["fix"]["summary"]


def test_the_lines_that_grow_a_holder(tmp_path):
    """The line memory-growth names: appends, keyed stores, updates, `+=`, and an object's own
    methods growing `self.attr` for a holder `name.attr`."""
    from auditor.capture.growth_lines import mutation_lines

    src = tmp_path / "t.py"
    src.write_text("class Replay:\n"
                   "    def push(self, o):\n"
                   "        self.obs.append(o)\n"          # 3
                   "buffer = Replay()\n"
                   "cache, seen = {}, []\n"
                   "def step(i, out):\n"
                   "    cache[i] = out\n"                  # 7
                   "    cache.update({-i: out})\n"         # 8
                   "    seen.append(out)\n"                # 9
                   "    obs = [out]\n")                    # not a holder's growth
    assert mutation_lines(str(src), "buffer.obs") == [3]
    assert mutation_lines(str(src), "cache") == [7, 8]
    assert mutation_lines(str(src), "seen") == [9]
    assert mutation_lines(str(src), "obs") == []
    # the step function's own lines first; a store of a literal (a reset) after the others
    src.write_text("stats = {}\n"
                   "def reset():\n"
                   "    stats['loss'] = 0.0\n"            # 3
                   "def other(loss):\n"
                   "    stats['loss'] = stats['loss'] + loss\n"  # 5
                   "def step(loss):\n"
                   "    stats['loss'] += loss\n")          # 7
    assert mutation_lines(str(src), "stats") == [5, 7, 3]
    assert mutation_lines(str(src), "stats", (6, 7)) == [7, 5, 3]


def test_memory_growth_names_the_holder(example_audit):
    a = example_audit("memory_growth")
    f = the_finding(a, "memory-growth")
    holder = f["evidence"]["holders"][0]
    assert holder["name"] == "all_logits"
    scans = sorted(a.evidence["graph_scans"], key=lambda s: s["after_step"])
    per_step = 256 * 2560 * 4  # one detached (batch, width) float32 activation per step
    assert holder["growth_bytes"] == per_step * (scans[-1]["after_step"] - scans[0]["after_step"])


USER_MODE = '''
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

torch.manual_seed(0)


class Counting(TorchFunctionMode):  # the user's own op counter, around the whole step
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))  # MODE LINE


model = nn.Linear(16, 1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 16)


def step():
    with Counting():
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(loss.item())  # ITEM LINE
'''


def test_host_sync_under_the_users_torch_function_mode(tmp_path):
    """A user's TorchFunctionMode passes every call on (`return func(...)`): the step's own
    `.item()` is counted once, at the step's line. Before, each `.item()` was counted again at the
    mode's line, and so were the auditor's own and Adam's (8.8 a step, at the mode's line)."""
    trainer = tmp_path / "mode.py"
    trainer.write_text(USER_MODE)
    a = audit("run", f"{trainer}:step", "--steps", "6", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("host-sync")
    item_line = next(n for n, t in enumerate(USER_MODE.splitlines(), 1) if "ITEM LINE" in t)
    assert [(loc["file"], loc["line"]) for loc in f["locations"]] == [(str(trainer), item_line)], f["message"]
    assert f["evidence"]["syncs_per_step"] == 1.0, f["evidence"]


def test_sites_in_another_file_are_named_with_their_file(tmp_path):
    """host-sync lists its sites after the headline's location: a site in another file of the
    user's package is said as `metrics.py:3`, not as a bare `line 3` that reads as the headline
    file's line."""
    (tmp_path / "metrics.py").write_text("def log(loss):\n    return float(loss)  # SYNC\n")
    trainer = tmp_path / "train.py"
    trainer.write_text("import torch\nfrom metrics import log\nw = torch.ones(4, requires_grad=True)\n\n\n"
                       "def step():\n    loss = (w * 2).sum()\n    loss.backward()\n    log(loss)\n"
                       "    return loss.item()\n")
    a = audit("run", f"{trainer}:step", "--steps", "4", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("host-sync")
    first = f["locations"][0]["file"]
    said = {str(tmp_path / "metrics.py"): "metrics.py:2", str(trainer): "train.py:10"}
    other = next(file for file in said if file != first)
    assert f"at {said[other]}" in f["message"] and f"at line {said[first].split(':')[1]}" in f["message"], f["message"]



def test_host_sync_rates_are_rounded_alike_in_headline_and_sites(tmp_path):
    """One `.item()` in every step and one in 4 of 7: the headline said "1.6 device->host syncs
    per step" beside "x0.57/step" at the site, two roundings of one count. Both now print 3
    significant digits: 11 syncs over 7 steps is 1.57, 4 over 7 is 0.571."""
    trainer = tmp_path / "rates.py"
    trainer.write_text("import torch\nw = torch.ones(4, requires_grad=True)\n\n\n"
                       "def step(i):\n    loss = (w * 2).sum()\n    loss.backward()\n"
                       "    if i % 3:\n        float(loss)\n    return loss.item()\n")
    a = audit("run", f"{trainer}:step", "--steps", "7", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("host-sync")
    sites = {s["line"]: s["count"] for s in f["evidence"]["sites"]}
    assert sites == {10: 7, 9: 4}, sites
    assert "1.57 tensor values read on the host per step at 2 place(s)" in f["message"], f["message"]
    assert "x1/step at line 10" in f["message"] and "x0.571/step at line 9" in f["message"], f["message"]


def _loader_example(tmp_path, name: str, loader_line: str):
    """examples/dataloader_bound.py with its DataLoader line replaced by `loader_line` (and what it
    needs before it), audited for 12 steps: (the audit, its dataloader-bound finding)."""
    src = (EXAMPLES / "dataloader_bound.py").read_text().replace(
        "loader = DataLoader(SyntheticImages(), batch_size=64, shuffle=True,", loader_line)
    trainer = tmp_path / name
    trainer.write_text(src)
    shutil.copy(EXAMPLES / "_common.py", tmp_path / "_common.py")
    a = audit("run", f"{trainer}:step", "--steps", "12", "--no-profile", "--quiet", out=tmp_path / "out")
    assert a.returncode == 0, a.stderr
    [f] = a.rule("dataloader-bound")
    return a, f


def test_a_dataloader_setting_read_from_the_command_line_names_its_option(tmp_path):
    """`num_workers=int(args.workers)` from an argparse option (pytorch/examples' dcgan and
    imagenet: `--workers`): the fix is to run the program with that option, and the patch leaves
    the call alone."""
    a, f = _loader_example(tmp_path, "cli_loader.py",
                           "import argparse\nparser = argparse.ArgumentParser()\n"
                           "parser.add_argument('-j', '--workers', type=int, default=0, help='data loading workers')\n"
                           "args = parser.parse_args([])\n"
                           "loader = DataLoader(SyntheticImages(), batch_size=64, shuffle=True, "
                           "num_workers=int(args.workers),")
    n = f["fix"]["config"]["DataLoader.num_workers"]
    assert (f"The call takes num_workers from `int(args.workers)`, the command line's --workers: run it with "
            f"--workers {n}; the patch leaves it alone") in f["fix"]["summary"], f["fix"]["summary"]
    assert f["fix"]["edits"] == []


def test_a_dataloader_setting_read_from_config_is_not_hard_coded(tmp_path):
    """`num_workers=cfg["num_workers"]`: the patch leaves that expression alone (hard-coding 2
    would leave the config entry dead) and the fix says to set it where the config is. Nor does it
    add persistent_workers=True beside it: with the config's 0 workers DataLoader refuses it
    ("needs num_workers > 0"), which the patched trainer used to raise."""
    a, f = _loader_example(tmp_path, "cfg_loader.py",
                           'cfg = {"num_workers": 0}\nloader = DataLoader(SyntheticImages(), batch_size=64, '
                           'shuffle=True, num_workers=cfg["num_workers"],')
    n = f["fix"]["config"]["DataLoader.num_workers"]
    assert f'The call takes num_workers from `cfg["num_workers"]`: set num_workers={n} there' in f["fix"]["summary"]
    assert ('persistent_workers needs num_workers > 0, which the call takes from `cfg["num_workers"]`'
            in f["fix"]["summary"]), f["fix"]["summary"]
    assert f["fix"]["edits"] == [] and "persistent_workers" not in patch_text(a.out / "fixes.patch")
