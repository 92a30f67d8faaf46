"""Backward with dQ accumulated inside the dK/dV kernel: five matmuls per tile, deterministic (docs/design.md §6).

The two-launch backward (``kernels/backward.py``) recomputes ``S`` and ``dP`` in
its dQ kernel: seven matmuls per tile pair where this one does five. Here one
key-major kernel computes dK and dV as the Triton dK/dV kernel does and also
``dS K`` per query tile, which it adds to a float32 dQ accumulator. Those adds
are what makes such a backward non-deterministic elsewhere; here they take
turns in a fixed order:

- Query tiles are the ``BLOCK_M``-row tiles of the global grid (a slice's first
  tile starts below its first row; rows outside the slice load as zeros).
- A query tile of one head receives the contributions of the key tiles whose
  walk reaches it, in increasing key-tile order; within one key tile, its
  slices in the plan's canonical order.
- Each (head, query tile) has a turn counter: the key tile ``n`` that adds to it
  waits until the counter holds ``p + 1``, ``p`` the largest key tile below
  ``n`` that reaches the tile (``-1`` when none: the counter starts at 0), and
  writes ``n + 1`` after its last slice's add (float32 atomic adds in L2,
  ordered by the counter's acquire and release). ``p`` is a maximum over the
  slices of the query-major plan that cover the tile's rows (each gives an
  interval of key tiles), so no list of contributors is ever built.
- Programs take their key tiles through a ticket counter in increasing order,
  so a key tile only ever waits for tiles already taken by running programs:
  no deadlock, on any grid.

A wait longer than ``max_spins`` polls (an inconsistent turn, a bug) sets an
error flag and goes on, so a mistake cannot hang the GPU or the interpreter;
tests read the flag. Not a default: opt-in through ``BwdConfig(fused_dq=True)``
on the Triton kernels, and slower than the default backward on Hopper (its
tile holds dK, dV and a dQ tile in registers; BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..constants import PLAN_BLOCK
from .common import (
    DEV_LOG2E,
    DEV_NO_DIAGONAL,
    cast_rounded,
    dkdv_accumulate,
    dkdv_cells,
    dkdv_probs,
    key_block,
    key_span,
    launch,
    load_head_rows,
    query_span,
    slice_diagonals,
    slice_row,
    store_head_rows,
)

__all__ = ["fused_backward", "MAX_SPINS_GPU"]

# Polls of a turn counter before a wait counts as an error: seconds on a GPU, where a correct turn
# waits at most for a few earlier key tiles' walks (milliseconds). The interpreter runs programs one
# after another in ticket order, where every turn is already due: one poll.
MAX_SPINS_GPU = 1 << 22
# Slices read per step when a program scans a plan window.
_BLOCK_S = 16


@triton.jit
def _load_slices(slices_ptr, offs, mask):
    """``(qs, qe, ks, ke, type)`` of the plan's slices ``offs`` (type ``-1`` where masked off)."""
    qs = tl.load(slices_ptr + offs * 5, mask=mask, other=0)
    qe = tl.load(slices_ptr + offs * 5 + 1, mask=mask, other=0)
    ks = tl.load(slices_ptr + offs * 5 + 2, mask=mask, other=0)
    ke = tl.load(slices_ptr + offs * 5 + 3, mask=mask, other=0)
    mtype = tl.load(slices_ptr + offs * 5 + 4, mask=mask, other=-1)
    return qs, qe, ks, ke, mtype


