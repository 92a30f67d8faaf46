"""The plan (:mod:`flashrange.plan`) in Triton launches, and the choice of builder.

The plain-PyTorch plan takes about a hundred small kernels (sorts, cumsums,
scatters); each costs a launch, which puts it far above the attention it feeds
for short sequences. Here the same outputs come from three launches that
trade sorting for counting:

1. rank every slice by counting the slices whose canonical key is smaller
   (S x S comparisons, tiled) and scatter it to its rank;
2. per block of the major axis, count the slices that start before the block
   ends (``block_hi``), find the first slice in canonical order that ends after
   the block starts (``block_lo``), and sum the cells the slices cover in the
   block's rows in closed form (the work estimate);
3. rank the blocks by work, heaviest first.

The outputs are identical to :func:`flashrange.plan.build_plan_torch`, which
the tests check; the cost is O(S^2 + S * n_blocks) arithmetic, done in
parallel, and O(S + n_blocks) memory.

:func:`build_plan` picks the builder: these launches for CUDA tensors, the
plain-PyTorch one elsewhere.
"""

import torch
import triton
import triton.language as tl

from ..constants import PLAN_BLOCK
from ..plan import BlockPlan, RangePlan, build_block_plan_torch, build_plan_torch, canonical_slices

__all__ = ["build_plan", "build_block_plan", "build_plan_triton", "build_block_plan_triton", "RANK_BY_COUNTING_MAX"]


@triton.jit
def _load_slice(qr_ptr, kr_ptr, mt_ptr, offs, mask_s, Tq, Tk):
    qs = tl.load(qr_ptr + offs * 2, mask=mask_s, other=0).to(tl.int64)
    qe = tl.load(qr_ptr + offs * 2 + 1, mask=mask_s, other=0).to(tl.int64)
    ks = tl.load(kr_ptr + offs * 2, mask=mask_s, other=0).to(tl.int64)
    ke = tl.load(kr_ptr + offs * 2 + 1, mask=mask_s, other=0).to(tl.int64)
    mt = tl.load(mt_ptr + offs, mask=mask_s, other=-1).to(tl.int64)
    qs = tl.minimum(tl.maximum(qs, 0), Tq)
    qe = tl.minimum(tl.maximum(qe, 0), Tq)
    ks = tl.minimum(tl.maximum(ks, 0), Tk)
    ke = tl.minimum(tl.maximum(ke, 0), Tk)
    valid = mask_s & (qe > qs) & (ke > ks) & (mt >= 0) & (mt <= 3)
    return qs, qe, ks, ke, mt, valid


@triton.jit
def _canonical_keys(qs, qe, ks, ke, mt, valid, IS_TRANSPOSED: tl.constexpr):
    if IS_TRANSPOSED:
        ms, me, ns, ne = ks, ke, qs, qe
    else:
        ms, me, ns, ne = qs, qe, ks, ke
    k1 = tl.where(valid, (ms << 32) | ns, 1 << 62)
    k2 = (me << 32) | (ne << 2) | tl.minimum(tl.maximum(mt, 0), 3)
    return k1, k2


# Slice counts and lengths change between calls; specializing on their values
# (== 1, divisible by 16) would only multiply the kernels built.
@triton.jit(do_not_specialize=["S", "Tq", "Tk"])
def _rank_slices_kernel(
    qr_ptr, kr_ptr, mt_ptr, out_ptr, S, Tq, Tk,
    IS_TRANSPOSED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_s = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    qs, qe, ks, ke, mt, valid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs_s, mask_s, Tq, Tk)
    k1, k2 = _canonical_keys(qs, qe, ks, ke, mt, valid, IS_TRANSPOSED)
    rank = tl.zeros([BLOCK_S], dtype=tl.int32)
    for t0 in range(0, S, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < S
        tqs, tqe, tks, tke, tmt, tvalid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs_t, mask_t, Tq, Tk)
        t1, t2 = _canonical_keys(tqs, tqe, tks, tke, tmt, tvalid, IS_TRANSPOSED)
        # Lexicographic (k1, k2, index): the index makes ranks a permutation;
        # slices equal in (k1, k2) are identical, so their order changes no bit.
        before = (t1[None, :] < k1[:, None]) | (
            (t1[None, :] == k1[:, None])
            & ((t2[None, :] < k2[:, None]) | ((t2[None, :] == k2[:, None]) & (offs_t[None, :] < offs_s[:, None])))
        )
        before = before & mask_t[None, :]
        rank += tl.sum(before.to(tl.int32), axis=1)
    mt_out = tl.where(valid, mt, -1)
    tl.store(out_ptr + rank * 5 + 0, qs.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 1, qe.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 2, ks.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 3, ke.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 4, mt_out.to(tl.int32), mask=mask_s)


