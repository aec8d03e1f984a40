"""The audited program's process, started for the suite from one that has imported it already.

`audit run` starts the program as `python -m auditor.capture.child ...`, a fresh interpreter that
imports torch and the auditor's capture modules before the program's first line: ~2 s of CPU on
the CI's cores, paid by each of the suite's ~570 audits (over half of the suite's CPU time). A
worker of the suite starts this process once: it imports what `auditor.capture.child` imports,
with the environment the child is given, and then forks one process per audit, which takes the
request's descriptors, working directory, environment and arguments and runs
`auditor.capture.child` as `python -m` runs it, as `__main__`, from there on the same code.

What a forked child could not match, it is not asked to do: Zygote.start_child starts a real
process for a CUDA build of torch (see `cuda_build`), for a program that calls torch.compile (see
`compiles`), whenever the request's environment differs from the one this process imported with
(torch and the auditor read some variables once, at import) or the command is not the child's, and
this process refuses a fork when it runs more than one thread (a fork keeps only the caller's).

A worker keeps two (`Zygotes`): one as above, and one that has also imported torch._dynamo, which
torch.optim imports as a program builds its first optimizer (~1.5 s of CPU more). A program whose
text, or that of one of its own modules it imports, names an optimizer (`optim`) is forked from
the second: it would have imported dynamo before its first step anyway, and a program that builds
none still starts without it, as it does plainly.

Run as `python tests/zygote.py SOCKET [MODULE...]` (MODULE: imported after the child's).
Protocol on the unix socket, one connection a request: the client sends one JSON line {"argv",
"cwd", "env", "fd"} with four descriptors (SCM_RIGHTS: the child's stdin, stdout, stderr and its
record pipe, which the child gets as descriptor `fd`); the server answers {"pid": N} (or
{"error": why}) and, when the child has exited, {"status": S}, its wait status."""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

CHILD = "auditor.capture.child"
# The suite's own programs read the variables PROGRAM_VARS names as they run, never at an import:
# where to write what they saw, which variant to run (`audit(..., env=...)`). A variable a test
# passes that is not named here gets its audit a fresh process.
PROGRAM_VARS = frozenset({"PARITY_OUT", "PARITY_DIR", "COUNTS_OUT", "MODE", "WHERE", "SNAPSHOT", "SEEN_OUT",
                          "PREDS_LEAK_CLEAN", "HOOK_KEEP_CLEAN", "LOCAL_LEAK_CLEAN", "STEPS", "WEIGHTS", "MY_VAR"})
# Variables whose values a request may have apart from the zygote's (the child is given the
# request's): none is read as what the zygote imports is imported. Kineto reads TEARDOWN_CUPTI as
# a profiler stops, on CUDA; pytest names the running test in PYTEST_CURRENT_TEST; inductor (not
# imported by the child at its start) reads TORCHINDUCTOR_CACHE_DIR when it compiles, and sets
# it in the process that first asks for its cache: a test that compiles in the worker leaves it
# in the environment every later audit inherits. The auditor reads AUDIT_EXIT_GRACE_S in the
# function that uses it (capture.exit_bound), not at import.
FREE_VARS = frozenset({"TEARDOWN_CUPTI", "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR",
                       "AUDIT_EXIT_GRACE_S"}) | PROGRAM_VARS
SET_BY_IMPORTS: dict[str, str] = {}  # the variables the zygote's imports added to its environment


