"""The plan (:mod:`flashrange.plan`) in a few Triton launches, and the choice of builder.

The plain-PyTorch plan takes about a hundred small kernels (sorts, cumsums,
scatters); each costs a launch, which puts it far above the attention it feeds
for short sequences. Here both halves of the plan (query-major and key-major:
the second grid axis) come from three launches that trade sorting for
counting:

1. rank every slice by counting the slices whose canonical key is smaller
   (S x S comparisons, tiled), scatter it to its rank, and record the running
   maximum of the slice ends in canonical order (the same comparisons give it);
2. per block of the major axis, binary-search the window: ``block_hi`` is the
   number of slices that start before the block ends, ``block_lo`` the first
   slice whose running maximum end passes the block's start; then sum, in
   closed form, the cells the window's slices cover in the block (the work
   estimate);
3. rank the blocks by work, heaviest first.

Past :data:`RANK_BY_COUNTING_MAX` slices, step 1 is two stable sorts and a
running maximum in PyTorch instead (counting is quadratic). Steps 2 and 3
cost O(n_blocks * (log S + window)), so slots that hold empty slices (sorted
last) cost nothing but their share of step 1.

The outputs are identical to :func:`flashrange.plan.build_plan_torch`, which
the tests check. :func:`build_plan` picks the builder: these launches for CUDA
tensors, the plain-PyTorch one elsewhere.
"""

import torch
import triton
import triton.language as tl

from ..constants import PLAN_BLOCK
from ..plan import RangePlan, build_block_plan_torch, build_plan_torch, canonical_slices
from .common import launch

__all__ = ["build_plan", "build_block_plan", "build_plan_triton", "build_block_plan_triton", "RANK_BY_COUNTING_MAX"]

# Above this many slices the ranking step sorts (O(S log S)) instead of counting (O(S^2)).
RANK_BY_COUNTING_MAX = 8192


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
    # A BI_CAUSAL band with Lq > Lk covers no cell (flashrange.plan.canonical_slices).
    empty_band = (mt == 3) & (qe - qs > ke - ks)
    valid = mask_s & (qe > qs) & (ke > ks) & (mt >= 0) & (mt <= 3) & ~empty_band
    return qs, qe, ks, ke, mt, valid


@triton.jit
def _canonical_keys(qs, qe, ks, ke, mt, valid, IS_TRANSPOSED: tl.constexpr):
    if IS_TRANSPOSED:
        ms, me, ns, ne = ks, ke, qs, qe
    else:
        ms, me, ns, ne = qs, qe, ks, ke
    k1 = tl.where(valid, (ms << 32) | ns, 1 << 62)
    k2 = (me << 32) | (ne << 2) | tl.minimum(tl.maximum(mt, 0), 3)
    return k1, k2, tl.where(valid, me, 0)


@triton.jit
def _rank_axis(
    qr_ptr, kr_ptr, mt_ptr, out_ptr, run_end_ptr, pid, S, Tq, Tk,
    IS_TRANSPOSED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_s = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    qs, qe, ks, ke, mt, valid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs_s, mask_s, Tq, Tk)
    k1, k2, end = _canonical_keys(qs, qe, ks, ke, mt, valid, IS_TRANSPOSED)
    rank = tl.zeros([BLOCK_S], dtype=tl.int32)
    run_end = end
    for t0 in range(0, S, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < S
        tqs, tqe, tks, tke, tmt, tvalid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs_t, mask_t, Tq, Tk)
        t1, t2, tend = _canonical_keys(tqs, tqe, tks, tke, tmt, tvalid, IS_TRANSPOSED)
        # Lexicographic (k1, k2, index): the index makes ranks a permutation;
        # slices equal in (k1, k2) are identical, so their order changes no bit.
        before = (t1[None, :] < k1[:, None]) | (
            (t1[None, :] == k1[:, None])
            & ((t2[None, :] < k2[:, None]) | ((t2[None, :] == k2[:, None]) & (offs_t[None, :] < offs_s[:, None])))
        )
        before = before & mask_t[None, :]
        rank += tl.sum(before.to(tl.int32), axis=1)
        # The running maximum of the ends in canonical order, at this slice's rank.
        run_end = tl.maximum(run_end, tl.max(tl.where(before, tend[None, :], 0), axis=1))
    mt_out = tl.where(valid, mt, -1)
    if IS_TRANSPOSED:
        ms, me = ks, ke
    else:
        ms, me = qs, qe
    tl.store(out_ptr + rank * 5 + 0, qs.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 1, qe.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 2, ks.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 3, ke.to(tl.int32), mask=mask_s)
    tl.store(out_ptr + rank * 5 + 4, mt_out.to(tl.int32), mask=mask_s)
    tl.store(run_end_ptr + rank, run_end.to(tl.int32), mask=mask_s)