@triton.jit
def _segment_cells(x0, x1, a, b, v, slope):
    """Cells in positions ``[x0, x1)`` of the linear piece ``v + slope * (x - a)`` on ``[a, b)``."""
    lo = tl.maximum(x0, a)
    hi = tl.minimum(x1, b)
    n = tl.maximum(hi - lo, 0)
    return n * (v + slope * (lo - a)) + slope * (n * (n - 1) // 2)


@triton.jit
def _slice_cells_in(x0, x1, ms, lmaj, lmin, mt, IS_TRANSPOSED: tl.constexpr):
    """Covered cells of a slice within major positions ``[x0, x1)`` (global coordinates).

    Same pieces as ``flashrange.plan._segments``; BI_CAUSAL along keys is
    spread evenly, as there.
    """
    x0 = x0 - ms
    x1 = x1 - ms
    zero = tl.zeros_like(lmaj)
    if not IS_TRANSPOSED:
        lq = lmaj
        lk = lmin
        off = lk - lq
        r = tl.maximum(-off, 0)
        full = _segment_cells(x0, x1, zero, lq, lk, zero)
        causal = _segment_cells(x0, x1, r, tl.maximum(r, lq), r + off + 1, zero + 1)
        inv = _segment_cells(x0, x1, zero, tl.minimum(lq, lk), lk, zero - 1)
        bi = _segment_cells(x0, x1, zero, tl.where(off >= 0, lq, zero), off + 1, zero)
    else:
        lk = lmaj
        lq = lmin
        off = lk - lq
        full = _segment_cells(x0, x1, zero, lk, lq, zero)
        c_split = tl.minimum(tl.maximum(off + 1, 0), lk)
        causal = _segment_cells(x0, x1, zero, c_split, lq, zero) + _segment_cells(
            x0, x1, c_split, lk, lk - c_split, zero - 1
        )
        i_split = tl.minimum(lq, lk)
        inv = _segment_cells(x0, x1, zero, i_split, zero + 1, zero + 1) + _segment_cells(
            x0, x1, i_split, lk, lq, zero
        )
        bi = _segment_cells(
            x0, x1, zero, tl.where(off >= 0, lk, zero), (off + 1) * lq // tl.maximum(lk, 1), zero
        )
    return tl.where(mt == 0, full, tl.where(mt == 1, causal, tl.where(mt == 2, inv, bi)))


@triton.jit(do_not_specialize=["S", "T", "n_blocks"])
def _block_windows_kernel(
    slices_ptr, lo_ptr, hi_ptr, work_ptr, S, T, n_blocks,
    IS_TRANSPOSED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_T2: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    b0 = offs_b * BLOCK
    b1 = tl.minimum(b0 + BLOCK, T)
    hi = tl.zeros([BLOCK_B], dtype=tl.int32)
    lo = tl.zeros([BLOCK_B], dtype=tl.int32) + S
    # Windows first, in cheap int32 compares over every slice ...
    for t0 in range(0, S, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < S
        if IS_TRANSPOSED:
            ms = tl.load(slices_ptr + offs_t * 5 + 2, mask=mask_t, other=0)
            me = tl.load(slices_ptr + offs_t * 5 + 3, mask=mask_t, other=0)
        else:
            ms = tl.load(slices_ptr + offs_t * 5 + 0, mask=mask_t, other=0)
            me = tl.load(slices_ptr + offs_t * 5 + 1, mask=mask_t, other=0)
        mt = tl.load(slices_ptr + offs_t * 5 + 4, mask=mask_t, other=-1)
        valid = mask_t & (mt >= 0)
        starts_before = valid[None, :] & (ms[None, :] < b1[:, None])
        hi += tl.sum(starts_before.to(tl.int32), axis=1)
        ends_after = valid[None, :] & (me[None, :] > b0[:, None])
        lo = tl.minimum(lo, tl.min(tl.where(ends_after, offs_t[None, :], S), axis=1))
    # ... then the int64 cell counts only over the slices some block of this program
    # may meet: the union of the windows (the others contribute nothing).
    mask_b = offs_b < n_blocks
    t_lo = tl.min(tl.where(mask_b, lo, S), axis=0)
    t_hi = tl.max(tl.where(mask_b, hi, 0), axis=0)
    b0w = b0.to(tl.int64)
    b1w = b1.to(tl.int64)
    work = tl.zeros([BLOCK_B], dtype=tl.int64)
    for t0 in range(t_lo, t_hi, BLOCK_T2):
        offs_t = t0 + tl.arange(0, BLOCK_T2)
        mask_t = offs_t < t_hi
        qs = tl.load(slices_ptr + offs_t * 5 + 0, mask=mask_t, other=0).to(tl.int64)
        qe = tl.load(slices_ptr + offs_t * 5 + 1, mask=mask_t, other=0).to(tl.int64)
        ks = tl.load(slices_ptr + offs_t * 5 + 2, mask=mask_t, other=0).to(tl.int64)
        ke = tl.load(slices_ptr + offs_t * 5 + 3, mask=mask_t, other=0).to(tl.int64)
        mt = tl.load(slices_ptr + offs_t * 5 + 4, mask=mask_t, other=-1).to(tl.int64)
        valid = mask_t & (mt >= 0)
        if IS_TRANSPOSED:
            ms, me, ns, ne = ks, ke, qs, qe
        else:
            ms, me, ns, ne = qs, qe, ks, ke
        cells = _slice_cells_in(b0w[:, None], b1w[:, None], ms[None, :], (me - ms)[None, :], (ne - ns)[None, :],
                                mt[None, :], IS_TRANSPOSED)
        work += tl.sum(tl.where(valid[None, :], cells, 0), axis=1)
    tl.store(lo_ptr + offs_b, tl.minimum(lo, hi), mask=mask_b)
    tl.store(hi_ptr + offs_b, hi, mask=mask_b)
    tl.store(work_ptr + offs_b, work, mask=mask_b)


@triton.jit(do_not_specialize=["n_blocks"])
def _order_blocks_kernel(work_ptr, order_ptr, n_blocks, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    offs_b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < n_blocks
    w = tl.load(work_ptr + offs_b, mask=mask_b, other=0)
    rank = tl.zeros([BLOCK_B], dtype=tl.int32)
    for t0 in range(0, n_blocks, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < n_blocks
        wt = tl.load(work_ptr + offs_t, mask=mask_t, other=0)
        # Heaviest first; equal work keeps block order (a stable sort).
        before = (wt[None, :] > w[:, None]) | ((wt[None, :] == w[:, None]) & (offs_t[None, :] < offs_b[:, None]))
        rank += tl.sum((before & mask_t[None, :]).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, offs_b.to(tl.int32), mask=mask_b)


# Above this many slices the ranking step uses sorts (O(S log S)) instead of
# counting (O(S^2), 29 µs at 4096 slices on an H200).
RANK_BY_COUNTING_MAX = 8192


def build_block_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, block=PLAN_BLOCK, *, transpose=False):
    """Same contract and outputs as :func:`flashrange.plan.build_block_plan_torch`."""
    dev = q_ranges.device
    qr = q_ranges.reshape(-1, 2).contiguous()
    kr = k_ranges.reshape(-1, 2).contiguous()
    mt = mask_types.reshape(-1).contiguous()
    S = mt.shape[0]
    T = Tk if transpose else Tq
    n_blocks = -(-T // block)
    slices = torch.empty(S, 5, dtype=torch.int32, device=dev)
    lo = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    hi = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    work = torch.empty(n_blocks, dtype=torch.int64, device=dev)
    order = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    # Small program tiles and long inner tiles: each loop iteration waits on loads from
    # L2, so many resident programs and few iterations keep these launches short
    # (measured on an H200: 4096 slices over 128k tokens).
    BLOCK_S, BLOCK_T, BLOCK_B = 8, 512, 16
    if S > RANK_BY_COUNTING_MAX:
        # Counting is quadratic in S; past a few thousand slices (e.g. one slot
        # per token, mostly empty) two stable sorts are cheaper. Same order.
        slices = canonical_slices(qr, kr, mt, Tq, Tk, transpose=transpose).to(torch.int32).contiguous()
    elif S > 0:
        _rank_slices_kernel[(triton.cdiv(S, BLOCK_S),)](
            qr, kr, mt, slices, S, Tq, Tk, IS_TRANSPOSED=transpose, BLOCK_S=BLOCK_S, BLOCK_T=BLOCK_T
        )
    # Four blocks a program: enough programs to fill the GPU at long contexts; the int64
    # cell counts take narrower tiles (registers).
    if n_blocks == 0:
        return BlockPlan(slices, lo, hi, order)
    _block_windows_kernel[(triton.cdiv(n_blocks, 4),)](
        slices, lo, hi, work, S, T, n_blocks, IS_TRANSPOSED=transpose, BLOCK=block, BLOCK_B=4, BLOCK_T=512,
        BLOCK_T2=128,
    )
    _order_blocks_kernel[(triton.cdiv(n_blocks, BLOCK_B),)](work, order, n_blocks, BLOCK_B=BLOCK_B, BLOCK_T=128)
    return BlockPlan(slices, lo, hi, order)


def build_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk):
    """:class:`~flashrange.plan.RangePlan` from the Triton launches; equal to the plain-PyTorch plan."""
    return RangePlan(
        *build_block_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk),
        *build_block_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, transpose=True),
    )


def build_block_plan(q_ranges, k_ranges, mask_types, Tq, Tk, block=PLAN_BLOCK, *, transpose=False, backend=None):
    """One axis of the plan (a :class:`~flashrange.plan.BlockPlan`) with blocks of ``block`` tokens.

    ``backend`` as in :func:`build_plan`. The kernels use ``block = PLAN_BLOCK``;
    other sizes serve tests and studies of the plan.
    """
    if backend is None:
        backend = "triton" if q_ranges.is_cuda else "torch"
    if backend == "triton":
        return build_block_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, block, transpose=transpose)
    if backend != "torch":
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    return build_block_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk, block, transpose=transpose)


def build_plan(q_ranges, k_ranges, mask_types, Tq, Tk, *, backend=None):
    """The plan of a mask over ``Tq x Tk`` tokens.

    ``backend``: ``"triton"`` (the default for CUDA tensors) or ``"torch"``
    (plain PyTorch ops, the default elsewhere); both give identical plans.
    """
    if backend is None:
        backend = "triton" if q_ranges.is_cuda else "torch"
    if backend == "triton":
        return build_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk)
    if backend != "torch":
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    return build_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk)
