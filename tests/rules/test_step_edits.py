"""The step edits (auditor.rules._support.step_edits) on small sources: where they edit, and every
shape where an edit would not be known to keep the program's work, where they offer none."""
from __future__ import annotations

from pathlib import Path

import pytest

from auditor.rules._support.step_edits import dataset_copy_out, every_n_steps, loop_around
from auditor.rules.launch_bound import _fix as launch_fix

LOOP = """\
import torch
for i in range(100):
    for _ in range(4):
        loss = model(x)
        loss.backward()
        print(loss.item())
    print(f"loss {loss.item()}")
    logger.info("loss %s", loss.item()); x = 1
    history = loss.item()
    opt.step()
for epoch, batch in enumerate(loader):
    opt.step()
    print(\"\"\"a
    b\"\"\", loss.item())
    def closure():
        print(loss.item())
for p in model.parameters():
    p.data.add_(p.grad)
print(loss.item())
"""


def _write(tmp_path: Path, text: str) -> str:
    f = tmp_path / "train.py"
    f.write_text(text)
    return str(f)


def test_a_logging_statement_is_guarded_by_the_step_loops_counter(tmp_path):
    f = _write(tmp_path, LOOP)
    # inside the gradient-accumulation loop: the counter is the step loop's, not `_`
    e = every_n_steps(f, 6, 50)
    assert (e.start, e.end, e.lines) == (6, 6, ["        if i % 50 == 0:", "            print(loss.item())"])
    assert every_n_steps(f, 7, 10).lines == ["    if i % 10 == 0:", '        print(f"loss {loss.item()}")']


@pytest.mark.parametrize("line, why", [
    (8, "another statement shares its line"),
    (9, "an assignment: its value is read afterwards"),
    (13, "a string across lines would be re-indented"),
    (16, "a closure: the loop is another function's"),
    (20, "no loop around it"),
])
def test_no_guard_where_it_is_not_known_to_be_safe(tmp_path, line, why):
    assert every_n_steps(_write(tmp_path, LOOP), line, 50) is None, why


def test_what_loop_runs_a_line(tmp_path):
    f = _write(tmp_path, LOOP)
    assert loop_around(f, 4) == "loop" and loop_around(f, 18) == "parameters" and loop_around(f, 20) is None


def test_launch_bound_fix_follows_the_loop_the_lines_show(tmp_path):
    f = _write(tmp_path, LOOP)
    params = launch_fix([(f, 18)])
    assert "torch._foreach_*" in params.summary and params.config["optimizer"] == {"foreach": True}
    loop = launch_fix([(f, 4)])
    assert "nn.LSTM" in loop.summary and "optimizer" not in loop.config
    once = launch_fix([(f, 20)])
    assert "foreach" not in once.summary and "nn.LSTM" not in once.summary and "optimizer" not in once.config
    # a recording's lines that cannot be read here: the optimizer's setting only for its own ops
    assert "optimizer" not in launch_fix([("/nowhere.py", 3)], ["aten::mul"]).config
    assert launch_fix([("/nowhere.py", 3)], ["Optimizer.step#AdamW.step"]).config["optimizer"] == {"foreach": True}


DATASET = """\
import torch
from torch.utils.data import DataLoader, Dataset


class Seqs(Dataset):
    def __getitem__(self, i):
        return torch.arange(4).cuda()

    def __len__(self):
        return 8


ds = Seqs()
loader = DataLoader(ds, batch_size=2{extra})
for step, batch in enumerate(loader):
    model(batch)
{more}
"""


def test_the_getitem_copy_moves_to_the_loop_batch(tmp_path):
    f = _write(tmp_path, DATASET.format(extra="", more=""))
    edits = {e.start: (e.end, e.lines) for e in dataset_copy_out(f, 7)}
    assert edits == {7: (7, ["        return torch.arange(4)"]),
                     14: (14, ["loader = DataLoader(ds, batch_size=2, pin_memory=True)"]),
                     16: (15, ["    batch = batch.cuda(non_blocking=True)"])}


@pytest.mark.parametrize("extra, more, why", [
    (", collate_fn=stack", "", "a collate_fn may expect device tensors"),
    ("", "other(ds)", "the dataset is handed elsewhere"),
    ("", "it = iter(loader)", "the loader is iterated elsewhere"),
    ("", "class More(Seqs):\n    pass", "a subclass inherits __getitem__"),
])
def test_no_move_where_a_use_is_not_known(tmp_path, extra, more, why):
    assert dataset_copy_out(_write(tmp_path, DATASET.format(extra=extra, more=more)), 7) is None, why


def test_a_device_only_getitem_knows_is_not_moved(tmp_path):
    text = DATASET.format(extra="", more="").replace(".cuda()", ".to(self.device)")
    assert dataset_copy_out(_write(tmp_path, text), 7) is None


MAPPINGS = """\
kwargs = {"batch_size": 4, "num_workers": 0}
loader = DataLoader(ds, **kwargs)
multi = {
    'batch_size': 4,
}
other = DataLoader(ds, shuffle=True, **multi)
chosen = {"num_workers": 2 if cuda else 0}
third = DataLoader(ds, **chosen)
shared = {"num_workers": 0}
shared.update(pin_memory=True)
fourth = DataLoader(ds, **shared)
"""


def test_a_dict_literal_the_call_unpacks_gets_the_keys(tmp_path):
    from auditor.fixes import edit_mapping

    f = _write(tmp_path, MAPPINGS)
    e = edit_mapping(f, 2, ("DataLoader",), {"num_workers": "2", "pin_memory": "True"})
    assert (e.start, e.end, e.lines) == (1, 1, ['kwargs = {"batch_size": 4, "num_workers": 2, "pin_memory": True}'])
    e = edit_mapping(f, 6, ("DataLoader",), {"num_workers": "2"})
    assert (e.start, e.end, e.lines) == (4, 4, ["    'batch_size': 4,", "    'num_workers': 2,"])
    # the user's own choice of a value, and a dict changed after it is made: left alone
    assert edit_mapping(f, 8, ("DataLoader",), {"num_workers": "2"}) is None
    assert edit_mapping(f, 11, ("DataLoader",), {"num_workers": "2"}) is None