def _bound(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment a forked child must share with its zygote."""
    return {k: v for k, v in env.items() if k not in FREE_VARS}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _become(request: dict, fds: list[int]) -> None:
    """In the forked process: the descriptors, directory, environment and arguments a
    `subprocess.Popen([sys.executable, *argv], pass_fds=(fd,), stdin, stdout, stderr, env)` gives."""
    target = int(request["fd"])
    for new, old in enumerate(fds[:3]):
        os.dup2(old, new)
    os.dup2(fds[3], target)
    os.closerange(3, target)
    os.closerange(target + 1, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # what the zygote's own imports set (torch._dynamo's import sets TORCHINDUCTOR_CACHE_DIR), as
    # the same imports set it in a fresh process, unless the request has its own
    os.environ.update({k: v for k, v in SET_BY_IMPORTS.items() if k not in request["env"]})
    argv = request["argv"]  # ["-m", CHILD, args...]
    sys.argv = ["-m", *argv[2:]]
    sys.orig_argv = [sys.executable, *argv]
    sys.path[0] = os.getcwd()  # (what `python -m` puts first)
    sys.modules["__main__"] = types.ModuleType("__main__")
    # a fresh process seeds torch's and NumPy's global generators from the OS as they are imported
    # (Python's own `random` reseeds itself in a forked child)
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    sys.modules["torch"].seed()


def serve(path: str) -> None:
    """Answer requests until the worker that started this process is gone; return only in a
    forked child, ready to run the child module."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, selectors.DefaultSelector() as sel:
        listener.bind(path)
        listener.listen(8)
        sel.register(listener, selectors.EVENT_READ, "accept")
        waiting: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the requester's connection)
        while True:
            for key, _ in sel.select(timeout=1.0):
                if key.data == "accept":
                    conn, _ = listener.accept()
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
                    try:
                        request = json.loads(msg)
                        if len(fds) != 4 or _threads() != 1:
                            raise RuntimeError(f"{len(fds)} descriptors, {_threads()} threads")
                    except Exception as e:  # (the client starts a real process instead)
                        conn.sendall((json.dumps({"error": str(e)}) + "\n").encode())
                        conn.close()
                        for fd in fds:
                            os.close(fd)
                        continue
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        try:
                            for other in [conn, listener, *(c for _, c in waiting.values())]:
                                other.close()
                            for pidfd in waiting:
                                os.close(pidfd)
                            sel.close()
                            _become(request, fds)
                        except BaseException:
                            traceback.print_exc()
                            os._exit(70)
                        return
                    for fd in fds:
                        os.close(fd)
                    pidfd = os.pidfd_open(pid)
                    waiting[pidfd] = (pid, conn)
                    sel.register(pidfd, selectors.EVENT_READ, "exit")
                    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
                else:
                    pidfd = key.fd
                    pid, conn = waiting.pop(pidfd)
                    sel.unregister(pidfd)
                    os.close(pidfd)
                    _, status = os.waitpid(pid, 0)
                    try:
                        conn.sendall((json.dumps({"status": status}) + "\n").encode())
                    except OSError:
                        pass
                    conn.close()
            if os.getppid() != WORKER:  # (the worker is gone: nobody will ask again)
                raise SystemExit(0)


class ForkedChild:
    """What run_child uses of a subprocess.Popen, for a child the zygote forked: its pid, its exit
    status when the zygote has reaped it (as Popen.returncode: minus the signal that killed it)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn, self.pid, self.returncode = conn, 0, None
        self._buffer = b""
        self._reading = threading.Lock()

    def line(self, timeout: float | None) -> dict | None:
        """The zygote's next answer on this connection ({} once it closed it); None if none came
        within `timeout`."""
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                data = self._conn.recv(4096)
                if not data:
                    return {}
                self._buffer += data
        except (BlockingIOError, socket.timeout):
            return None
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _read_status(self, timeout: float | None) -> None:
        # (run_child's stderr pump polls from its thread while the main thread waits: one reads,
        # and a poll never waits for the lock: a waiting poll could keep the pump from draining
        # the stderr the child is blocked on)
        if not self._reading.acquire(blocking=timeout != 0.0):
            return
        try:
            if self.returncode is not None:
                return
            answer = self.line(timeout)
            if answer is None:
                return
            # (no status: the zygote died, and the child, its own child, was killed with it)
            self.returncode = os.waitstatus_to_exitcode(answer.get("status", signal.SIGKILL))
            self._conn.close()
        finally:
            self._reading.release()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(["auditor.capture.child"], timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@functools.cache
def cuda_build() -> bool:
    """Whether the worker's torch is built for CUDA (or ROCm): the child's imports ask it for its
    devices (torch.cuda.is_available()), which marks a process forked after that as unable to
    initialise CUDA ("Cannot re-initialize CUDA in forked subprocess") where a fresh one can, so
    no child is forked there."""
    import torch

    return bool(torch.version.cuda or torch.version.hip)


class Zygote:
    """A worker's zygote, started on the first request it can serve: it imports with `env`, the
    environment run_child gives a child when the test adds nothing, and serves only requests with
    that environment (but for FREE_VARS)."""

    def __init__(self, env: dict[str, str], enabled: bool = True, warm: tuple[str, ...] = ()) -> None:
        self.enabled, self.warm = enabled, warm
        self._proc: subprocess.Popen | None = None
        self._env = _bound(env)
        self._dir = ""
        self.forked = self.restarts = 0
        self.died: list[int] = []  # the exit statuses of zygote processes that died serving
        self.refused: collections.Counter[str] = collections.Counter()  # why a fresh process was started

    def serve(self, env: dict[str, str]) -> None:
        """Serve requests with `env` from now on: a zygote process that imported with another
        environment is stopped, and the next request starts one that imports with this."""
        if _bound(env) != self._env:
            self.restarts += self._proc is not None
            self.stop()
            self._env = _bound(env)

    def _ensure(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:  # (it died: started again)
            self.died.append(self._proc.returncode)
            self.restarts += 1
            self.stop()
        if self._proc is None:
            self._dir = tempfile.mkdtemp(prefix="auditor-zygote-")
            log = open(os.path.join(self._dir, "log"), "wb")
            self._proc = subprocess.Popen([sys.executable, __file__, os.path.join(self._dir, "socket"), *self.warm],
                                          env=self._env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            log.close()
        return self._proc.poll() is None

    def _connect(self) -> socket.socket | None:
        path = os.path.join(self._dir, "socket")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                time.sleep(0.05)
        return None

    def refusal(self, cmd: list[str], pass_fds: tuple[int, ...], stderr: int | None, env: dict[str, str],
                popen: dict, target_text: str) -> str | None:
        """Why this request gets a fresh process (None: it is forked)."""
        if not self.enabled:
            return "AUDIT_TESTS_FRESH_CHILDREN=1"
        if cuda_build():
            return "a CUDA build of torch"
        if popen or cmd[:3] != [sys.executable, "-m", CHILD] or len(pass_fds) != 1 or not isinstance(stderr, int):
            return "not run_child's start of the child"
        if compiles(target_text):
            return "the program calls torch.compile"
        mine = _bound(env)
        if mine != self._env:
            return "environment: " + ",".join(sorted(k for k in {*mine, *self._env} if mine.get(k) != self._env.get(k)))
        if not self._ensure():
            return "the zygote is gone"
        return None

    def start_child(self, cmd: list[str], *, pass_fds: tuple[int, ...] = (), stderr: int | None = None,
                    env: dict[str, str] | None = None, target_text: str | None = None,
                    **popen) -> subprocess.Popen | ForkedChild:
        """run_child's start: forked when the request is the child's, with the zygote's environment
        (`target_text`: `_target_text(cmd)`, read here when not given)."""
        env = dict(os.environ if env is None else env)
        text = _target_text(cmd) if target_text is None else target_text
        why = self.refusal(cmd, pass_fds, stderr, env, popen, text)
        child = self._fork(cmd, pass_fds[0], stderr, env) if why is None else None
        if child is not None:
            self.forked += 1
            return child
        self.refused[why or "the zygote did not fork"] += 1
        return subprocess.Popen(cmd, pass_fds=pass_fds, stderr=stderr, env=env, **popen)

    def _fork(self, cmd: list[str], fd: int, stderr: int, env: dict[str, str]) -> ForkedChild | None:
        conn = self._connect()
        if conn is None:
            return None
        child = ForkedChild(conn)
        try:
            request = {"argv": cmd[1:], "cwd": os.getcwd(), "env": env, "fd": fd}
            socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [0, 1, stderr, fd])
            child.pid = (child.line(None) or {}).get("pid", 0)
        except OSError:
            pass
        if child.pid:
            return child
        conn.close()
        return None

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._proc, self._dir = None, ""


class Zygotes:
    """A worker's two zygotes (see the module's docstring): a request whose target's text names an
    optimizer goes to the one that imported torch._dynamo too."""

    def __init__(self, env: dict[str, str], enabled: bool = True) -> None:
        self.plain, self.optim = Zygote(env, enabled), Zygote(env, enabled, warm=("torch._dynamo",))

    @property
    def enabled(self) -> bool:
        return self.plain.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.plain.enabled = self.optim.enabled = on

    @property
    def forked(self) -> int:
        return self.plain.forked + self.optim.forked

    @property
    def restarts(self) -> int:
        return self.plain.restarts + self.optim.restarts

    def stats(self) -> dict:
        return {name: {"forked": z.forked, "restarts": z.restarts, "died": z.died, "refused": dict(z.refused)}
                for name, z in (("plain", self.plain), ("optim", self.optim))}

    def serve(self, env: dict[str, str]) -> None:
        self.plain.serve(env)
        self.optim.serve(env)

    def start_child(self, cmd: list[str], **kwargs) -> subprocess.Popen | ForkedChild:
        text = _target_text(cmd)
        return (self.optim if names_an_optimizer(text) else self.plain).start_child(cmd, target_text=text, **kwargs)

    def stop(self) -> None:
        self.plain.stop()
        self.optim.stop()


def _target_text(cmd: list[str]) -> str:
    """The text of the child's target (its request's `target`, FILE[:STEP], its path from the working directory)
    when it is a file, with that of the program's own modules it imports, as the rehearsal finds
    them (capture.rehearsal.intent.program_trees: examples/clean.py builds its optimizer in
    examples/_common.py); "" when it is no file."""
    from auditor.capture.rehearsal.intent import program_trees
    from auditor.capture.wire import decode_request

    try:
        target = decode_request(cmd[3]).target  # ([python, -m, CHILD, REQUEST])
    except (IndexError, ValueError):
        return ""
    for path in (target, target.rpartition(":")[0]):
        if path.endswith(".py") and os.path.isfile(path):
            texts = []
            for file, _ in program_trees(os.path.abspath(path)):
                with open(file, encoding="utf-8", errors="replace") as f:
                    texts.append(f.read())
            return "\n".join(texts)
    return ""


def names_an_optimizer(text: str) -> bool:
    """Whether the target's text (`_target_text`) says `optim`: torch.optim, an optimizer, a
    trainer's configure_optimizers."""
    return "optim" in text


def compiles(text: str) -> bool:
    """Whether the target's text (`_target_text`) says `torch.compile`: dynamo, imported in the
    zygote before the program set anything, logs a compiled function's graph breaks as a fresh
    process does not (test_parity's compiled code under the numerics checks)."""
    return "torch.compile" in text


if __name__ == "__main__":
    WORKER = os.getppid()
    before = dict(os.environ)
    __import__(CHILD)
    for name in sys.argv[2:]:
        __import__(name)
    SET_BY_IMPORTS.update((k, v) for k, v in os.environ.items() if before.get(k) != v)
    # the child module runs as `__main__`, as `python -m` runs it: not also as itself
    del sys.modules[CHILD]
    delattr(sys.modules["auditor.capture"], "child")
    serve(sys.argv[1])
    runpy._run_module_as_main(CHILD, alter_argv=True)