@triton.jit
def _reaches(k_slices_ptr, lo, hi, c0, c1, r0, r1, BLOCK_S: tl.constexpr):
    """1 if a slice of the key-major window ``[lo, hi)`` has a row in ``[r0, r1)`` reading keys ``[c0, c1)``
    (the same test as the walk's: its rows ``query_span`` overlap the tile), else 0."""
    hit = 0
    for s0 in range(lo, hi, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        mask = offs < hi
        qs, qe, ks, ke, mtype = _load_slices(k_slices_ptr, offs, mask)
        m_lo, m_hi = query_span(c0, c1, qs, qe, ks, ke, mtype)
        seen = mask & (mtype >= 0) & (m_hi > m_lo) & (m_lo < r1) & (m_hi > r0)
        hit = tl.maximum(hit, tl.max(seen.to(tl.int32), 0))
    return hit


@triton.jit
def _previous_key_tile(q_slices_ptr, lo, hi, r0, r1, n, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr):
    """The largest key tile below ``n`` whose walk reaches rows ``[r0, r1)`` through a slice of the query-major
    window ``[lo, hi)``, or ``-1``: each slice's rows there read one interval of keys (``key_span``)."""
    prev = -1
    for s0 in range(lo, hi, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        mask = offs < hi
        qs, qe, ks, ke, mtype = _load_slices(q_slices_ptr, offs, mask)
        k_lo, k_hi = key_span(r0, r1, qs, qe, ks, ke, mtype)
        ok = mask & (mtype >= 0) & (k_hi > k_lo) & (k_lo // BLOCK_N < n)
        last = tl.minimum((k_hi - 1) // BLOCK_N, n - 1)
        prev = tl.maximum(prev, tl.max(tl.where(ok, last, -1), 0))
    return prev


# Sizes, head counts and the spin limit vary from call to call; specializing on them would build a
# kernel per combination.
@triton.jit(do_not_specialize=["Tq", "Tk", "Hq", "Hkv", "G", "D", "DV", "n_row_tiles", "max_spins"])
def _bwd_fused_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, ws_ptr, dq_acc_ptr, turn_ptr, ticket_ptr, error_ptr, dk_ptr, dv_ptr,
    k_slices_ptr, k_block_lo_ptr, k_block_hi_ptr, q_slices_ptr, q_block_lo_ptr, q_block_hi_ptr,
    Tq, Tk, Hq, Hkv, G, D, DV, n_row_tiles, max_spins,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, softcap,
    HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_BF16_EMULATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PLAN_ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    # Key tiles in increasing order, the heads of one tile side by side (see the module docstring).
    ticket = tl.atomic_add(ticket_ptr, 1)
    n = ticket // Hkv
    pid_hk = ticket - n * Hkv
    c0 = n * BLOCK_N
    c1 = tl.minimum(c0 + BLOCK_N, Tk)
    plan_block = c0 // PLAN_ROWS
    s_lo = tl.load(k_block_lo_ptr + plan_block)
    s_hi = tl.load(k_block_hi_ptr + plan_block)

    offs_n, offs_d, offs_dv, mask_n, cols, hk, k, v, dk, dv = key_block(
        k_ptr, v_ptr, pid_hk, c0, Tk, D, DV, stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N, BLOCK_D, BLOCK_DV,
        IS_BF16_EMULATED)
    offs_r = tl.arange(0, BLOCK_M)
    qk_scale2 = scale * DEV_LOG2E
    lse2_ptr = ws_ptr + Hq.to(tl.int64) * Tq

    for sg in range(s_lo * G, s_hi * G):
        s = sg // G
        g = sg - s * G
        qs, qe, ks, ke, mtype = slice_row(k_slices_ptr, s)
        has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
        d_hi = tl.where(has_upper, d_max, DEV_NO_DIAGONAL)
        d_lo = tl.where(has_lower, d_min, -DEV_NO_DIAGONAL)
        m_lo, m_hi = query_span(c0, c1, qs, qe, ks, ke, mtype)
        m_hi = tl.where(mtype >= 0, m_hi, m_lo)
        # Tiles of the global row grid, from the one holding the first row.
        r_first = (m_lo // BLOCK_M) * BLOCK_M
        n_tiles = tl.where(m_hi > m_lo, tl.cdiv(m_hi - r_first, BLOCK_M), 0)
        h = (pid_hk * G + g).to(tl.int64)
        for t in range(0, n_tiles):
            r = r_first + t * BLOCK_M
            offs_m = r + offs_r
            rows = offs_m.to(tl.int64)
            mask_m = (offs_m >= m_lo) & (offs_m < m_hi)
            q = load_head_rows(q_ptr, h, rows, mask_m, offs_d, D, stride_qt, stride_qh)
            do = load_head_rows(do_ptr, h, rows, mask_m, offs_dv, DV, stride_dot, stride_doh)
            # Rows outside the slice's reach: p = 0 through lse = +inf.
            lse2 = tl.load(lse2_ptr + h * Tq + offs_m, mask=mask_m, other=float("inf"))
            delta = tl.load(ws_ptr + h * Tq + offs_m, mask=mask_m, other=0.0)
            if IS_BF16_EMULATED:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            pT, th = dkdv_probs(k, q, lse2, qk_scale2, scale, softcap, HAS_SOFTCAP, DOT_PRECISION)
            cell = dkdv_cells(offs_n, offs_m, ks, ke, d_lo, d_hi)
            pT = tl.where(cell, pT, 0.0)
            dk, dv, dsT = dkdv_accumulate(dk, dv, v, q, do, delta, pT, th, cell, True, HAS_SOFTCAP, DOT_PRECISION,
                                          IS_BF16_EMULATED)
            dq_part = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION)

            r1 = tl.minimum(r + BLOCK_M, Tq)
            turn = turn_ptr + h * n_row_tiles + r // BLOCK_M
            # This tile's first slice in this key tile waits for its turn; its last one passes it on.
            if _reaches(k_slices_ptr, s_lo, s, c0, c1, r, r1, BLOCK_S) == 0:
                q_block = r // PLAN_ROWS
                due = 1 + _previous_key_tile(q_slices_ptr, tl.load(q_block_lo_ptr + q_block),
                                             tl.load(q_block_hi_ptr + q_block), r, r1, n, BLOCK_N, BLOCK_S)
                now = tl.atomic_add(turn, 0, sem="acquire")
                spins = 0
                while (now != due) & (spins < max_spins):
                    now = tl.atomic_add(turn, 0, sem="acquire")
                    spins += 1
                if now != due:
                    tl.atomic_max(error_ptr, 1)
            # Adds done in L2 (no read back; the turn orders them): one per element and contributor.
            tl.atomic_add(dq_acc_ptr + (rows[:, None] * Hq + h) * BLOCK_D + offs_d[None, :], dq_part,
                          mask=(offs_m < Tq)[:, None], sem="relaxed")
            if _reaches(k_slices_ptr, s + 1, s_hi, c0, c1, r, r1, BLOCK_S) == 0:
                # Every thread's adds before the one release (a scalar atomic runs in one thread; the
                # barrier puts the others' adds before it, and the release orders them before the next
                # contributor's: the lock pattern of Triton's own atomic tests).
                tl.debug_barrier()
                tl.atomic_xchg(turn, n + 1, sem="release")

    dk = dk * scale
    store_head_rows(dk_ptr, cast_rounded(dk, dk_ptr.dtype.element_ty, IS_BF16_EMULATED), hk, cols, mask_n, offs_d, D,
                    stride_dkt, stride_dkh)
    store_head_rows(dv_ptr, cast_rounded(dv, dv_ptr.dtype.element_ty, IS_BF16_EMULATED), hk, cols, mask_n, offs_dv,
                    DV, stride_dvt, stride_dvh)


@triton.jit(do_not_specialize=["Tq", "Hq", "DV"])
def _bwd_rows_kernel(
    do_ptr, o_ptr, lse_ptr, dlse_ptr, ws_ptr, Tq, Hq, DV,
    stride_dot, stride_doh, stride_ot, stride_oh, stride_lt, stride_lh, stride_dlt, stride_dlh,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """The workspace rows of ``BLOCK_M`` rows of one head, as the dQ kernel of ``kernels/backward.py`` writes
    them: ``delta = rowsum(dO * O) - dlse`` and ``lse * log2(e)``; rows no slice covers (``lse = -inf``) get
    0 and ``+inf``, their dO, O and dlse unread (a NaN there stays out)."""
    h = tl.program_id(1).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < Tq
    rows = offs_m.to(tl.int64)
    lse = tl.load(lse_ptr + h * stride_lh + rows * stride_lt, mask=mask_m, other=float("-inf")).to(tl.float32)
    covered = lse != float("-inf")
    lse2 = tl.where(covered, lse * DEV_LOG2E, float("inf"))
    do = load_head_rows(do_ptr, h, rows, covered, offs_dv, DV, stride_dot, stride_doh)
    o = load_head_rows(o_ptr, h, rows, covered, offs_dv, DV, stride_ot, stride_oh)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + h * stride_dlh + rows * stride_dlt, mask=covered, other=0.0).to(tl.float32)
    tl.store(ws_ptr + h * Tq + offs_m, delta, mask=mask_m)
    tl.store(ws_ptr + (Hq + h) * Tq + offs_m, lse2, mask=mask_m)


def fused_backward(dout, q, k, v, out, lse, dlse, plan, scale, softcap, *, block_m, block_n, num_warps,
                   num_stages, dot_precision, bf16_emulated, block_d, block_dv, max_spins):
    """``(dq, dk, dv, error)`` from one key-major launch (after one that writes the rows' delta and scaled lse;
    then dQ's conversion); ``error``: a
    one-element int32 tensor, nonzero when a turn was not due after ``max_spins`` polls (never read here:
    that would synchronise). Inputs as :func:`~flashrange.kernels.backward.range_attention_backward_triton`
    after its checks, last dims contiguous; ``softcap`` is 0 for none."""
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    dev = q.device
    # delta (plane 0) and lse * log2(e) (plane 1), (Hq, Tq) each.
    ws = torch.empty(2, Hq, Tq, dtype=torch.float32, device=dev)
    has_dlse = dlse is not None
    dl = dlse if has_dlse else lse  # never read without a dlse
    so, sdo, sl, sdl = out.stride(), dout.stride(), lse.stride(), dl.stride()
    rows_m = 64
    launch(_bwd_rows_kernel, (triton.cdiv(Tq, rows_m), Hq),
           (dout, out, lse, dl, ws, Tq, Hq, Dv, sdo[0], sdo[1], so[0], so[1], sl[0], sl[1], sdl[0], sdl[1],
            has_dlse, rows_m, block_dv), num_warps=4)
    n_row_tiles = triton.cdiv(Tq, block_m)
    dq_acc = torch.zeros(Tq, Hq, block_d, dtype=torch.float32, device=dev)
    counters = torch.zeros(Hq * n_row_tiles + 2, dtype=torch.int32, device=dev)
    turns, ticket, error = counters[:-2], counters[-2:-1], counters[-1:]
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    has_softcap = softcap > 0.0
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    sdk, sdv = dk.stride(), dv.stride()
    grid = (triton.cdiv(Tk, block_n) * Hkv,)
    args = (
        q, k, v, dout, ws, dq_acc, turns, ticket, error, dk, dv,
        plan.k_slices, plan.k_block_lo, plan.k_block_hi, plan.q_slices, plan.q_block_lo, plan.q_block_hi,
        Tq, Tk, Hq, Hkv, Hq // Hkv, D, Dv, n_row_tiles, max_spins,
        sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], sdo[0], sdo[1], sdk[0], sdk[1], sdv[0], sdv[1],
        scale, softcap if has_softcap else 1.0,
        has_softcap, dot_precision, bf16_emulated, block_m, block_n, block_d, block_dv, PLAN_BLOCK, _BLOCK_S,
    )
    launch(_bwd_fused_kernel, grid, args, num_warps=num_warps, num_stages=num_stages)
    dq = (dq_acc[..., :D] * scale).to(q.dtype)
    return dq, dk, dv, error
