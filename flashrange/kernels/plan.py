"""The plan (:mod:`flashrange.plan`) in Triton launches, and the choice of builder.

The plain-PyTorch plan takes about a hundred small kernels (sorts, cumsums,
scatters); each costs a launch, which puts it far above the attention it feeds
for short sequences. Here both halves of the plan (query-major and key-major)
come from a few launches whose cost is linear in slots wherever the slices
arrive in canonical order once the never-visited ones are set aside (document
masks, padding), and ``O(S log^2 S)`` otherwise. The pieces:

- *Canonical order as a stable sort.* Every slot gets the key
  ``(K1, K2)`` of :func:`flashrange.plan.canonical_slices` (``K1`` is a large
  constant for slots that are never visited); the plan's order is the stable
  sort of the slots by that key. Valid slices are partitioned ahead of the
  others (a stable compaction, from per-chunk counts), so padding and garbage
  cost one pass, and the partitioned sequence is checked for being already
  sorted (adjacent pairs, a flag set by any pair out of order).
- *Merging runs.* Each chunk of slots is ranked by counting only when its
  partitioned runs are out of order; runs are then merged, ``_BLOCK_F`` at a
  time, by binary searches (an element's place in the merged run is its place
  in its own run plus, per sibling run, the elements that precede it; earlier
  runs win ties, so the merge is stable). A level is one launch; every
  program exits at once when the flag says the sequence was sorted already.
- *Finishing.* The last level writes each slice at its place and accumulates,
  with integer atomics (order-free, hence deterministic), what the block step
  needs: per block, the valid slices starting in it and the first slice (in
  plan order) ending in it, and the work estimate as per-block point values
  plus constant and linear difference terms (a slice's linear pieces cover
  the whole blocks between their two end blocks with a work linear in the
  block index).
- *Blocks.* One program per half scans the blocks once: ``block_hi`` is a
  prefix sum of the start counts (valid slices come first, sorted by start),
  the work a prefix sum of the difference terms, and ``block_lo`` a suffix
  minimum of the first slices ending after the block's start (the first slice
  whose running maximum end passes it), capped by ``block_hi``; then each
  block's group work (the most work among the blocks of its ``block_lo``, a
  contiguous run) from a segmented running maximum down and one up. Each
  block's place in ``block_order`` is the count of blocks that precede it in
  (group work descending, ``block_lo``, work descending, index) order.

Launches: a count of each chunk's valid slots (which also initializes the
accumulators), the partition, one per merge level, the block scan and the
block order. With at most :data:`SMALL_PLAN_SLICES` slots one program per half
ranks every slot by counting and finishes instead (one launch), and with at
most :data:`SMALL_PLAN_BLOCKS` blocks per axis it also does the block steps,
with barriers in between: one launch for the whole plan. All scratch space is
one int32 workspace; the counting, scans and ordering are quadratic only in
the small cases and in the block count.

The outputs are identical to :func:`flashrange.plan.build_plan_torch`, which
the tests check. :func:`build_plan` picks the builder: these launches for CUDA
tensors, the plain-PyTorch one elsewhere.
"""

import torch
import triton
import triton.language as tl

from ..constants import PLAN_BLOCK
from ..plan import RangePlan, build_block_plan_torch, build_plan_torch
from .common import interpreting, launch

__all__ = [
    "build_plan",
    "build_block_plan",
    "build_plan_triton",
    "build_block_plan_triton",
    "SMALL_PLAN_SLICES",
    "SMALL_PLAN_BLOCKS",
]

# Up to SMALL_PLAN_SLICES slots one program per half ranks them by counting
# (O(S^2), serial in that program); up to SMALL_PLAN_BLOCKS blocks per axis it
# also orders the blocks (O(n_blocks^2)), else one block launch follows. Past
# these sizes the serial work costs more than the launches it saves.
SMALL_PLAN_SLICES = 128
SMALL_PLAN_BLOCKS = 32

# Slots per chunk: the unit of compaction and of the first (counting) sort.
_BLOCK_C = 128
# Runs merged per level: few levels (launches) for any realistic slot count.
_BLOCK_F = 64
# A "never visited" key and an "unset" block entry.
_INVALID_KEY = tl.constexpr(1 << 62)
_NO_SLICE = tl.constexpr(2**31 - 1)


def _tiles(S):
    """``(positions per merge program, rows merged at once, columns of the in-chunk count)``.

    On a GPU: rows of 16 (each searches ``_BLOCK_F`` runs at once: registers),
    a program of 16 positions while programs are few, of 128 past that (the
    sorted case finishes them in one go; fewer programs to launch). On the
    interpreter: large tiles, as each program and op costs Python while numpy
    does the lanes.
    """
    if interpreting():
        return 512, 512, 128
    return (16 if S <= 16384 else 128), 16, 32



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
    """The sort key ``(K1, K2)`` of ``canonical_slices``: the plan's order is the stable sort by it."""
    if IS_TRANSPOSED:
        ms, me, ns, ne = ks, ke, qs, qe
    else:
        ms, me, ns, ne = qs, qe, ks, ke
    k1 = tl.where(valid, (ms << 32) | ns, _INVALID_KEY)
    k2 = (me << 32) | (ne << 2) | tl.minimum(tl.maximum(mt, 0), 3)
    return k1, k2


