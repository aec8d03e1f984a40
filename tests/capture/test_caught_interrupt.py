"""A program that catches the audit's interrupt (--steps N ends it as a Ctrl-C does) and goes on
into code that then fails: pytorch/examples' word_language_model wraps its epochs in
`try: ... except KeyboardInterrupt: print('Exiting from training early')` and then loads the best
model from the checkpoint its first epoch has not written yet (FileNotFoundError). A Ctrl-C there
does the same; the audited steps are whole. It was reported as a failed run (exit 3, "run ended:
raised"); now the run is complete (exit 0) and the summary says what the program's Ctrl-C path
raised, and where."""
from __future__ import annotations

import json

from conftest import audit

PROGRAM = '''import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    for epoch in range(1, 3):
        for i in range(50):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with open("model.pt", "wb") as f:
            torch.save(model, f)
except KeyboardInterrupt:
    print("Exiting from training early")

with open("model.pt", "rb") as f:  # LOAD LINE
    model = torch.load(f, weights_only=False)
'''


def test_an_error_on_the_programs_ctrl_c_path_is_not_a_failed_run(tmp_path):
    (tmp_path / "main.py").write_text(PROGRAM)
    a = audit("run", str(tmp_path / "main.py"), "--steps", "5", "--no-profile", "--no-numerics",
              out=tmp_path / "out", cwd=tmp_path)
    assert a.returncode == 0, a.stdout + a.stderr
    assert "FileNotFoundError" in a.stderr  # (the program's traceback, printed as Python prints it)
    assert "run ended" not in a.stdout
    summary = (tmp_path / "out" / "summary.txt").read_text()
    line = PROGRAM.splitlines().index('with open("model.pt", "rb") as f:  # LOAD LINE') + 1
    assert ("as a Ctrl-C does; it caught that interrupt, went on and raised FileNotFoundError: [Errno 2] No such "
            f"file or directory: 'model.pt' at main.py:{line}, as after a Ctrl-C there") in summary, summary
    evidence = json.loads((tmp_path / "out" / "evidence.json").read_text())
    assert evidence["program"]["after_stop"].startswith("FileNotFoundError")
