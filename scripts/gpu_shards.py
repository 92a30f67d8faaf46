"""Cut the GPU suite's tests into pytest processes that run side by side (``scripts/gpu_suite.sh``).

    python -m pytest --collect-only -q -m gpu tests | python scripts/gpu_shards.py --out DIR [--size 16]

On a fresh GPU machine compiling dominates the suite, and one Triton compile runs on one core: so the more
processes run at once (up to the cores), the sooner it ends. Each test whose name says it is long (``fuzz``:
hundreds of masks, each with kernels of its own) gets a process of its own; the others go in runs of
``--size`` consecutive tests of one file, so that tests that build the same kernels stay together (the
processes share one on-disk cache, but two that build the same kernel at once both build it). Writes
``DIR/shard_<n>.txt``, one node id a line, longest first (the long ones start first), and prints their count.
"""

from __future__ import annotations

import argparse
import os
import sys

LONG = ("fuzz",)


def shards(node_ids, size, long_words=LONG):
    """Lists of node ids: each long test alone (first), then runs of at most ``size`` consecutive tests of one
    file, in the order given."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    alone, runs = [], []
    for node in node_ids:
        name = node.split("::", 1)[-1]
        if any(word in name for word in long_words):
            alone.append([node])
            continue
        file = node.split("::", 1)[0]
        if runs and len(runs[-1]) < size and runs[-1][0].split("::", 1)[0] == file:
            runs[-1].append(node)
        else:
            runs.append([node])
    return alone + runs


def node_ids(lines):
    """The node ids in ``pytest --collect-only -q`` output (its summary lines left out)."""
    return [line.strip() for line in lines if "::" in line and not line.startswith(("=", " "))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the shard files")
    ap.add_argument("--size", type=int, default=16, help="tests per process, long ones aside")
    args = ap.parse_args(argv)
    ids = node_ids(sys.stdin)
    if not ids:
        sys.exit("gpu_shards.py: no tests in the input (pytest --collect-only -q -m gpu ... | gpu_shards.py)")
    os.makedirs(args.out, exist_ok=True)
    parts = shards(ids, args.size)
    for i, part in enumerate(parts):
        with open(os.path.join(args.out, f"shard_{i:03d}.txt"), "w") as f:
            f.write("\n".join(part) + "\n")
    print(len(parts))


if __name__ == "__main__":
    main()
