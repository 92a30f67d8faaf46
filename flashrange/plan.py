"""The plan: device-side work lists for the kernels (docs/design.md §5).

A :class:`RangePlan` is plain int32 tensors built from the slice tensors once
per mask and reused by every call that uses the mask: the forward and the dQ
kernel walk its query-major half, the dK/dV kernel its key-major half. It is
built on the slices' device with static shapes (sorts, cumulative sums,
``searchsorted``, ``scatter_add``; never ``.item()``, ``.tolist()``, ``.cpu()``
nor a shape that depends on tensor values), so it is traced by
``torch.compile`` and captured by CUDA graphs unchanged. Extra memory is
O(T + S).

This module holds the contract and the plain-PyTorch builder; the Triton
builder (a few launches instead of ~100) lives with the kernels, in
:mod:`flashrange.kernels.plan`, and gives identical tensors.

Per axis (a :class:`BlockPlan`), with blocks of :data:`~flashrange.constants.PLAN_BLOCK`
queries (query-major) or keys (key-major):

- ``slices`` ``(S, 5)`` int32, rows ``(qs, qe, ks, ke, type)``, clamped to
  ``[0, Tq]`` / ``[0, Tk]``, in a canonical order that depends only on the
  set of non-empty slices (never on their order in the input nor on padding).
  Empty slices and slices of unknown type get type ``-1``, sort last and are
  never visited.
- ``block_lo``, ``block_hi`` ``(n_blocks,)`` int32: block ``b`` must visit
  slices ``slices[block_lo[b]:block_hi[b]]``; every slice that meets the
  block is in that window; a few in it may not meet the block and the kernel
  skips them. A kernel whose tile is a fraction of the block reads its
  parent block's window.
- ``block_order`` ``(n_blocks,)`` int32: the blocks, heaviest first (the
  estimated number of covered cells), so that long programs start first and
  the tail of the grid is made of short ones (longest-processing-time order),
  with the blocks of one window start kept together: groups of equal
  ``block_lo`` (one document each, for document masks) by their heaviest
  block's work (ties: lower ``block_lo`` first), each group's blocks heaviest
  first (ties: lower block first). Blocks of one document read the same keys,
  so running them side by side keeps those keys in L2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .constants import BI_CAUSAL, FULL, PLAN_BLOCK

__all__ = [
    "BlockPlan",
    "RangePlan",
    "plan_blocks",
    "check_plan",
    "canonical_slices",
    "build_block_plan_torch",
    "build_plan_torch",
]


class BlockPlan(NamedTuple):
    """The work lists of one axis (see the module docstring)."""

    slices: torch.Tensor
    block_lo: torch.Tensor
    block_hi: torch.Tensor
    block_order: torch.Tensor


class RangePlan(NamedTuple):
    """A mask's plan: query-major work lists for the forward and dQ, key-major for dK/dV.

    Build it with :func:`flashrange.plan_mask` (or :meth:`flashrange.RangeMask.plan`)
    and pass it as ``plan=`` to :func:`flashrange.range_attention` and the
    front-ends, once per mask however many layers use it. Plain tensors: it
    can be an input or an intermediate of a compiled function, and a CUDA
    graph that captures the planning call replays it after in-place updates
    of the ranges.
    """

    q_slices: torch.Tensor
    q_block_lo: torch.Tensor
    q_block_hi: torch.Tensor
    q_block_order: torch.Tensor
    k_slices: torch.Tensor
    k_block_lo: torch.Tensor
    k_block_hi: torch.Tensor
    k_block_order: torch.Tensor

    @property
    def queries(self) -> BlockPlan:
        return BlockPlan(*self[:4])

    @property
    def keys(self) -> BlockPlan:
        return BlockPlan(*self[4:])


def plan_blocks(T):
    """Blocks of :data:`PLAN_BLOCK` along an axis of ``T`` tokens (works on symbolic sizes)."""
    return (T + PLAN_BLOCK - 1) // PLAN_BLOCK


def check_plan(plan, S, Tq, Tk):
    """Raise ``ValueError`` unless ``plan`` is a :class:`RangePlan` for ``S`` slices over ``Tq x Tk``.

    Shapes only: free, and valid under ``torch.compile``. Returns the plan as a :class:`RangePlan`.
    """
    if type(plan) is not RangePlan:
        if not isinstance(plan, (tuple, list)) or len(plan) != 8:
            raise TypeError(
                f"plan must be a flashrange.RangePlan (from flashrange.plan_mask), got {type(plan).__name__}"
            )
        plan = RangePlan(*plan)
    nq, nk = plan_blocks(Tq), plan_blocks(Tk)
    i32 = torch.int32
    qs, qlo, qhi, qo, ks, klo, khi, ko = plan
    # One chained comparison on the common path: this runs on every call that passes a plan.
    try:
        ok = (
            qs.shape == (S, 5) and ks.shape == (S, 5)
            and qlo.shape == qhi.shape == qo.shape == (nq,) and klo.shape == khi.shape == ko.shape == (nk,)
            and qs.dtype == qlo.dtype == qhi.dtype == qo.dtype == ks.dtype == klo.dtype == khi.dtype == ko.dtype == i32
        )
    except AttributeError:
        ok = False
    if ok:
        return plan
    want = ((S, 5), (nq,), (nq,), (nq,), (S, 5), (nk,), (nk,), (nk,))
    for name, t, shape in zip(plan._fields, plan, want):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"plan.{name} must be a torch.Tensor, got {type(t).__name__}; build the plan with "
                            "flashrange.plan_mask")
        if tuple(t.shape) != shape or t.dtype != i32:
            raise ValueError(
                f"this plan does not fit the call: plan.{name} is {tuple(t.shape)} {t.dtype}, expected "
                f"{shape} int32 for {S} slices over Tq={Tq}, Tk={Tk}; build it with "
                "flashrange.plan_mask(q_ranges, k_ranges, mask_types, Tq, Tk) for these tensors"
            )
    raise ValueError(f"this plan does not fit the call for {S} slices over Tq={Tq}, Tk={Tk}")


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
    # A BI_CAUSAL band with Lq > Lk covers no cell: never visited (its key span
    # would still load values, and 0 * NaN must not reach a covered row).
    empty_band = (types == BI_CAUSAL) & (qe - qs > ke - ks)
    valid = (qe > qs) & (ke > ks) & (types >= FULL) & (types <= BI_CAUSAL) & ~empty_band
    ms, me, ns, ne = (ks, ke, qs, qe) if transpose else (qs, qe, ks, ke)
    big = torch.full_like(ms, 1 << 62)
    primary = torch.where(valid, (ms << 32) | ns, big)
    secondary = (me << 32) | (ne << 2) | types.clamp(0, 3)
    order = torch.sort(secondary, stable=True).indices
    order = order.gather(0, torch.sort(primary.gather(0, order), stable=True).indices)
    slices = torch.stack([qs, qe, ks, ke, torch.where(valid, types, torch.full_like(types, -1))], dim=1)
    return slices.index_select(0, order)


def build_block_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk, block=PLAN_BLOCK, *, transpose=False):
    """One axis of the plan in plain PyTorch ops: readable, any device, ~50 small launches.

    Blocks of ``block`` queries, or keys with ``transpose=True``. Returns a :class:`BlockPlan`."""
    dev = q_ranges.device
    slices = canonical_slices(q_ranges, k_ranges, mask_types, Tq, Tk, transpose=transpose)
    qs, qe, ks, ke, types = slices.unbind(1)
    valid = types >= 0
    if transpose:
        ms, me, ns, ne, T = ks, ke, qs, qe, Tk
    else:
        ms, me, ns, ne, T = qs, qe, ks, ke, Tq
    n_blocks = -(-T // block)

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
    block_order = _block_order(work, block_lo, slices.shape[0])

    return BlockPlan(
        slices.to(torch.int32).contiguous(),
        block_lo.to(torch.int32),
        block_hi.to(torch.int32),
        block_order.to(torch.int32),
    )


def _block_order(work, block_lo, S):
    """The blocks in the order of ``block_order`` (module docstring): by (group's heaviest block's work
    descending, ``block_lo``, own work descending, block index).

    A group is the blocks of one window start (one document of a document mask): contiguous, since
    ``block_lo`` never decreases. Stable sorts, the least significant key first."""
    group_max = torch.zeros(S + 1, dtype=work.dtype, device=work.device)
    group_max = group_max.scatter_reduce(0, block_lo, work, reduce="amax", include_self=True)
    group_work = group_max.gather(0, block_lo)
    order = torch.sort(-work, stable=True).indices
    order = order.gather(0, torch.sort(block_lo.gather(0, order), stable=True).indices)
    return order.gather(0, torch.sort(-group_work.gather(0, order), stable=True).indices)


def build_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk):
    """:class:`RangePlan` in plain PyTorch ops (the CPU path; the reference for the Triton builder)."""
    return RangePlan(
        *build_block_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk),
        *build_block_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk, transpose=True),
    )
