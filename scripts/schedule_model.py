"""How evenly a persistent grid's programs share a plan's work items, by schedule (a model; no GPU).

    PYTHONPATH=. python scripts/schedule_model.py --cases doc16-32k,doc128-32k,causal-8k [--programs 132]

An item is a query block of the plan (``PLAN_BLOCK`` rows) for one head, taken in the plan's block order
with the heads side by side, as the kernels take them. Its cost is modelled as ``item + tile * n``, ``n`` the
key tiles (``--tile-keys`` wide) its rows reach over its slices, from the per-type inequalities of
docs/design.md §2 (not from the kernels' code); the defaults are cycles of the eighteenth session's item
trace on an H100 (BENCHMARKS.md). Two schedules:

- ``fixed``: the persistent kernels' zig-zag share (program ``p`` takes items ``p``, ``2P - 1 - p``,
  ``2P + p``, ...);
- ``dynamic``: each program takes the next item of the list when it is done with its previous one.

Prints, per case and schedule, the busiest program's load over the mean (1.0 is a perfect share) and that
load in milliseconds at ``--ghz``.
"""

from __future__ import annotations

import argparse
import heapq

import torch

from flashrange.bench.cases import select
from flashrange.constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, PLAN_BLOCK
from flashrange.plan import build_plan_torch


def reach(r0, r1, slice_row):
    """Keys ``[lo, hi)`` that rows ``[r0, r1)`` reach in one slice (empty: ``lo >= hi``)."""
    qs, qe, ks, ke, kind = slice_row
    a, b = max(r0, qs), min(r1, qe)
    if b <= a or kind not in (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL):
        return 0, 0
    lq, lk = qe - qs, ke - ks
    if kind == BI_CAUSAL and lq > lk:
        return 0, 0
    lo, hi = ks, ke
    if kind in (CAUSAL, BI_CAUSAL):
        # j' <= i' + (Lk - Lq): the last row of the block reaches furthest.
        hi = min(ke, ks + (b - 1 - qs) + (lk - lq) + 1)
    if kind in (INV_CAUSAL, BI_CAUSAL):
        # j' >= i': the first row of the block starts earliest.
        lo = max(ks, ks + (a - qs))
    return lo, hi


def item_tiles(plan, tile_keys):
    """Key tiles of each query block of the plan (summed over the slices of its window)."""
    slices = plan.q_slices.tolist()
    tiles = []
    for b, (w0, w1) in enumerate(zip(plan.q_block_lo.tolist(), plan.q_block_hi.tolist())):
        n = 0
        for row in slices[w0:w1]:
            lo, hi = reach(b * PLAN_BLOCK, (b + 1) * PLAN_BLOCK, row)
            if hi > lo:
                n += (hi - 1) // tile_keys - lo // tile_keys + 1
        tiles.append(n)
    return tiles


def loads(costs, programs, schedule):
    """Each program's summed cost under ``schedule`` (``fixed`` or ``dynamic``)."""
    if schedule == "dynamic":
        heap = [(0.0, p) for p in range(programs)]
        for c in costs:
            t, p = heapq.heappop(heap)
            heapq.heappush(heap, (t + c, p))
        return [t for t, _ in heap]
    out = [0.0] * programs
    for w, c in enumerate(costs):
        i, pos = divmod(w, programs)
        out[pos if i % 2 == 0 else programs - 1 - pos] += c
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="doc16-32k,doc128-32k,doc1024-32k,sharedq-32k,causal-8k,swa2048-32k")
    ap.add_argument("--programs", type=int, default=132, help="persistent programs (SMs)")
    ap.add_argument("--item", type=float, default=10000.0, help="fixed cost per item (cycles)")
    ap.add_argument("--tile", type=float, default=2900.0, help="cost per key tile (cycles)")
    ap.add_argument("--tile-keys", type=int, default=128)
    ap.add_argument("--ghz", type=float, default=1.755)
    args = ap.parse_args()
    print("| case | items | tiles per item | fixed: max / mean | dynamic: max / mean | fixed ms | dynamic ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in select(args.cases):
        mask = case.build("cpu").mask
        plan = build_plan_torch(*mask.tensors(), case.T, case.T)
        tiles = item_tiles(plan, args.tile_keys)
        order = plan.q_block_order.tolist()
        costs = [args.item + args.tile * tiles[order[w // case.Hq]] for w in range(len(order) * case.Hq)]
        mean = sum(costs) / args.programs
        row = [case.name, str(len(costs)), f"{sum(tiles) / len(tiles):.1f}"]
        peaks = [max(loads(costs, args.programs, s)) for s in ("fixed", "dynamic")]
        row += [f"{p / mean:.3f}" for p in peaks] + [f"{p / args.ghz / 1e6:.3f}" for p in peaks]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
