"""Balance and traffic figures of context parallelism for document-causal masks, without processes.

``python -m flashrange.distributed.report`` plans packed causal documents
(uneven lengths, seeded) over simulated ranks and prints, per rank, the
covered cells of its rows, the key/value tokens it receives and sends, and
what ring attention would move, with the planning time. Options:
``--seqlen``, ``--ranks``, ``--docs`` (several), ``--chunk-size``,
``--heads-kv`` / ``--head-dim`` (bytes per token for the byte totals),
``--threads`` (intra-op threads while planning; 1 by default, as torchrun
sets for multi-process jobs: the planner's tensors are small and extra
threads mostly add start-up cost).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..mask import RangeMask
from .planner import plan_context_parallel

__all__ = ["document_lengths", "report", "main"]


def document_lengths(total: int, docs: int, seed: int = 0) -> torch.Tensor:
    """``docs`` uneven lengths summing to ``total`` (uniform weights in ``[0.2, 1.2)``, seeded)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(docs, generator=g) + 0.2
    lens = (w / w.sum() * total).long().clamp(min=1)
    lens[-1] += total - int(lens.sum())
    return lens


def report(seqlen=1 << 20, ranks=8, docs=(16, 128, 4096), chunk_size=None, heads_kv=8, head_dim=128,
           dtype=torch.bfloat16) -> str:
    """The report as text (see the module docstring)."""
    lines = []
    per_token = heads_kv * 2 * head_dim * torch.empty(0, dtype=dtype).element_size()
    for n in docs:
        lens = document_lengths(seqlen, n)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        mask = RangeMask.varlen(cu, causal=True)
        t0 = time.perf_counter()
        plan = plan_context_parallel(*mask.tensors(), seqlen, ranks, chunk_size)
        t1 = time.perf_counter()
        plan.local_ranges(0)
        plan.send_index(0)
        t2 = time.perf_counter()
        recv = int(plan.recv_tokens.sum())
        ring = int(plan.ring_tokens.sum())
        lines.append(f"== {n} causal documents (uneven lengths), {seqlen} tokens, {ranks} ranks ==")
        lines.append(
            f"planning: {1e3 * (t1 - t0):.1f} ms for all ranks; one rank's local ranges and send list: "
            f"{1e3 * (t2 - t1):.1f} ms"
        )
        lines.append(plan.summary())
        lines.append(
            f"total received per forward: {recv} tokens = {recv * per_token / 2**30:.2f} GiB "
            f"(Hkv={heads_kv}, D={head_dim}, {str(dtype).replace('torch.', '')}); ring: {ring} tokens = "
            f"{ring * per_token / 2**30:.2f} GiB"
        )
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=1 << 20)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--docs", type=int, nargs="+", default=[16, 128, 4096])
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(report(a.seqlen, a.ranks, a.docs, a.chunk_size, a.heads_kv, a.head_dim))


if __name__ == "__main__":
    main()
