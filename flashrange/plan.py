"""Device-side work lists for the Triton kernels (DESIGN §4).

``build_plan`` turns the slice tensors into the lists a block-major kernel
walks. Everything runs on the slices' device with static shapes: sorts,
cumulative sums, ``searchsorted`` and ``scatter_add``; never ``.item()``,
``.tolist()``, ``.cpu()`` nor a shape that depends on tensor values, so it is
captured by CUDA graphs and traced by ``torch.compile`` unchanged. Extra
memory is O(T + S).

The plan is kernel-agnostic: plain int32 tensors.

- ``slices`` ``(S, 5)`` int32, rows ``(qs, qe, ks, ke, type)``, clamped to
  ``[0, Tq]`` / ``[0, Tk]``, in a canonical order that depends only on the
  set of non-empty slices (never on their order in the input nor on padding).
  Empty slices and slices of unknown type sort last and are never visited.
- ``block_lo``, ``block_hi`` ``(n_blocks,)`` int32: block ``b`` of the major
  axis (queries, or keys when ``transpose=True``) must visit slices
  ``slices[block_lo[b]:block_hi[b]]``; every slice that meets the block is in
  that window; a few in it may not meet the block and the kernel skips them.
- ``block_order`` ``(n_blocks,)`` int32: the blocks, heaviest first (the
  estimated number of covered cells), so that long programs start first and
  the tail of the grid is made of short ones (longest-processing-time order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .reference import BI_CAUSAL, FULL

__all__ = ["RangePlan", "build_plan", "build_plan_torch", "canonical_slices", "MAX_TOKENS"]

# Canonical sort keys pack two coordinates in one int64: 30 bits each.
MAX_TOKENS = (1 << 30) - 1


class RangePlan(NamedTuple):
    slices: torch.Tensor
    block_lo: torch.Tensor
    block_hi: torch.Tensor
    block_order: torch.Tensor


def _segments(major_len, minor_len, types, transpose):
    """Per-slice count functions along the major axis, as two linear segments.

    Segment ``(a, b, v, slope)`` in slice-local coordinates: positions
    ``x in [a, b)`` of the major axis each cover ``v + slope * (x - a)`` cells.
    Exact for every type but BI_CAUSAL along keys, which is spread evenly (the
    counts only order the blocks).
    """
    zero = torch.zeros_like(major_len)
    if not transpose:
        lq, lk = major_len, minor_len
        off = lk - lq
        # FULL: every row covers Lk keys.
        full = (zero, lq, lk, zero)
        # CAUSAL: row i' covers i' + off + 1 keys once that is positive.
        r = torch.clamp(-off, min=0)
        causal = (r, torch.maximum(r, lq), r + off + 1, zero + 1)
        # INV_CAUSAL: row i' covers Lk - i' keys while i' < Lk.
        inv = (zero, torch.minimum(lq, lk), lk, zero - 1)
        # BI_CAUSAL: every row covers off + 1 keys when Lk >= Lq.
        bi = (zero, torch.where(off >= 0, lq, zero), off + 1, zero)
        segs_a = [full, causal, inv, bi]
        segs_b = [(zero, zero, zero, zero)] * 4
    else:
        lk, lq = major_len, minor_len
        off = lk - lq
        # FULL: every key is read by Lq rows.
        full = (zero, lk, lq, zero)
        # CAUSAL: key j' is read by Lq rows while j' <= off, then by Lk - j'.
        c_split = torch.clamp(off + 1, min=0, max=None)
        c_split = torch.minimum(c_split, lk)
        causal_a = (zero, c_split, lq, zero)
        causal_b = (c_split, lk, lk - c_split, zero - 1)
        # INV_CAUSAL: key j' is read by min(j' + 1, Lq) rows.
        i_split = torch.minimum(lq, lk)
        inv_a = (zero, i_split, zero + 1, zero + 1)
        inv_b = (i_split, lk, lq, zero)
        # BI_CAUSAL: (off + 1) * Lq cells spread over the Lk keys.
        bi = (zero, torch.where(off >= 0, lk, zero), (off + 1) * lq // lk.clamp(min=1), zero)
        segs_a = [full, causal_a, inv_a, bi]
        segs_b = [(zero, zero, zero, zero), causal_b, inv_b, (zero, zero, zero, zero)]

    def pick(segs):
        parts = []
        for f in range(4):
            stacked = torch.stack([s for s in (segs[0][f], segs[1][f], segs[2][f], segs[3][f])])
            parts.append(torch.gather(stacked, 0, types.clamp(0, 3).long().unsqueeze(0)).squeeze(0))
        return parts

    return pick(segs_a), pick(segs_b)


def _block_work(starts, segs, valid, T, n_blocks, block):
    """Int64 ``(n_blocks,)``: estimated covered cells of each block of the major axis."""
    dev = starts.device
    d1 = torch.zeros(T + 2, dtype=torch.int64, device=dev)
    d2 = torch.zeros(T + 3, dtype=torch.int64, device=dev)
    for a, b, v, slope in segs:
        ok = valid & (b > a)
        a_g = (starts + a).clamp(0, T).long()
        b_g = (starts + b).clamp(0, T).long()
        v = torch.where(ok, v, torch.zeros_like(v)).long()
        slope = torch.where(ok, slope, torch.zeros_like(slope)).long()
        n = (b_g - a_g).clamp(min=0)
        # A linear piece as a step of v at a, a slope change at a + 1, and the
        # opposite step and slope change where it ends.
        d1.scatter_add_(0, a_g, v)
        d1.scatter_add_(0, b_g, -(v + slope * n))
        d2.scatter_add_(0, a_g + 1, slope)
        d2.scatter_add_(0, b_g + 1, -slope)
    per_pos = d1.cumsum(0)[:T] + d2.cumsum(0).cumsum(0)[:T]
    padded = torch.zeros(n_blocks * block, dtype=torch.int64, device=dev)
    padded[:T] = per_pos
    return padded.view(n_blocks, block).sum(1)


def build_plan(q_ranges, k_ranges, mask_types, Tq, Tk, block, *, transpose=False, backend=None):
    """Work lists for a kernel whose programs own blocks of ``block`` queries.

    With ``transpose=True`` the programs own blocks of ``block`` keys (the
    dK/dV backward). `q_ranges`, `k_ranges`: `(S, 2)` int32; `mask_types`:
    `(S,)` int32; all on the same device. Returns a :class:`RangePlan`.

    ``backend``: ``"triton"`` (three launches, the default on CUDA) or
    ``"torch"`` (plain PyTorch ops, the default elsewhere); both give
    identical plans.
    """
    if backend is None:
        backend = "triton" if q_ranges.is_cuda else "torch"
    if backend == "triton":
        from .kernels.plan import build_plan_triton

        return build_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, block, transpose=transpose)
    if backend != "torch":
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    return build_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk, block, transpose=transpose)


def canonical_slices(q_ranges, k_ranges, mask_types, Tq, Tk, *, transpose=False):
    """Int64 ``(S, 5)``: the plan's ``slices`` (clamped, canonical order, type -1 when never visited).

    Canonical order: by (major start, minor start), ties by (major end,
    minor end, type); two stable sorts, the secondary key first. Slices equal
    in all five values are interchangeable, so their relative order changes
    no result bit.
    """
    qr = q_ranges.reshape(-1, 2).long()
    kr = k_ranges.reshape(-1, 2).long()
    types = mask_types.reshape(-1).long()
    qs, qe = qr[:, 0].clamp(0, Tq), qr[:, 1].clamp(0, Tq)
    ks, ke = kr[:, 0].clamp(0, Tk), kr[:, 1].clamp(0, Tk)
    valid = (qe > qs) & (ke > ks) & (types >= FULL) & (types <= BI_CAUSAL)
    ms, me, ns, ne = (ks, ke, qs, qe) if transpose else (qs, qe, ks, ke)
    big = torch.full_like(ms, 1 << 62)
    primary = torch.where(valid, (ms << 32) | ns, big)
    secondary = (me << 32) | (ne << 2) | types.clamp(0, 3)
    order = torch.sort(secondary, stable=True).indices
    order = order.gather(0, torch.sort(primary.gather(0, order), stable=True).indices)
    slices = torch.stack([qs, qe, ks, ke, torch.where(valid, types, torch.full_like(types, -1))], dim=1)
    return slices.index_select(0, order)


def build_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk, block, *, transpose=False):
    """:func:`build_plan` in plain PyTorch ops: readable, any device, ~100 small launches."""
    dev = q_ranges.device
    slices = canonical_slices(q_ranges, k_ranges, mask_types, Tq, Tk, transpose=transpose)
    qs, qe, ks, ke, types = slices.unbind(1)
    valid = types >= 0
    if transpose:
        ms, me, ns, ne, T = ks, ke, qs, qe, Tk
    else:
        ms, me, ns, ne, T = qs, qe, ks, ke, Tq
    n_blocks = max(1, -(-T // block))

    start_s = torch.where(valid, ms, torch.full_like(ms, T + 1))
    end_s = torch.where(valid, me, torch.zeros_like(me))
    b0 = torch.arange(n_blocks, device=dev, dtype=torch.int64) * block
    b1 = (b0 + block).clamp(max=T)
    block_hi = torch.searchsorted(start_s, b1, right=False)
    # Slices before the first whose running maximum end passes b0 end before the block.
    run_end = torch.cummax(end_s, dim=0).values if end_s.numel() else end_s
    block_lo = torch.searchsorted(run_end, b0, right=True)
    block_lo = torch.minimum(block_lo, block_hi)

    seg_a, seg_b = _segments(me - ms, ne - ns, types, transpose)
    work = _block_work(ms, [seg_a, seg_b], valid, T, n_blocks, block)
    block_order = torch.sort(-work, stable=True).indices

    return RangePlan(
        slices.to(torch.int32).contiguous(),
        block_lo.to(torch.int32),
        block_hi.to(torch.int32),
        block_order.to(torch.int32),
    )
