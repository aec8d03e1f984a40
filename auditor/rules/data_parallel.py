"""data-parallel: nn.DataParallel where DistributedDataParallel applies."""
from __future__ import annotations

from typing import Iterable

from auditor.evidence import model as m
from auditor.evidence.distributed import frame_of
from auditor.rules.base import Options, Rule
from auditor.findings import Cost, Finding, Fix, Location


class DataParallel(Rule):
    """
    What it detects:
        A model wrapped in `torch.nn.DataParallel` in a training step (one that runs backward).

    Why it costs:
        DataParallel is one process driving every GPU from Python threads: it copies the whole
        model to each GPU on every forward, scatters inputs and gathers outputs through GPU 0, and
        its threads contend for the GIL. PyTorch's documentation recommends DistributedDataParallel
        even on a single machine: one process per GPU, gradients all-reduced while backward runs,
        no per-step replication; it is faster and balances memory across GPUs.

    Example:
        bad:   model = nn.DataParallel(model)
        good:  dist.init_process_group("nccl"); model = DDP(model.to(local_rank), device_ids=[local_rank])
               and launch with `torchrun --nproc-per-node N` (or `audit run --nproc-per-node N`)

    Fix:
        Initialise a process group from the launcher's environment, wrap the model in
        DistributedDataParallel on this rank's device, give the DataLoader a DistributedSampler,
        and launch one process per GPU with torchrun.

    Evidence needed:
        A run: the probe on DataParallel's constructor gives the line and device ids; the backward
        probes tell a training step from inference.
    """

    id = "data-parallel"
    title = "nn.DataParallel where DistributedDataParallel applies"
    severity = "warning"
    warns_uncounted = "DataParallel copies the model to every GPU each step; DistributedDataParallel does not"
    category = "performance"
    needs = frozenset({"run"})
    options = ()

    def check(self, ev: m.Evidence, options: Options) -> Iterable[Finding]:
        dps = ev.distributed.data_parallel if ev.distributed is not None else []
        training = bool(ev.tallies(m.BACKWARD))
        for dp in dps:
            where = frame_of(dp.where)
            calls = [f for s in ev.steps if s.distributed is not None for f in s.distributed.dp_forwards
                     if f.dp == dp.index]
            n_calls = sum(f.calls for f in calls)
            if not n_calls:
                continue  # wrapped but never called in the step
            ms = sum(f.ms for f in calls) / max(1, len(ev.steps))
            devices = len(dp.device_ids)
            here = (f"over {devices} GPUs" if devices > 1 else
                    "on one device here (on a multi-GPU machine it replicates the model every forward)")
            yield self.finding(
                "nn.DataParallel drives GPUs from one process: use DDP instead. "
                f"In this run nn.DataParallel wraps the {dp.module or 'model'} {here}, called {n_calls} times in "
                f"{len(ev.steps)} steps{' of training' if training else ''}: a single process driving the GPUs from "
                f"threads. DistributedDataParallel (one process per GPU) is faster"
                + (", and the step trains, so it applies." if training else "."),
                severity=None if training else "info",
                locations=[Location.of(where)] if where else [],
                evidence={"device_ids": dp.device_ids, "cuda_devices": dp.cuda_devices,
                          "forward_calls": n_calls, "training": training, "forward_ms_per_step": round(ms, 3)},
                cost=Cost(ms_per_step=None, share_of_step=None, measured=False,
                          note="not measurable on this machine: depends on the number of GPUs"
                          if devices <= 1 else "DataParallel's replication, scatter and gather, per forward"),
                fix=Fix(summary="Launch one process per GPU (torchrun --nproc-per-node N) and wrap the model in "
                                "DistributedDataParallel(model.to(local_rank), device_ids=[local_rank]) after "
                                "dist.init_process_group(); use a DistributedSampler.",
                        config={"launcher": "torchrun --nproc-per-node N",
                                "wrapper": "torch.nn.parallel.DistributedDataParallel"}),
            )
