"""Where the ranks' inputs are reduced (`audit analyze ... --engine local|ray|dask`): each input is
given to a worker that reads it and returns its small RankSummary (auditor.evidence.ranks.summary),
and the driver only collects them.

- local (the default): a process pool on this machine (concurrent.futures.ProcessPoolExecutor),
  one worker per core unless --workers says otherwise. Workers start from a fork server that has
  imported the reader once (Linux), so each starts in milliseconds and none inherits the driver's
  threads. Inputs totalling less than IN_PROCESS_BYTES, or one worker, are reduced in this process,
  one after another: a pool's start costs more than they take.
- ray: `ray.remote` tasks on the cluster at --address (else RAY_ADDRESS, which ray.init reads),
  or a local Ray started for the run when neither is given.
- dask: `dask.distributed.Client.map` on the scheduler at --address (else DASK_SCHEDULER_ADDRESS),
  or a LocalCluster of --workers processes started for the run.

On a cluster every worker must have auditor installed and see the inputs at the paths given (a
shared filesystem). The engines are optional extras (`pip install 'auditor[ray]'`, `auditor[dask]`);
asking for one that is not installed raises EngineUnavailable, a one-line usage error.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from pathlib import Path

import msgspec

from auditor.evidence.ranks.summary import RankFailure, RankSummary, reduce_trace

ENGINES = ("local", "ray", "dask")
IN_PROCESS_BYTES = 32 << 20
_EXTRA = {"ray": "auditor[ray]", "dask": "auditor[dask]"}
_ENV = {"ray": "RAY_ADDRESS", "dask": "DASK_SCHEDULER_ADDRESS"}

Result = RankSummary | RankFailure
T = TypeVar("T")


class EngineUnavailable(Exception):
    """The engine asked for cannot run here (not installed, or its cluster cannot be reached)."""


class EngineSpec(msgspec.Struct):
    """How to reduce the ranks: engine (ENGINES), address of an existing cluster (None: the
    engine's environment variable, else a local one), workers (None: one per core); sketch: the
    driver holds no trace's events, the primary rank's traces as their sketches (`audit analyze`,
    whose rules then run where they are parsed: auditor.rules.primary); False: it parses them
    (`audit diff`, which compares their events)."""

    engine: str = "local"
    address: str | None = None
    workers: int | None = None
    sketch: bool = False


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def check_available(spec: EngineSpec) -> None:
    """Raise EngineUnavailable when `spec.engine` is not installed (before any input is read)."""
    if spec.engine not in ENGINES:
        raise EngineUnavailable(f"--engine {spec.engine}: unknown engine (choose from {', '.join(ENGINES)})")
    module = {"ray": "ray", "dask": "dask.distributed"}.get(spec.engine)
    if module is None:
        return
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as e:
        raise EngineUnavailable(f"--engine {spec.engine} needs {module}, which is not installed here "
                                f"({e.msg}): pip install '{_EXTRA[spec.engine]}'") from None


def reduce_all(paths: list[str], spec: EngineSpec,
               on_done: Callable[[Result | None, int, int], None] | None = None,
               reduce: Callable[[str], Result] = reduce_trace) -> list[Result]:
    """Every input reduced by `reduce` on the engine `spec` names, in the order of `paths`.
    `on_done(result, done, total)` is called in the driver as each finishes (in whatever order),
    and once before any, with result None and done 0."""
    check_available(spec)
    run = {"local": _local, "ray": _ray, "dask": _dask}[spec.engine]
    results: dict[int, Result] = {}
    if on_done is not None:  # (none done yet: a progress bar shows from the start)
        on_done(None, 0, len(paths))
    for i, res in run(paths, spec, reduce):
        results[i] = res
        if on_done is not None:
            on_done(res, len(results), len(paths))
    return [results[i] for i in range(len(paths))]


def _sizes(paths: list[str]) -> int:
    total = 0
    for p in paths:
        try:
            total += os.stat(p).st_size
        except OSError:
            pass
    return total


def _context():
    """The multiprocessing context local workers start from: a fork server that has imported the
    reader once (Linux), else spawn."""
    import multiprocessing

    if sys.platform == "linux":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["auditor.evidence.ranks.summary", "auditor.evidence.trace.load"])
        return context
    return multiprocessing.get_context("spawn")


def in_child(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` run in a process of its own on this machine, which ends when it returns: what it
    parses and allocates is given back to the system then, and never held by this one. (A worker
    that dies is the RuntimeError of its exit.)"""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=1, mp_context=_context()) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool as e:
            raise RuntimeError(f"the process analysing the primary rank's trace ended early: {e}") from None