# Slice counts and lengths change between calls; specializing on their values
# (== 1, divisible by 16) would only multiply the kernels built.
@triton.jit(do_not_specialize=["S", "Tq", "Tk"])
def _rank_slices_kernel(
    qr_ptr, kr_ptr, mt_ptr, q_out_ptr, k_out_ptr, q_run_end_ptr, k_run_end_ptr, S, Tq, Tk,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grid ``(cdiv(S, BLOCK_S), 2)``: axis 1 picks the query-major (0) or key-major (1) half."""
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _rank_axis(qr_ptr, kr_ptr, mt_ptr, q_out_ptr, q_run_end_ptr, pid, S, Tq, Tk, False, BLOCK_S, BLOCK_T)
    else:
        _rank_axis(qr_ptr, kr_ptr, mt_ptr, k_out_ptr, k_run_end_ptr, pid, S, Tq, Tk, True, BLOCK_S, BLOCK_T)


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


@triton.jit
def _search(arr_ptr, target, n, n_iter, RIGHT: tl.constexpr, BLOCK_B: tl.constexpr):
    """Per lane, the first index of sorted ``arr[:n]`` whose value is ``> target`` (``RIGHT``) or ``>= target``."""
    left = tl.zeros([BLOCK_B], dtype=tl.int32)
    right = tl.zeros([BLOCK_B], dtype=tl.int32) + n
    for _ in range(0, n_iter):
        open_ = left < right
        mid = (left + right) // 2
        val = tl.load(arr_ptr + mid, mask=open_, other=0)
        if RIGHT:
            go = val <= target
        else:
            go = val < target
        left = tl.where(open_ & go, mid + 1, left)
        right = tl.where(open_ & ~go, mid, right)
    return left


@triton.jit
def _windows_axis(
    slices_ptr, run_end_ptr, lo_ptr, hi_ptr, work_ptr, pid, S, T, n_blocks, n_iter,
    IS_TRANSPOSED: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    offs_b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < n_blocks
    b0 = offs_b * BLOCK
    b1 = tl.minimum(b0 + BLOCK, T)
    if IS_TRANSPOSED:
        start_col = 2
    else:
        start_col = 0
    # Valid slices come first, sorted by start; invalid ones (type -1) last: the
    # window ends at the first slice that starts at or after b1, or is invalid.
    left = tl.zeros([BLOCK_B], dtype=tl.int32)
    right = tl.zeros([BLOCK_B], dtype=tl.int32) + S
    for _ in range(0, n_iter):
        open_ = left < right
        mid = (left + right) // 2
        st = tl.load(slices_ptr + mid * 5 + start_col, mask=open_, other=0)
        ty = tl.load(slices_ptr + mid * 5 + 4, mask=open_, other=-1)
        go = (ty >= 0) & (st < b1)
        left = tl.where(open_ & go, mid + 1, left)
        right = tl.where(open_ & ~go, mid, right)
    hi = left
    # Slices before the first whose running maximum end passes b0 end before the block.
    lo = tl.minimum(_search(run_end_ptr, b0, S, n_iter, True, BLOCK_B), hi)
    # The cell counts only over the union of this program's windows (the others add nothing).
    t_lo = tl.min(tl.where(mask_b, lo, S), axis=0)
    t_hi = tl.max(tl.where(mask_b, hi, 0), axis=0)
    b0w = b0.to(tl.int64)
    b1w = b1.to(tl.int64)
    work = tl.zeros([BLOCK_B], dtype=tl.int64)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
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
    tl.store(lo_ptr + offs_b, lo, mask=mask_b)
    tl.store(hi_ptr + offs_b, hi, mask=mask_b)
    tl.store(work_ptr + offs_b, work, mask=mask_b)


@triton.jit(do_not_specialize=["S", "Tq", "Tk", "nq", "nk", "n_iter"])
def _block_windows_kernel(
    q_slices_ptr, k_slices_ptr, q_run_end_ptr, k_run_end_ptr,
    q_lo_ptr, q_hi_ptr, q_work_ptr, k_lo_ptr, k_hi_ptr, k_work_ptr,
    S, Tq, Tk, nq, nk, n_iter,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Grid ``(cdiv(max(nq, nk), BLOCK_B), 2)``: axis 1 picks the half, as in :func:`_rank_slices_kernel`."""
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _windows_axis(q_slices_ptr, q_run_end_ptr, q_lo_ptr, q_hi_ptr, q_work_ptr, pid, S, Tq, nq, n_iter,
                      False, BLOCK, BLOCK_B, BLOCK_T)
    else:
        _windows_axis(k_slices_ptr, k_run_end_ptr, k_lo_ptr, k_hi_ptr, k_work_ptr, pid, S, Tk, nk, n_iter,
                      True, BLOCK, BLOCK_B, BLOCK_T)


@triton.jit
def _order_axis(work_ptr, order_ptr, pid, n_blocks, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
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


@triton.jit(do_not_specialize=["nq", "nk"])
def _order_blocks_kernel(q_work_ptr, k_work_ptr, q_order_ptr, k_order_ptr, nq, nk,
                         BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _order_axis(q_work_ptr, q_order_ptr, pid, nq, BLOCK_B, BLOCK_T)
    else:
        _order_axis(k_work_ptr, k_order_ptr, pid, nk, BLOCK_B, BLOCK_T)


def _running_max(x, width=1024):
    """``torch.cummax(x, 0).values`` of a 1-D tensor, as a scan of rows then of row maxima.

    A 1-D scan is one row for PyTorch's CUDA scan kernels, i.e. one thread
    block for the whole tensor; cutting it into rows keeps every step parallel.
    """
    n = x.shape[0]
    if n <= width:
        return torch.cummax(x, dim=0).values if n else x
    rows = -(-n // width)
    padded = torch.full((rows * width,), torch.iinfo(x.dtype).min, dtype=x.dtype, device=x.device)
    padded[:n] = x
    within = torch.cummax(padded.view(rows, width), dim=1).values
    before = torch.cummax(within[:, -1], dim=0).values
    carry = torch.cat([before.new_full((1,), torch.iinfo(x.dtype).min), before[:-1]])
    return torch.maximum(within, carry[:, None]).view(-1)[:n]


def _sorted_halves(qr, kr, mt, Tq, Tk):
    """Step 1 by sorting: both halves' slices and running maximum ends (many slices)."""
    out = []
    for transpose in (False, True):
        sl = canonical_slices(qr, kr, mt, Tq, Tk, transpose=transpose)
        end = torch.where(sl[:, 4] >= 0, sl[:, 3] if transpose else sl[:, 1], torch.zeros_like(sl[:, 1]))
        out += [sl.to(torch.int32).contiguous(), _running_max(end).to(torch.int32).contiguous()]
    return out


def build_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, block=PLAN_BLOCK):
    """:class:`~flashrange.plan.RangePlan` from the Triton launches; equal to the plain-PyTorch plan."""
    dev = q_ranges.device
    qr = q_ranges.reshape(-1, 2).contiguous()
    kr = k_ranges.reshape(-1, 2).contiguous()
    mt = mask_types.reshape(-1).contiguous()
    S = mt.shape[0]
    nq, nk = -(-Tq // block), -(-Tk // block)
    i32 = torch.int32
    if S > RANK_BY_COUNTING_MAX:
        q_slices, q_run_end, k_slices, k_run_end = _sorted_halves(qr, kr, mt, Tq, Tk)
    else:
        q_slices = torch.empty(S, 5, dtype=i32, device=dev)
        k_slices = torch.empty(S, 5, dtype=i32, device=dev)
        q_run_end = torch.empty(S, dtype=i32, device=dev)
        k_run_end = torch.empty(S, dtype=i32, device=dev)
        if S > 0:
            # Small program tiles and long inner tiles: each loop iteration waits on
            # loads from L2, so many resident programs and few iterations keep it short.
            BLOCK_S, BLOCK_T = 8, 512
            launch(_rank_slices_kernel, (triton.cdiv(S, BLOCK_S), 2),
                   (qr, kr, mt, q_slices, k_slices, q_run_end, k_run_end, S, Tq, Tk, BLOCK_S, BLOCK_T))
    q_lo, q_hi, q_order = (torch.empty(nq, dtype=i32, device=dev) for _ in range(3))
    k_lo, k_hi, k_order = (torch.empty(nk, dtype=i32, device=dev) for _ in range(3))
    n_max = max(nq, nk)
    if n_max > 0:
        q_work = torch.empty(nq, dtype=torch.int64, device=dev)
        k_work = torch.empty(nk, dtype=torch.int64, device=dev)
        BLOCK_B = 4
        launch(_block_windows_kernel, (triton.cdiv(n_max, BLOCK_B), 2),
               (q_slices, k_slices, q_run_end, k_run_end, q_lo, q_hi, q_work, k_lo, k_hi, k_work,
                S, Tq, Tk, nq, nk, max(1, S.bit_length()), block, BLOCK_B, 128))
        launch(_order_blocks_kernel, (triton.cdiv(n_max, 16), 2),
               (q_work, k_work, q_order, k_order, nq, nk, 16, 128))
    return RangePlan(q_slices, q_lo, q_hi, q_order, k_slices, k_lo, k_hi, k_order)


def build_block_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, block=PLAN_BLOCK, *, transpose=False):
    """One half of :func:`build_plan_triton` with blocks of ``block`` tokens (tests and studies)."""
    plan = build_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, block)
    return plan.keys if transpose else plan.queries


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