@triton.jit
def _count_rank(qr_ptr, kr_ptr, mt_ptr, offs, k1, k2, t_begin, t_end, Tq, Tk,
                IS_TRANSPOSED: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per lane, the slots of ``[t_begin, t_end)`` that precede it in (K1, K2, slot) order."""
    rank = tl.zeros_like(offs)
    for t0 in range(t_begin, t_end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < t_end
        tqs, tqe, tks, tke, tmt, tvalid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs_t, mask_t, Tq, Tk)
        t1, t2 = _canonical_keys(tqs, tqe, tks, tke, tmt, tvalid, IS_TRANSPOSED)
        before = (t1[None, :] < k1[:, None]) | (
            (t1[None, :] == k1[:, None])
            & ((t2[None, :] < k2[:, None]) | ((t2[None, :] == k2[:, None]) & (offs_t[None, :] < offs[:, None])))
        )
        rank += tl.sum((before & mask_t[None, :]).to(tl.int32), axis=1)
    return rank


@triton.jit
def _slice_segments(lmaj, lmin, mt, IS_TRANSPOSED: tl.constexpr):
    """A slice's covered cells per major position as two linear pieces ``(a, b, v, slope)``.

    Position ``x`` in ``[a, b)`` (slice-local) covers ``v + slope * (x - a)``
    cells: the pieces of ``flashrange.plan._segments``, BI_CAUSAL along keys
    spread evenly as there.
    """
    zero = tl.zeros_like(lmaj)
    if not IS_TRANSPOSED:
        lq = lmaj
        lk = lmin
        off = lk - lq
        r = tl.maximum(-off, 0)
        a0 = tl.where(mt == 1, r, zero)
        b0 = tl.where(mt == 0, lq, tl.where(mt == 1, tl.maximum(r, lq),
                      tl.where(mt == 2, tl.minimum(lq, lk), tl.where(off >= 0, lq, zero))))
        v0 = tl.where(mt == 0, lk, tl.where(mt == 1, r + off + 1, tl.where(mt == 2, lk, off + 1)))
        s0 = tl.where(mt == 1, zero + 1, tl.where(mt == 2, zero - 1, zero))
        a1 = zero
        b1 = zero
        v1 = zero
        s1 = zero
    else:
        lk = lmaj
        lq = lmin
        off = lk - lq
        c_split = tl.minimum(tl.maximum(off + 1, 0), lk)
        i_split = tl.minimum(lq, lk)
        a0 = zero
        b0 = tl.where(mt == 0, lk, tl.where(mt == 1, c_split, tl.where(mt == 2, i_split, tl.where(off >= 0, lk, zero))))
        v0 = tl.where(mt <= 1, lq, tl.where(mt == 2, zero + 1, (off + 1) * lq // tl.maximum(lk, 1)))
        s0 = tl.where(mt == 2, zero + 1, zero)
        a1 = tl.where(mt == 1, c_split, tl.where(mt == 2, i_split, zero))
        b1 = tl.where((mt == 1) | (mt == 2), lk, zero)
        v1 = tl.where(mt == 1, lk - c_split, tl.where(mt == 2, lq, zero))
        s1 = tl.where(mt == 1, zero - 1, zero)
    return a0, b0, v0, s0, a1, b1, v1, s1


@triton.jit
def _segment_cells(x0, x1, a, b, v, slope):
    """Cells in positions ``[x0, x1)`` of the linear piece ``v + slope * (x - a)`` on ``[a, b)``."""
    lo = tl.maximum(x0, a)
    hi = tl.minimum(x1, b)
    n = tl.maximum(hi - lo, 0)
    return n * (v + slope * (lo - a)) + slope * (n * (n - 1) // 2)


@triton.jit
def _add_segment(point_ptr, dc_ptr, dl_ptr, x0, x1, v, slope, active, BLOCK: tl.constexpr):
    """Add a piece on global positions ``[x0, x1)`` to the per-block work terms.

    The blocks holding its two ends get their cells directly (``point``); each
    whole block ``k`` in between gets ``alpha + beta * k``, added as a range
    through difference arrays of the constant (``dc``) and linear (``dl``) terms.
    """
    k0 = x0 // BLOCK
    k1 = (x1 - 1) // BLOCK
    one = k0 == k1
    # Integer sums: the result does not depend on the order of the atomics, and
    # nothing reads them before a barrier or the next launch (relaxed: no fences).
    tl.atomic_add(point_ptr + k0, _segment_cells(x0, tl.where(one, x1, (k0 + 1) * BLOCK), x0, x1, v, slope),
                  mask=active, sem="relaxed")
    tl.atomic_add(point_ptr + k1, _segment_cells(k1 * BLOCK, x1, x0, x1, v, slope), mask=active & ~one,
                  sem="relaxed")
    between = active & (k1 > k0 + 1)
    alpha = BLOCK * v + slope * (BLOCK * (BLOCK - 1) // 2) - slope * BLOCK * x0
    beta = slope * (BLOCK * BLOCK)
    tl.atomic_add(dc_ptr + k0 + 1, alpha, mask=between, sem="relaxed")
    tl.atomic_add(dc_ptr + k1, -alpha, mask=between, sem="relaxed")
    tl.atomic_add(dl_ptr + k0 + 1, beta, mask=between & (slope != 0), sem="relaxed")
    tl.atomic_add(dl_ptr + k1, -beta, mask=between & (slope != 0), sem="relaxed")


@triton.jit
def _block_arrays(ws_ptr, nq, nk, IS_TRANSPOSED: tl.constexpr):
    """This half's per-block accumulators in the workspace (``n_blocks + 1`` entries each).

    ``first``: the first slice (in plan order) whose end block is this one;
    ``starts``: valid slices starting in this block; ``point``, ``dc``, ``dl``:
    the work terms. Layout (int32 words): int64 ``point, dc, dl`` of the query
    half, then of the key half; int32 ``first`` of both halves; int32
    ``starts`` of both halves.
    """
    ws64 = ws_ptr.to(tl.pointer_type(tl.int64))
    nq1 = nq.to(tl.int64) + 1
    nk1 = nk.to(tl.int64) + 1
    if IS_TRANSPOSED:
        point = ws64 + 3 * nq1
        n1 = nk1
        first = ws_ptr + 6 * (nq1 + nk1) + nq1
    else:
        point = ws64
        n1 = nq1
        first = ws_ptr + 6 * (nq1 + nk1)
    return first, first + (nq1 + nk1), point, point + n1, point + 2 * n1


@triton.jit
def _sort_arrays(ws_ptr, S, nc, nq, nk):
    """The sorting scratch after the block arrays (mirrors ``_workspace_words``).

    Keys: int64 ``[buffer][half][K1 | K2][S]``; slots: int32 ``[buffer][half][S]``;
    then per chunk: valid count, last valid slot, last invalid slot; then the
    run starts (``2 * nc + 1``) and the two "not sorted" flags.
    """
    S = S.to(tl.int64)
    nc = nc.to(tl.int64)
    blk = 8 * (nq.to(tl.int64) + nk + 2)
    keys = ws_ptr.to(tl.pointer_type(tl.int64)) + blk // 2
    slots = ws_ptr + blk + 16 * S
    counts = slots + 4 * S
    last_valid = counts + nc
    last_invalid = last_valid + nc
    run_start = last_invalid + nc
    flags = run_start + 2 * nc + 1
    return keys, slots, counts, last_valid, last_invalid, run_start, flags


def _workspace_words(S, nq, nk, sorting):
    blk = 8 * (nq + nk + 2)
    if not sorting:
        return blk
    nc = triton.cdiv(S, _BLOCK_C)
    return blk + 20 * S + 5 * nc + 3


@triton.jit
def _finish(qr_ptr, kr_ptr, mt_ptr, out_ptr, first_ptr, starts_ptr, point_ptr, dc_ptr, dl_ptr, pos, slot, mask,
            Tq, Tk,
            IS_TRANSPOSED: tl.constexpr, BLOCK: tl.constexpr):
    """Write slot ``slot``'s slice at its final place ``pos`` and add it to the block accumulators."""
    qs, qe, ks, ke, mt, valid = _load_slice(qr_ptr, kr_ptr, mt_ptr, slot, mask, Tq, Tk)
    tl.store(out_ptr + pos * 5 + 0, qs.to(tl.int32), mask=mask)
    tl.store(out_ptr + pos * 5 + 1, qe.to(tl.int32), mask=mask)
    tl.store(out_ptr + pos * 5 + 2, ks.to(tl.int32), mask=mask)
    tl.store(out_ptr + pos * 5 + 3, ke.to(tl.int32), mask=mask)
    tl.store(out_ptr + pos * 5 + 4, tl.where(valid, mt, -1).to(tl.int32), mask=mask)
    if IS_TRANSPOSED:
        ms, me, ns, ne = ks, ke, qs, qe
    else:
        ms, me, ns, ne = qs, qe, ks, ke
    # Block b's window starts at the first slice ending after b * BLOCK: the first
    # slice whose end block cdiv(me, BLOCK) is past b (a suffix minimum, later).
    tl.atomic_min(first_ptr + (me + BLOCK - 1) // BLOCK, pos.to(tl.int32), mask=valid, sem="relaxed")
    # block_hi[b] counts the valid slices starting before b's end: a prefix sum, later.
    tl.atomic_add(starts_ptr + ms // BLOCK, 1, mask=valid, sem="relaxed")
    a0, b0, v0, s0, a1, b1, v1, s1 = _slice_segments(me - ms, ne - ns, mt, IS_TRANSPOSED)
    _add_segment(point_ptr, dc_ptr, dl_ptr, ms + a0, ms + b0, v0, s0, valid & (b0 > a0), BLOCK)
    _add_segment(point_ptr, dc_ptr, dl_ptr, ms + a1, ms + b1, v1, s1, valid & (b1 > a1), BLOCK)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _group_max_combine(lo_a, w_a, lo_b, w_b):
    # A maximum that restarts where block_lo changes. Associative because block_lo is monotone along
    # the scan: equal values form one contiguous run.
    return lo_b, tl.where(lo_a == lo_b, tl.maximum(w_a, w_b), w_b)


@triton.jit
def _group_max_tile(lo, w, mask, carry_lo, carry_w, IS_REVERSED: tl.constexpr):
    """Running group maximum over one tile of the scan, continued from the previous tile's carry."""
    lo = tl.where(mask, lo, -1)
    _, run = tl.associative_scan((lo, w), 0, _group_max_combine)
    run = tl.where(lo == carry_lo, tl.maximum(run, carry_w), run)
    # The tile's last valid lane carries on: the largest block_lo ascending, the smallest descending.
    if IS_REVERSED:
        last_lo = tl.min(tl.where(mask, lo, _NO_SLICE), axis=0)
    else:
        last_lo = tl.max(lo, axis=0)
    last_w = tl.max(tl.where(mask & (lo == last_lo), run, -1), axis=0)
    return run, last_lo, last_w


@triton.jit
def _scan_blocks(first_ptr, starts_ptr, point_ptr, dc_ptr, dl_ptr, lo_ptr, hi_ptr, n_blocks, BLOCK_N: tl.constexpr):
    """One program: ``block_hi``, ``block_lo``, the work (written over ``point``) and the group work
    (written over ``dc``) of every block.

    ``block_hi[b]``: valid slices starting in blocks ``<= b`` (valid slices come
    first, sorted by start). Work: ``point + prefix(dc) + b * prefix(dl)``.
    ``block_lo[b]``: the first slice of the end blocks after ``b`` (``first``
    has ``n_blocks + 1`` entries), a suffix minimum, capped by ``block_hi``.
    Group work: the largest work among the blocks of equal ``block_lo`` (a
    contiguous run), from a running maximum down and one up.
    The accumulators were written by atomics, so they are read past L1 (``.cg``).
    """
    carry_h = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int32), axis=0)
    carry_c = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int64), axis=0)
    carry_l = carry_c
    for t0 in range(0, n_blocks, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        mask = offs < n_blocks
        cnt = tl.load(starts_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        dc = tl.load(dc_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        dl = tl.load(dl_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        pt = tl.load(point_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        tl.store(hi_ptr + offs, tl.cumsum(cnt, axis=0) + carry_h, mask=mask)
        # In place: each lane stores where it loaded.
        work = pt + tl.cumsum(dc, axis=0) + carry_c + offs.to(tl.int64) * (tl.cumsum(dl, axis=0) + carry_l)
        tl.store(point_ptr + offs, work, mask=mask)
        carry_h += tl.sum(cnt, axis=0)
        carry_c += tl.sum(dc, axis=0)
        carry_l += tl.sum(dl, axis=0)
    tl.debug_barrier()
    # Blocks from the last one down: a running minimum of first[b + 1], and the group maximum of the
    # blocks after b (kept in dc, free once the work is summed).
    carry_m = tl.sum(tl.zeros([BLOCK_N], dtype=tl.int32), axis=0) + _NO_SLICE
    carry_lo = carry_m * 0 - 2
    carry_w = carry_c * 0 - 1
    for t0 in range(0, n_blocks, BLOCK_N):
        offs_b = n_blocks - 1 - (t0 + tl.arange(0, BLOCK_N))
        mask_b = offs_b >= 0
        nxt = tl.load(first_ptr + offs_b + 1, mask=mask_b, other=_NO_SLICE, cache_modifier=".cg")
        lo = tl.minimum(tl.associative_scan(nxt, 0, _min_combine), carry_m)
        carry_m = tl.minimum(carry_m, tl.min(nxt, axis=0))
        hi = tl.load(hi_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")
        lo = tl.minimum(lo, hi)
        tl.store(lo_ptr + offs_b, lo, mask=mask_b)
        work = tl.load(point_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")
        run, carry_lo, carry_w = _group_max_tile(lo, work, mask_b, carry_lo, carry_w, True)
        tl.store(dc_ptr + offs_b, run, mask=mask_b)
    tl.debug_barrier()
    # And up: the group maximum of the blocks before b; with the one after, the whole group's.
    carry_lo = carry_m * 0 - 2
    carry_w = carry_c * 0 - 1
    for t0 in range(0, n_blocks, BLOCK_N):
        offs_b = t0 + tl.arange(0, BLOCK_N)
        mask_b = offs_b < n_blocks
        lo = tl.load(lo_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")
        work = tl.load(point_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")
        after = tl.load(dc_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")
        run, carry_lo, carry_w = _group_max_tile(lo, work, mask_b, carry_lo, carry_w, False)
        tl.store(dc_ptr + offs_b, tl.maximum(run, after), mask=mask_b)


@triton.jit
def _order_tile(work_ptr, group_ptr, lo_ptr, order_ptr, pid, n_blocks, BLOCK_B: tl.constexpr,
                BLOCK_T: tl.constexpr):
    """Places in ``block_order`` of blocks ``[pid * BLOCK_B, (pid + 1) * BLOCK_B)``: by counting the
    blocks before each in (group work descending, ``block_lo``, work descending, block) order."""
    offs_b = pid * BLOCK_B + tl.arange(0, BLOCK_B)
    mask_b = offs_b < n_blocks
    w = tl.load(work_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")[:, None]
    g = tl.load(group_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")[:, None]
    lo = tl.load(lo_ptr + offs_b, mask=mask_b, other=0, cache_modifier=".cg")[:, None]
    rank = tl.zeros([BLOCK_B], dtype=tl.int32)
    for t0 in range(0, n_blocks, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < n_blocks
        wt = tl.load(work_ptr + offs_t, mask=mask_t, other=0, cache_modifier=".cg")[None, :]
        gt = tl.load(group_ptr + offs_t, mask=mask_t, other=0, cache_modifier=".cg")[None, :]
        lot = tl.load(lo_ptr + offs_t, mask=mask_t, other=0, cache_modifier=".cg")[None, :]
        same_group = (gt == g) & (lot == lo)
        before = (gt > g) | ((gt == g) & (lot < lo)) | (same_group & (wt > w))
        before = before | (same_group & (wt == w) & (offs_t[None, :] < offs_b[:, None]))
        rank += tl.sum((before & mask_t[None, :]).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, offs_b, mask=mask_b)


# --- the single-launch plan (small masks) ---------------------------------------------------------


@triton.jit
def _small_half(qr_ptr, kr_ptr, mt_ptr, out_ptr, lo_ptr, hi_ptr, order_ptr, ws_ptr, S, Tq, Tk, nq, nk,
                IS_TRANSPOSED: tl.constexpr, HAS_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    first, starts, point, dc, dl = _block_arrays(ws_ptr, nq, nk, IS_TRANSPOSED)
    if IS_TRANSPOSED:
        n_blocks = nk
    else:
        n_blocks = nq
    for t0 in range(0, n_blocks + 1, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        mask_t = offs_t <= n_blocks
        tl.store(first + offs_t, tl.zeros([BLOCK_N], dtype=tl.int32) + _NO_SLICE, mask=mask_t)
        tl.store(starts + offs_t, tl.zeros([BLOCK_N], dtype=tl.int32), mask=mask_t)
        zero = tl.zeros([BLOCK_N], dtype=tl.int64)
        tl.store(point + offs_t, zero, mask=mask_t)
        tl.store(dc + offs_t, zero, mask=mask_t)
        tl.store(dl + offs_t, zero, mask=mask_t)
    # One program: a barrier orders its global writes (and atomics) before its later reads.
    tl.debug_barrier()
    for s0 in range(0, S, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        qs, qe, ks, ke, mt, valid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs_s, mask_s, Tq, Tk)
        k1, k2 = _canonical_keys(qs, qe, ks, ke, mt, valid, IS_TRANSPOSED)
        rank = _count_rank(qr_ptr, kr_ptr, mt_ptr, offs_s, k1, k2, 0, S, Tq, Tk, IS_TRANSPOSED, BLOCK_T)
        _finish(qr_ptr, kr_ptr, mt_ptr, out_ptr, first, starts, point, dc, dl, rank, offs_s, mask_s, Tq, Tk,
                IS_TRANSPOSED, BLOCK)
    if HAS_BLOCKS:
        tl.debug_barrier()
        _scan_blocks(first, starts, point, dc, dl, lo_ptr, hi_ptr, n_blocks, BLOCK_N)
        tl.debug_barrier()
        for b0 in range(0, n_blocks, BLOCK_B):
            _order_tile(point, dc, lo_ptr, order_ptr, b0 // BLOCK_B, n_blocks, BLOCK_B, BLOCK_N)


# Slice counts and lengths change between calls; specializing on their values
# (== 1, divisible by 16) would only multiply the kernels built.
@triton.jit(do_not_specialize=["S", "Tq", "Tk", "nq", "nk"])
def _plan_small_kernel(
    qr_ptr, kr_ptr, mt_ptr, q_out_ptr, q_lo_ptr, q_hi_ptr, q_order_ptr, k_out_ptr, k_lo_ptr, k_hi_ptr, k_order_ptr,
    ws_ptr, S, Tq, Tk, nq, nk,
    HAS_BLOCKS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Grid ``(2,)``: program 0 plans the query-major half, program 1 the key-major half
    (without ``HAS_BLOCKS``, up to the block accumulators: the block launches follow)."""
    if tl.program_id(0) == 0:
        _small_half(qr_ptr, kr_ptr, mt_ptr, q_out_ptr, q_lo_ptr, q_hi_ptr, q_order_ptr, ws_ptr, S, Tq, Tk, nq, nk,
                    False, HAS_BLOCKS, BLOCK, BLOCK_S, BLOCK_T, BLOCK_B, BLOCK_N)
    else:
        _small_half(qr_ptr, kr_ptr, mt_ptr, k_out_ptr, k_lo_ptr, k_hi_ptr, k_order_ptr, ws_ptr, S, Tq, Tk, nq, nk,
                    True, HAS_BLOCKS, BLOCK, BLOCK_S, BLOCK_T, BLOCK_B, BLOCK_N)


# --- the general plan ----------------------------------------------------------------------------


@triton.jit(do_not_specialize=["S", "Tq", "Tk", "nc", "nq", "nk"])
def _count_kernel(qr_ptr, kr_ptr, mt_ptr, ws_ptr, S, Tq, Tk, nc, nq, nk,
                  BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr):
    """Grid ``(max(nc, init tiles),)``: per chunk, its valid slots and the last slot of each class;
    per tile, the block accumulators' initial values."""
    pid = tl.program_id(0)
    keys, slots, counts, last_valid, last_invalid, run_start, flags = _sort_arrays(ws_ptr, S, nc, nq, nk)
    if pid < nc:
        offs = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = offs < S
        qs, qe, ks, ke, mt, valid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs, mask, Tq, Tk)
        tl.store(counts + pid, tl.sum(valid.to(tl.int32), axis=0))
        tl.store(last_valid + pid, tl.max(tl.where(valid, offs, -1), axis=0))
        tl.store(last_invalid + pid, tl.max(tl.where(mask & ~valid, offs, -1), axis=0))
    # Block accumulators (_block_arrays): work terms (the first 6 * n1 words) and
    # start counts (the last n1) at 0, first slices (in between) at "none".
    n1 = nq.to(tl.int64) + nk + 2
    offs_i = pid.to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    value = tl.where((offs_i >= 6 * n1) & (offs_i < 7 * n1), _NO_SLICE, 0).to(tl.int32)
    tl.store(ws_ptr + offs_i, value, mask=offs_i < 8 * n1)
    if pid == 0:
        tl.store(flags, 0)
        tl.store(flags + 1, 0)
        tl.store(run_start + 2 * nc, S)


@triton.jit
def _partition_half(qr_ptr, kr_ptr, mt_ptr, keys, slots, c, offs, mask, qs, qe, ks, ke, mt, valid,
                    pqs, pqe, pks, pke, pmt, pvalid, pos, cls_idx, has_prev, vpre, inv_start, n_valid, flags,
                    S, Tq, Tk, IS_TRANSPOSED: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    if IS_TRANSPOSED:
        half = 1
    else:
        half = 0
    k1_ptr = keys + half * 2 * S.to(tl.int64)
    k2_ptr = k1_ptr + S
    slot_ptr = slots + half * S.to(tl.int64)
    k1, k2 = _canonical_keys(qs, qe, ks, ke, mt, valid, IS_TRANSPOSED)
    tl.store(k1_ptr + pos, k1, mask=mask)
    tl.store(k2_ptr + pos, k2, mask=mask)
    tl.store(slot_ptr + pos, offs, mask=mask)
    tl.debug_barrier()
    # Sorted check of the partitioned sequence: each slot against its predecessor
    # of the same class, read back from this chunk's run or, for the first one of
    # its class here, recomputed from the last such slot of an earlier chunk.
    in_run = mask & (cls_idx > 0)
    p1, p2 = _canonical_keys(pqs, pqe, pks, pke, pmt, pvalid, IS_TRANSPOSED)
    p1 = tl.where(in_run, tl.load(k1_ptr + pos - 1, mask=in_run, other=0), p1)
    p2 = tl.where(in_run, tl.load(k2_ptr + pos - 1, mask=in_run, other=0), p2)
    bad = has_prev & ((p1 > k1) | ((p1 == k1) & (p2 > k2)))
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_max(flags + half, 1, sem="relaxed")
    if tl.sum((bad & in_run).to(tl.int32), axis=0) > 0:
        # Out of order inside the chunk: rank its slots by counting (valid ones first).
        c0 = c * BLOCK_C
        rank = _count_rank(qr_ptr, kr_ptr, mt_ptr, offs, k1, k2, c0, tl.minimum(c0 + BLOCK_C, S), Tq, Tk,
                           IS_TRANSPOSED, BLOCK_T)
        new_pos = tl.where(valid, vpre + rank, inv_start + rank - n_valid)
        tl.debug_barrier()
        tl.store(k1_ptr + new_pos, k1, mask=mask)
        tl.store(k2_ptr + new_pos, k2, mask=mask)
        tl.store(slot_ptr + new_pos, offs, mask=mask)


@triton.jit(do_not_specialize=["S", "Tq", "Tk", "nc", "nq", "nk"])
def _partition_kernel(qr_ptr, kr_ptr, mt_ptr, ws_ptr, S, Tq, Tk, nc, nq, nk,
                      BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid ``(nc,)``: a chunk's slots to their places in the partitioned sequence, both halves.

    Valid slots go to ``[0, V)`` and the others to ``[V, S)``, each class in
    slot order (a stable partition); each chunk leaves two runs, sorted here
    if they are not already, and sets a half's flag if its sequence is not
    sorted as a whole.
    """
    c = tl.program_id(0)
    keys, slots, counts, last_valid, last_invalid, run_start, flags = _sort_arrays(ws_ptr, S, nc, nq, nk)
    offs = c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < S
    qs, qe, ks, ke, mt, valid = _load_slice(qr_ptr, kr_ptr, mt_ptr, offs, mask, Tq, Tk)
    # Valid slots before this chunk and in all; the last slot of each class before it.
    n_before = tl.sum(tl.zeros([BLOCK_P], dtype=tl.int32), axis=0)
    n_all = n_before
    prev_valid = n_before - 1
    prev_invalid = n_before - 1
    for t0 in range(0, nc, BLOCK_P):
        offs_t = t0 + tl.arange(0, BLOCK_P)
        mask_t = offs_t < nc
        earlier = offs_t < c
        cnt = tl.load(counts + offs_t, mask=mask_t, other=0)
        n_all += tl.sum(cnt, axis=0)
        n_before += tl.sum(tl.where(earlier, cnt, 0), axis=0)
        prev_valid = tl.maximum(prev_valid, tl.max(tl.load(last_valid + offs_t, mask=earlier, other=-1), axis=0))
        prev_invalid = tl.maximum(prev_invalid, tl.max(tl.load(last_invalid + offs_t, mask=earlier, other=-1), axis=0))
    is_valid = valid.to(tl.int32)
    valid_idx = tl.cumsum(is_valid, axis=0) - is_valid
    invalid_idx = (offs - c * BLOCK_C) - valid_idx
    inv_start = n_all + c * BLOCK_C - n_before
    pos = tl.where(valid, n_before + valid_idx, inv_start + invalid_idx)
    cls_idx = tl.where(valid, valid_idx, invalid_idx)
    n_valid = tl.sum(is_valid, axis=0)
    tl.store(run_start + c, n_before)
    tl.store(run_start + nc + c, inv_start)
    prev_slot = tl.where(valid, prev_valid, prev_invalid)
    has_prev = mask & ((cls_idx > 0) | (prev_slot >= 0))
    from_input = mask & (cls_idx == 0) & (prev_slot >= 0)
    pqs, pqe, pks, pke, pmt, pvalid = _load_slice(qr_ptr, kr_ptr, mt_ptr, prev_slot, from_input, Tq, Tk)
    # The predecessor is of the lane's class by construction; masked lanes would read as invalid.
    pvalid = valid
    _partition_half(qr_ptr, kr_ptr, mt_ptr, keys, slots, c, offs, mask, qs, qe, ks, ke, mt, valid,
                    pqs, pqe, pks, pke, pmt, pvalid, pos, cls_idx, has_prev, n_before, inv_start, n_valid, flags,
                    S, Tq, Tk, False, BLOCK_C, BLOCK_T)
    _partition_half(qr_ptr, kr_ptr, mt_ptr, keys, slots, c, offs, mask, qs, qe, ks, ke, mt, valid,
                    pqs, pqe, pks, pke, pmt, pvalid, pos, cls_idx, has_prev, n_before, inv_start, n_valid, flags,
                    S, Tq, Tk, True, BLOCK_C, BLOCK_T)


@triton.jit
def _run_start(run_start, r, stride, n_base):
    """Where run ``r`` of a level (``stride`` base runs each) starts."""
    return tl.load(run_start + tl.minimum(r.to(tl.int64) * stride, n_base))


@triton.jit
def _merge_rows(qr_ptr, kr_ptr, mt_ptr, out_ptr, keys, slots, run_start, first, starts, point, dc, dl, offs_p, S,
                Tq, Tk, nc, stride, n_runs, run_iter, search_iter, parity, half,
                IS_TRANSPOSED: tl.constexpr, IS_LAST: tl.constexpr, BLOCK: tl.constexpr, BLOCK_F: tl.constexpr):
    """Move the elements at positions ``offs_p`` to their places in the merged runs of the next level."""
    S64 = S.to(tl.int64)
    mask_p = offs_p < S
    src1 = keys + (parity * 4 + half * 2) * S64
    src2 = src1 + S64
    k1 = tl.load(src1 + offs_p, mask=mask_p, other=0)
    k2 = tl.load(src2 + offs_p, mask=mask_p, other=0)
    slot = tl.load(slots + (parity * 2 + half) * S64 + offs_p, mask=mask_p, other=0)
    n_base = 2 * nc.to(tl.int64)
    # This position's run: the last one starting at or before it.
    left = tl.zeros_like(offs_p)
    right = tl.zeros_like(offs_p) + n_runs
    for _ in range(0, run_iter):
        open_ = left < right
        mid = (left + right) // 2
        go = _run_start(run_start, mid, stride, n_base) <= offs_p
        left = tl.where(open_ & go, mid + 1, left)
        right = tl.where(open_ & ~go, mid, right)
    run = left - 1
    own_start = _run_start(run_start, run, stride, n_base)
    group = (run // BLOCK_F) * BLOCK_F
    sib = group[:, None] + tl.arange(0, BLOCK_F)[None, :]
    mask_sib = mask_p[:, None] & (sib < n_runs) & (sib != run[:, None])
    sib_start = _run_start(run_start, sib, stride, n_base)
    lo = sib_start
    hi = tl.where(mask_sib, _run_start(run_start, sib + 1, stride, n_base), sib_start)
    # Per sibling run, its elements that precede this one: ties go to the earlier run.
    tie = sib < run[:, None]
    for _ in range(0, search_iter):
        open_ = lo < hi
        mid = (lo + hi) // 2
        e1 = tl.load(src1 + mid, mask=open_, other=0)
        e2 = tl.load(src2 + mid, mask=open_, other=0)
        go = (e1 < k1[:, None]) | ((e1 == k1[:, None]) & ((e2 < k2[:, None]) | ((e2 == k2[:, None]) & tie)))
        lo = tl.where(open_ & go, mid + 1, lo)
        hi = tl.where(open_ & ~go, mid, hi)
    new_pos = _run_start(run_start, group, stride, n_base) + (offs_p - own_start) + tl.sum(lo - sib_start, axis=1)
    if IS_LAST:
        _finish(qr_ptr, kr_ptr, mt_ptr, out_ptr, first, starts, point, dc, dl, new_pos, slot, mask_p, Tq, Tk,
                IS_TRANSPOSED, BLOCK)
    else:
        dst1 = keys + ((1 - parity) * 4 + half * 2) * S64
        tl.store(dst1 + new_pos, k1, mask=mask_p)
        tl.store(dst1 + S64 + new_pos, k2, mask=mask_p)
        tl.store(slots + ((1 - parity) * 2 + half) * S64 + new_pos, slot, mask=mask_p)


@triton.jit
def _merge_half(qr_ptr, kr_ptr, mt_ptr, out_ptr, ws_ptr, pid, S, Tq, Tk, nc, nq, nk, stride, n_runs, run_iter,
                search_iter, parity, IS_TRANSPOSED: tl.constexpr, IS_LAST: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    if IS_TRANSPOSED:
        half = 1
    else:
        half = 0
    keys, slots, counts, last_valid, last_invalid, run_start, flags = _sort_arrays(ws_ptr, S, nc, nq, nk)
    first, starts, point, dc, dl = _block_arrays(ws_ptr, nq, nk, IS_TRANSPOSED)
    if tl.load(flags + half) != 0:
        # Rows of BLOCK_R: each searches BLOCK_F sibling runs at once.
        for r0 in range(0, BLOCK_M, BLOCK_R):
            offs_p = pid * BLOCK_M + r0 + tl.arange(0, BLOCK_R)
            _merge_rows(qr_ptr, kr_ptr, mt_ptr, out_ptr, keys, slots, run_start, first, starts, point, dc, dl,
                        offs_p, S, Tq, Tk, nc, stride, n_runs, run_iter, search_iter, parity, half,
                        IS_TRANSPOSED, IS_LAST, BLOCK, BLOCK_F)
    else:
        if IS_LAST:
            # Sorted already: the partitioned sequence is the plan's order.
            offs_p = pid * BLOCK_M + tl.arange(0, BLOCK_M)
            mask_p = offs_p < S
            slot = tl.load(slots + half * S.to(tl.int64) + offs_p, mask=mask_p, other=0)
            _finish(qr_ptr, kr_ptr, mt_ptr, out_ptr, first, starts, point, dc, dl, offs_p, slot, mask_p, Tq, Tk,
                    IS_TRANSPOSED, BLOCK)


@triton.jit(do_not_specialize=["S", "Tq", "Tk", "nc", "nq", "nk", "stride", "n_runs", "run_iter", "search_iter",
                               "parity"])
def _merge_kernel(qr_ptr, kr_ptr, mt_ptr, q_out_ptr, k_out_ptr, ws_ptr, S, Tq, Tk, nc, nq, nk, stride, n_runs,
                  run_iter, search_iter, parity, IS_LAST: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """Grid ``(cdiv(S, BLOCK_M), 2)``: one merge level (axis 1 picks the half); the last one finishes."""
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _merge_half(qr_ptr, kr_ptr, mt_ptr, q_out_ptr, ws_ptr, pid, S, Tq, Tk, nc, nq, nk, stride, n_runs, run_iter,
                    search_iter, parity, False, IS_LAST, BLOCK, BLOCK_M, BLOCK_R, BLOCK_F)
    else:
        _merge_half(qr_ptr, kr_ptr, mt_ptr, k_out_ptr, ws_ptr, pid, S, Tq, Tk, nc, nq, nk, stride, n_runs, run_iter,
                    search_iter, parity, True, IS_LAST, BLOCK, BLOCK_M, BLOCK_R, BLOCK_F)


@triton.jit(do_not_specialize=["nq", "nk"])
def _scan_blocks_kernel(q_lo_ptr, q_hi_ptr, k_lo_ptr, k_hi_ptr, ws_ptr, nq, nk, BLOCK_N: tl.constexpr):
    """Grid ``(2,)``: every block's window and work, one program per half (:func:`_scan_blocks`)."""
    if tl.program_id(0) == 0:
        first, starts, point, dc, dl = _block_arrays(ws_ptr, nq, nk, False)
        _scan_blocks(first, starts, point, dc, dl, q_lo_ptr, q_hi_ptr, nq, BLOCK_N)
    else:
        first, starts, point, dc, dl = _block_arrays(ws_ptr, nq, nk, True)
        _scan_blocks(first, starts, point, dc, dl, k_lo_ptr, k_hi_ptr, nk, BLOCK_N)


@triton.jit(do_not_specialize=["nq", "nk"])
def _order_blocks_kernel(q_lo_ptr, q_order_ptr, k_lo_ptr, k_order_ptr, ws_ptr, nq, nk, BLOCK_B: tl.constexpr,
                         BLOCK_T: tl.constexpr):
    """Grid ``(cdiv(max(nq, nk), BLOCK_B), 2)``: places in ``block_order`` (axis 1 picks the half)."""
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        first, starts, work, group, dl = _block_arrays(ws_ptr, nq, nk, False)
        _order_tile(work, group, q_lo_ptr, q_order_ptr, pid, nq, BLOCK_B, BLOCK_T)
    else:
        first, starts, work, group, dl = _block_arrays(ws_ptr, nq, nk, True)
        _order_tile(work, group, k_lo_ptr, k_order_ptr, pid, nk, BLOCK_B, BLOCK_T)


def _merge_levels(S):
    """``(stride, n_runs, is_last)`` per merge level for ``S`` slots: base runs (two per chunk),
    ``_BLOCK_F`` of them merged per level."""
    n_base = 2 * triton.cdiv(S, _BLOCK_C)
    levels = []
    stride = 1
    while True:
        last = stride * _BLOCK_F >= n_base
        levels.append((stride, triton.cdiv(n_base, stride), last))
        if last:
            return levels
        stride *= _BLOCK_F


def build_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk, block=PLAN_BLOCK):
    """:class:`~flashrange.plan.RangePlan` from the Triton launches; equal to the plain-PyTorch plan."""
    dev = q_ranges.device
    # The checked (S, 2) / (S,) inputs are usually contiguous already: one call instead of two each.
    qr = q_ranges if q_ranges.is_contiguous() else q_ranges.reshape(-1, 2).contiguous()
    kr = k_ranges if k_ranges.is_contiguous() else k_ranges.reshape(-1, 2).contiguous()
    mt = mask_types if mask_types.is_contiguous() else mask_types.reshape(-1).contiguous()
    S = mt.numel()
    nq, nk = -(-Tq // block), -(-Tk // block)
    i32 = torch.int32
    q_slices = torch.empty(S, 5, dtype=i32, device=dev)
    k_slices = torch.empty(S, 5, dtype=i32, device=dev)
    q_lo, q_hi, q_order = (torch.empty(nq, dtype=i32, device=dev) for _ in range(3))
    k_lo, k_hi, k_order = (torch.empty(nk, dtype=i32, device=dev) for _ in range(3))
    plan = RangePlan(q_slices, q_lo, q_hi, q_order, k_slices, k_lo, k_hi, k_order)
    n_max = max(nq, nk)
    if S <= SMALL_PLAN_SLICES:
        # One program per half ranks the slots by counting; it also walks the blocks
        # when they are few, else the block launches follow.
        has_blocks = n_max <= SMALL_PLAN_BLOCKS
        ws = torch.empty(_workspace_words(S, nq, nk, False), dtype=i32, device=dev)
        # Tiles no wider than the problem: one program walks them all in turn.
        s_tile = max(16, min(32, triton.next_power_of_2(S)))
        t_tile = max(16, min(64, triton.next_power_of_2(S)))
        b_tile = 16
        n_tile = max(16, min(128, triton.next_power_of_2(n_max + 1)))
        launch(_plan_small_kernel, (2,),
               (qr, kr, mt, q_slices, q_lo, q_hi, q_order, k_slices, k_lo, k_hi, k_order, ws,
                S, Tq, Tk, nq, nk, has_blocks, block, s_tile, t_tile, b_tile, n_tile))
        if not has_blocks:
            _launch_blocks(plan, ws, nq, nk)
        return plan
    nc = triton.cdiv(S, _BLOCK_C)
    ws = torch.empty(_workspace_words(S, nq, nk, True), dtype=i32, device=dev)
    BLOCK_I = 1024
    launch(_count_kernel, (max(nc, triton.cdiv(8 * (nq + nk + 2), BLOCK_I)),),
           (qr, kr, mt, ws, S, Tq, Tk, nc, nq, nk, _BLOCK_C, BLOCK_I))
    merge_m, rows, count_cols = _tiles(S)
    launch(_partition_kernel, (nc,), (qr, kr, mt, ws, S, Tq, Tk, nc, nq, nk, _BLOCK_C, 1024, count_cols))
    for level, (stride, n_runs, last) in enumerate(_merge_levels(S)):
        search_iter = min(S, stride * _BLOCK_C).bit_length()
        launch(_merge_kernel, (triton.cdiv(S, merge_m), 2),
               (qr, kr, mt, q_slices, k_slices, ws, S, Tq, Tk, nc, nq, nk, stride, n_runs,
                n_runs.bit_length(), search_iter, level % 2, last, block, merge_m, rows, _BLOCK_F))
    if n_max > 0:
        _launch_blocks(plan, ws, nq, nk)
    return plan


def _launch_blocks(plan, ws, nq, nk):
    """Windows and work of every block (one program per half), then the block order (many)."""
    launch(_scan_blocks_kernel, (2,), (plan.q_block_lo, plan.q_block_hi, plan.k_block_lo, plan.k_block_hi, ws,
                                       nq, nk, 1024))
    launch(_order_blocks_kernel, (triton.cdiv(max(nq, nk), 16), 2),
           (plan.q_block_lo, plan.q_block_order, plan.k_block_lo, plan.k_block_order, ws, nq, nk, 16, 128))


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
