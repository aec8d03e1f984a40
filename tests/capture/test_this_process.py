"""this_process.PID follows a fork (a DataLoader worker's): the evidence writer and the resident
memory read tell such a worker from the audited process by it, without a system call per step."""
from __future__ import annotations

import os

from auditor.capture import stream, this_process, wire


def test_the_pid_follows_a_fork_and_a_forked_writer_stays_silent():
    assert this_process.PID == os.getpid()
    results, evidence = os.pipe(), os.pipe()
    writer = stream.Writer(evidence[1])
    pid = os.fork()
    if pid == 0:  # (the child writes what it sees and leaves at once, running no pytest teardown)
        try:
            writer.send(wire.Setup())  # a forked worker's send: nothing written
            os.write(results[1], f"{this_process.PID} {os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(results[1])
    got = os.read(results[0], 100).decode().split()
    os.waitpid(pid, 0)
    writer.send(wire.Setup())  # the process's own send: written
    os.close(evidence[1])
    assert got == [str(pid), str(pid)]
    assert os.read(evidence[0], 10_000).count(b"\n") == 1
