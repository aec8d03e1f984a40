"""The numerics module hooks' cost in the steps the checks skip, with and without the light path
(auditor.capture.numerics.collector.Numerics._light_call), alternated in one process.

    python bench/bench_light_forward.py [--blocks 40] [--steps 5] [--layers 40] [--width 32]

The issue's CPU proxy of a host-bound step (40 x (Linear + LayerNorm + GELU), AdamW, batch 16,
one thread) under the probes and collectors as the child installs them, stepped as unchecked steps
(step indices past the dense start, never one in 32): blocks of `--steps` steps with the light
path on, then off (every module call through torch's slow path, as before it), in turns. Prints
the medians of each block's CPU time per step (process CPU: robust on a loaded machine) and the
forward-phase tallies of the last block of each, which must be the same.
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
    proxy = Proxy(args.layers, args.width)
    rec, w = proxy.rec, args.width
    numerics = next(c for c in proxy.collectors if c.name == "numerics")
    cpu: dict[bool, list[float]] = {True: [], False: []}
    phases: dict[bool, list] = {}
    for b in range(args.blocks):
        for light in (True, False):
            numerics.light_ok = light
            c0 = time.process_time()
            for _ in range(args.steps):
                proxy.step()
            cpu[light].append((time.process_time() - c0) * 1e3 / args.steps)
            phases[light] = [(t["kind"], t["what"], t["where"]["line"], t["count"]) for t in rec.drain()
                             if t["kind"] == "forward"]
    warm = min(3, args.blocks - 1)
    on, off = (statistics.median(cpu[k][warm:]) for k in (True, False))
    print(f"{args.layers} x (Linear({w}) + LayerNorm + GELU), AdamW, 1 thread, unchecked steps, "
          f"{args.blocks} blocks of {args.steps} steps each way")
    print(f"light path on   {on:.3f} ms CPU/step (blocks {min(cpu[True]):.3f}-{max(cpu[True]):.3f})")
    print(f"light path off  {off:.3f} ms CPU/step (blocks {min(cpu[False]):.3f}-{max(cpu[False]):.3f}): "
          f"the light path saves {off - on:.3f} ms, {100 * (off - on) / off:.1f}% of the step")
    print(f"forward-phase tallies the same: {phases[True] == phases[False]} ({phases[True][:1]})")


if __name__ == "__main__":
    main()