def _local(paths: list[str], spec: EngineSpec, reduce: Callable[[str], Result]) -> Iterator[tuple[int, Result]]:
    workers = min(spec.workers or cores(), len(paths))
    if workers <= 1 or (spec.workers is None and _sizes(paths) < IN_PROCESS_BYTES):
        for i, p in enumerate(paths):
            yield i, reduce(p)
        return
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=workers, mp_context=_context()) as pool:
        futures = {pool.submit(reduce, p): i for i, p in enumerate(paths)}
        try:
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    yield i, fut.result()
                except Exception as e:  # a worker died (killed, out of memory): that rank is unread
                    yield i, RankFailure(path=paths[i], reason=f"{paths[i]}: its worker failed: "
                                                               f"{type(e).__name__}: {e}")
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _address(spec: EngineSpec) -> str | None:
    return spec.address or os.environ.get(_ENV[spec.engine]) or None


def _dask(paths: list[str], spec: EngineSpec, reduce: Callable[[str], Result]) -> Iterator[tuple[int, Result]]:
    from dask.distributed import Client, LocalCluster, as_completed

    address = _address(spec)
    cluster = None
    try:
        if address is None:
            cluster = LocalCluster(n_workers=min(spec.workers or cores(), len(paths)), threads_per_worker=1,
                                   processes=True, dashboard_address=None)
            client = Client(cluster)
        else:
            client = Client(address, timeout="20s")
    except (OSError, TimeoutError) as e:
        raise EngineUnavailable(f"--engine dask: cannot reach the scheduler at {address}: {e}") from None
    try:
        # a task lost with its worker (killed, out of memory) runs again elsewhere; a damaged trace
        # is no exception (reduce returns its RankFailure), so it is not retried
        futures = client.map(reduce, paths, pure=False, retries=2)
        index = {f.key: i for i, f in enumerate(futures)}
        for fut in as_completed(futures):
            i = index[fut.key]
            try:
                yield i, fut.result()
            except Exception as e:  # the task failed on its worker (lost worker, killed)
                yield i, RankFailure(path=paths[i], reason=f"{paths[i]}: its dask task failed: "
                                                           f"{type(e).__name__}: {e}")
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _ray(paths: list[str], spec: EngineSpec, reduce: Callable[[str], Result]) -> Iterator[tuple[int, Result]]:
    import ray

    started = False
    if not ray.is_initialized():
        address = _address(spec)
        try:
            # (Ray's own log lines stay in its session's logs: the audit's output is the audit's)
            quiet = dict(log_to_driver=False, logging_level=logging.ERROR)
            if address is None:
                ray.init(num_cpus=spec.workers or cores(), include_dashboard=False, **quiet)
            else:
                ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError, TimeoutError) as e:
            raise EngineUnavailable(f"--engine ray: cannot reach the cluster at {address}: {e} (a cluster with token "
                                    f"authentication needs RAY_AUTH_MODE=token and its token here too)") from None
        started = True
    try:
        task = ray.remote(num_cpus=1)(apply)  # (ray.remote takes functions: `reduce` may be a callable Struct)
        refs = [task.remote(reduce, p) for p in paths]
        index = {r: i for i, r in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = index[ref]
                try:
                    yield i, ray.get(ref)
                except Exception as e:  # the task failed on its worker
                    yield i, RankFailure(path=paths[i], reason=f"{paths[i]}: its ray task failed: "
                                                               f"{type(e).__name__}: {e}")
    finally:
        if started:
            ray.shutdown()


def apply(reduce: Callable[[str], Result], path: str) -> Result:
    """`reduce(path)`: the task a Ray worker runs."""
    return reduce(path)


def label(path: str) -> str:
    """How a rank's input is named in lines about it."""
    return Path(path).name
