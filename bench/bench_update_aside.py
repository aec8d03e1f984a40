"""The sync probes' cost in torch's own optimizer update, with and without the flag that has them
pass calls on there (auditor.capture.probes.optimizer_updates._aside), alternated in one process.

    python bench/bench_update_aside.py [--blocks 40] [--steps 5] [--layers 40] [--width 32]

The issue's CPU proxy of a host-bound step (40 x (Linear + LayerNorm + GELU), AdamW, batch 16,
one thread: AdamW reads each of its 160 parameters' step counters with `.item()`) under the probes
and collectors as the child installs them, stepped as unchecked steps: blocks of `--steps` steps
with the flag set during the update, then without (every `.item()` looked at by its probe, as
before it), in turns. Prints the medians of each block's CPU time per step and of its update
(process CPU: robust on a loaded machine), and the sync tallies of the last block of each, which
must be the same (none: torch's reads of its own host counters are not the user's syncs).
"""
from __future__ import annotations

import argparse
import statistics
import time

from inprocess_proxy import Proxy, add_arguments


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args()
    from auditor.capture.probes import optimizer_updates as updates

    proxy = Proxy(args.layers, args.width)
    rec, w = proxy.rec, args.width
    torch_update = updates._torch_update
    cpu: dict[bool, list[float]] = {True: [], False: []}
    update: dict[bool, list[float]] = {True: [], False: []}
    syncs: dict[bool, list] = {}
    for b in range(args.blocks):
        for aside in (True, False):
            updates._torch_update = torch_update if aside else (lambda *a: updates._MINE)
            c0, spent = time.process_time(), 0.0
            for _ in range(args.steps):
                spent += proxy.step()
            cpu[aside].append((time.process_time() - c0) * 1e3 / args.steps)
            update[aside].append(spent * 1e3 / args.steps)
            syncs[aside] = [(t["what"], t["count"]) for t in rec.drain() if t["kind"] == "sync"]
    updates._torch_update = torch_update
    warm = min(3, args.blocks - 1)
    on, off = (statistics.median(cpu[k][warm:]) for k in (True, False))
    u_on, u_off = (statistics.median(update[k][warm:]) for k in (True, False))
    print(f"{args.layers} x (Linear({w}) + LayerNorm + GELU), AdamW, 1 thread, unchecked steps, "
          f"{args.blocks} blocks of {args.steps} steps each way")
    print(f"probes passing calls on in the update  {on:.3f} ms CPU/step (update {u_on:.3f} ms; "
          f"blocks {min(cpu[True]):.3f}-{max(cpu[True]):.3f})")
    print(f"probes looking in the update           {off:.3f} ms CPU/step (update {u_off:.3f} ms; "
          f"blocks {min(cpu[False]):.3f}-{max(cpu[False]):.3f}): the flag saves {off - on:.3f} ms, "
          f"{100 * (off - on) / off:.1f}% of the step")
    print(f"sync tallies the same: {syncs[True] == syncs[False]} ({syncs[True]})")


if __name__ == "__main__":
    main()
