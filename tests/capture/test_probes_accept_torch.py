"""Every probe and stand-in accepts what the torch call it wraps accepts.

The same generated calls go to a plain process and to processes with the audit's probes, its CUDA
stand-ins, its CUDA rehearsal and its numerics collector installed (tests/capture/probe_server.py);
each call must return the same value or raise the same type of exception in both. The calls are
every callable the audit wraps, found in the process (so a new probe is covered), and the plain
torch calls a wrapper can change from outside (a 0-d tensor where a number goes, tensors in lists).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).with_name("probe_server.py")
# The stand-ins answer for a CUDA this machine lacks, as a GPU machine would: plain torch here
# answers for no device at all, so a stand-in is held to raising nothing of its own that plain
# torch does not raise.
STANDIN_OWNERS = ("torch.cuda.", "torch.accelerator.")


class Server:
    def __init__(self, setup: str, tmp: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
        self.err = tempfile.TemporaryFile("w+")  # (a pipe left unread fills with warnings and stops it)
        self.p = subprocess.Popen([sys.executable, str(SERVER), setup], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, env=env, cwd=tmp)
        self.setup = setup
        first = self.p.stdout.readline()
        assert first, f"{setup} server did not start"
        self.wrapped: list[str] = json.loads(first)

    def call(self, op: str, args: list, kwargs: dict):
        request = json.dumps([op, args, kwargs])
        try:
            self.p.stdin.write(request + "\n")
            self.p.stdin.flush()
            line = self.p.stdout.readline()
        except OSError:
            line = ""
        if not line:
            self.p.wait(timeout=30)
            pytest.fail(f"the {self.setup} process died (exit {self.p.returncode}) at {request}: {self._stderr()}")
        return json.loads(line)

    def _stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-2000:]

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe_servers")  # (where a call that writes a file writes it)
    made = {s: Server(s, tmp) for s in ("plain", "probes", "rehearsal", "numerics")}
    yield made
    for s in made.values():
        s.close()


floats = st.floats(-2, 2, allow_nan=False, width=32)
tensor = st.one_of(
    floats.map(lambda v: ["t0", v]),
    st.lists(floats, max_size=3).map(lambda v: ["t1", v]),
    st.lists(st.integers(-2, 2), max_size=3).map(lambda v: ["ti", v]),
    st.lists(st.booleans(), min_size=1, max_size=3).map(lambda v: ["tb", v]),
    st.lists(floats, min_size=1, max_size=3).map(lambda v: ["param", v]),
    st.lists(floats, max_size=3).map(lambda v: ["sub", v]),
)
scalar = st.one_of(st.integers(-3, 3), floats, st.booleans()).map(lambda v: ["py", v])
objects = st.sampled_from([["fn", 0], ["opt", 0]])  # a hook or lambda; an optimizer
value = st.recursive(st.one_of(tensor, scalar, objects),
                     lambda inner: st.one_of(st.lists(inner, max_size=3).map(lambda v: ["list", v]),
                                             st.lists(inner, min_size=1, max_size=2).map(lambda v: ["tuple", v])),
                     max_leaves=4)
keywords = st.dictionaries(st.sampled_from(["out", "dtype", "dim", "non_blocking", "set_to_none", "max_norm", "lr",
                                            "batch_size", "prepend"]),
                           st.one_of(tensor, st.sampled_from([["dtype", "float64"], ["dtype", "int32"]]),
                                     st.integers(-1, 1).map(lambda v: ["py", v]),
                                     st.booleans().map(lambda v: ["py", v])), max_size=2)
# Calls whose argument is a file to write, not a tensor (a generated 0 is a descriptor)
WRITERS = {"torch.save", "torch.serialization.save", "torch.cuda.memory._dump_snapshot"}
# What the generated calls leave out, and why (each wrapped callable is either called or named here)
NEEDS_A_PROCESS_GROUP = ("torch.distributed.", "torch.nn.parallel.distributed.", "torch.utils.data.distributed.")
FUNCTION_INTERNALS = ("torch.autograd.function.BackwardCFunction.", "torch.utils.checkpoint.CheckpointFunction.")
RECEIVED = ("torch.utils.data.dataloader._BaseDataLoaderIter.",)  # a private class every `for batch in loader` gets


def left_out(name: str) -> str | None:
    """Why a wrapped callable is not called with generated arguments, or None when it is."""
    if name in WRITERS:
        return "writes the file its argument names (a generated 0 is a descriptor)"
    if name.startswith(NEEDS_A_PROCESS_GROUP):
        return "needs a process group"
    if name.startswith(FUNCTION_INTERNALS):
        return "autograd Function internals, called through torch.utils.checkpoint.checkpoint and Tensor.backward"
    owner, _, last = name.rpartition(".")
    inner = owner.split(".")[1:]
    private_method = last.startswith("_") and not last.startswith("__") and owner[:1] and owner.split(".")[-1][:1].isupper()
    if not name.startswith(RECEIVED) and (any(p.startswith("_") for p in inner) or private_method):
        return "torch's internals, called by the public calls above"
    return None
PLAIN_OPS = ["torch.save+load", "torch.utils.checkpoint.checkpoint", "Tensor.backward", "torch.tensor", "torch.as_tensor", "torch.stack", "np.asarray", "getitem", "len", "list", "float",
             "int", "bool", "format", "str", "range_index", "torch.zeros"]


def _raised(answer) -> bool:
    return isinstance(answer, list) and answer[:1] == ["E"]


def _same(plain, audited, op: str) -> bool:
    if op.startswith(STANDIN_OWNERS):  # (what they answer is a GPU machine's, not this one's)
        return not (_raised(audited) and audited[2]) or (_raised(plain) and plain[1] == audited[1])
    if _raised(plain) or _raised(audited):
        return _raised(plain) and _raised(audited) and plain[:2] == audited[:2]
    return plain == audited


def test_the_servers_see_the_audits_wrappers(servers):
    """The audited processes wrap what the audit wraps (the property below covers each of them)."""
    assert servers["plain"].wrapped == []
    for setup in ("probes", "rehearsal", "numerics"):
        names = servers[setup].wrapped
        assert {"torch.Tensor.item", "torch.Tensor.__float__", "torch.nonzero"} <= set(names), (setup, names)
    assert "torch.cuda.synchronize" in servers["probes"].wrapped


def _ops(servers) -> list[str]:
    wrapped = {n for s in ("probes", "rehearsal", "numerics") for n in servers[s].wrapped}
    return sorted(set(PLAIN_OPS) | {n for n in wrapped if left_out(n) is None})


def test_every_wrapped_callable_is_called_or_left_out_with_a_reason(servers):
    """A new probe or stand-in is in the generated calls as soon as the audit installs it: each op
    resolves in every process (a method is called on an instance the server builds)."""
    ops = _ops(servers)
    assert {"torch.optim.optimizer.Optimizer.zero_grad", "torch.nn.utils.clip_grad.clip_grad_norm_",
            "torch.optim.lr_scheduler.ReduceLROnPlateau.step", "torch.nn.parameter.Parameter.__new__",
            "torch.utils.data.dataloader._BaseDataLoaderIter.__next__", "torch.autocast"} <= set(ops)
    for op in ops:
        for setup in ("plain", "probes", "rehearsal", "numerics"):
            answer = servers[setup].call(op, [], {})
            assert not (isinstance(answer, list) and answer[:1] == ["E"] and answer[1] in ("NoReceiver", "LookupError")), \
                (setup, op, answer)


def test_a_0d_tensor_in_a_list_builds_a_tensor_under_the_audit(servers):
    """Issue #35's repro: torch.tensor([R]) of a 0-d tensor R, plain and audited. A Python
    `__getitem__` on torch.Tensor made every tensor a sequence to CPython and this raised TypeError."""
    case = ("torch.tensor", [["list", [["t0", 1.0]]]], {})
    plain = servers["plain"].call(*case)
    assert plain[0] == "T" and plain[4] == ["1.0"]
    for setup in ("probes", "rehearsal", "numerics"):
        assert servers[setup].call(*case) == plain, setup


@pytest.mark.parametrize("case", [
    # a dtype judged as a bool by the rehearsal's autocast ("dtype or the GPU's"): RuntimeError
    ("torch.cuda.amp.autocast", [["py", True], ["t1", [1.0, 2.0]], ["py", True]], {}),
    ("torch.autocast", [["py", "cuda"]], {"dtype": ["t1", [1.0, 2.0]]}),
])
def test_calls_the_property_found(servers, case):
    plain = servers["plain"].call(*case)
    for setup in ("probes", "rehearsal", "numerics"):
        assert _same(plain, servers[setup].call(*case), case[0]), (setup, servers[setup].call(*case), plain)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_wrapped_and_plain_torch_answer_alike(servers, data):
    ops = _ops(servers)
    op = data.draw(st.sampled_from(ops), label="op")
    args = data.draw(st.lists(value, max_size=3), label="args")
    kwargs = data.draw(keywords, label="kwargs")
    plain = servers["plain"].call(op, args, kwargs)
    cpu_op = _cpu_type_of(op)
    cpu = servers["plain"].call(cpu_op, args, kwargs) if cpu_op else None
    for setup in ("probes", "rehearsal", "numerics"):
        audited = servers[setup].call(op, args, kwargs)
        assert _same(plain, audited, op) or (cpu is not None and _same(cpu, audited, cpu_op)), \
            f"{setup}: {op}(*{args}, **{kwargs}) gave {audited}, plain torch {plain}"


def _cpu_type_of(op: str) -> str | None:
    """A legacy CUDA type's constructor (torch.cuda.FloatTensor(...)): the rehearsal's stand-in makes
    what the CPU type makes, as a GPU machine's type does, so the CPU type's answer is its reference."""
    owner, _, name = op.rpartition(".")
    if name == "__new__" and owner.startswith("torch.cuda.") and owner.endswith("Tensor"):
        return f"torch.{owner[len('torch.cuda.'):]}.__new__"
    return None


ISSUE_REPRO = """\
import torch
lin = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
for i in range(3):
    R = torch.arange(3.0)[1]
    target = torch.tensor([R])
    loss = torch.nn.functional.mse_loss(lin(torch.ones(1)), target)
    opt.zero_grad(); loss.backward(); opt.step()
print("ok", target)
"""


@pytest.mark.slow
def test_the_issues_program_runs_under_the_audit_as_it_runs_plainly(tmp_path):
    """actor_critic.py's `torch.tensor([R])` died under `audit run` (even --no-numerics --no-profile)
    with "TypeError: len() of a 0-d tensor" and the summary blamed the program."""
    script = tmp_path / "repro.py"
    script.write_text(ISSUE_REPRO)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # the plain run, in this process: plain torch (nothing here installs the audit's probes), one
    # program process fewer
    plain = io.StringIO()
    with contextlib.redirect_stdout(plain):
        exec(compile(ISSUE_REPRO, str(script), "exec"), {"__name__": "__main__", "__file__": str(script)})
    audited = subprocess.run([sys.executable, "-m", "auditor", "run", str(script), "--no-numerics", "--no-profile",
                              "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300,
                             cwd=tmp_path)
    assert plain.getvalue() == "ok tensor([1.])\n"
    assert audited.returncode == 0, audited.stderr[-2000:]
    assert audited.stdout.startswith(plain.getvalue()) and "len() of a 0-d tensor" not in audited.stderr
    assert "3 step(s)" in audited.stdout + audited.stderr
