"""Triton backward of range attention: dQ, dK, dV (docs/design.md §6).

Two launches, no atomics, so every gradient is bitwise reproducible:

1. ``_bwd_dq_kernel``: query-block-major. A program owns ``BLOCK_M`` rows of
   one query head. From the dO and O tiles it loads anyway it first computes,
   for its rows, ``delta = rowsum(dO * O) - dlse`` and ``lse * log2(e)``
   (``+inf`` where ``lse = -inf``, so that ``exp2(s - lse)`` is exactly 0 on
   rows no slice covers; their delta and dO are taken as 0, so a NaN in an
   uncovered row's dO or O cannot reach dQ) and stores both, laid out
   ``(Hq, Tq)`` in one workspace; then it walks every slice and key tile that
   the rows reach and writes dQ once. The grid covers every row of every head,
   blocks with an empty window included, so every workspace entry is written.
2. ``_bwd_dkdv_kernel``: key-block-major, launched after the dQ kernel (same
   stream), reads delta and the scaled lse. A program owns ``BLOCK_N`` keys of
   one key/value head and walks, in the plan's canonical slice order, every
   slice that reaches those keys, every query head of the GQA group and every
   query tile of the slice's rows; it writes dK and dV once.

``BwdConfig(fused_dq=True)`` replaces both by one key-major launch that also
accumulates dQ, its adds taking turns in a fixed order
(:mod:`flashrange.kernels.backward_fused`).

Each slice is processed on its own (a cell covered twice counts twice). Along
the walked axis the tiles of one slice are laid out around the run of tiles
that the slice covers entirely: those skip the element mask and the bounds
checks; the few tiles on the slice's edges and diagonals are masked. The
accumulation order depends only on the plan's canonical slice order, hence
not on the order of the slice list nor on empty slices in it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from ..constants import MAX_HEAD_DIM, MAX_HEAD_DIM_V, WIDE_V_MAX_HEAD_DIM, has_short_slices, kernel_head_dims_ok
from ..validation import resolve_scale
from .common import (
    DEV_LOG2E,
    DEV_NO_DIAGONAL,
    WS_MAXNREG,
    cast_rounded,
    dkdv_accumulate,
    dkdv_cells,
    dkdv_probs,
    ensure_tma_allocator,
    full_row_run,
    gluon_sm90_ready,
    interpreting,
    key_block,
    key_span,
    launch,
    needs_int64,
    pad_dim,
    packed_heads,
    plan_program,
    plan_split,
    query_span,
    row_cells,
    slice_diagonals,
    slice_row,
    sm_count,
    store_head_rows,
    tanh_exp2,
    tma_aligned,
    warn_gluon_fallback,
)
from .backward_fused import MAX_SPINS_GPU, fused_backward
from .plan import build_plan

__all__ = ["range_attention_backward_triton", "BwdConfig", "default_config"]


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v,
    q_head_ptr, do_head_ptr, lse2_head_ptr, delta_head_ptr,
    first_m, n_first, second_m, n_tiles, m_lo, m_hi,
    offs_n, offs_d, offs_dv,
    stride_qt, stride_dot,
    qs, qe, ks, ke, mtype,
    D, DV, qk_scale2, scale, softcap,
    IS_MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_D_PADDED: tl.constexpr, IS_DV_PADDED: tl.constexpr, IS_INT64: tl.constexpr,
    DOT_PRECISION: tl.constexpr, IS_BF16_EMULATED: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Accumulate ``n_tiles`` query tiles into one key block.

    Tile ``t`` starts at row ``first_m + t * BLOCK_M`` for ``t < n_first``,
    then the tiles continue from ``second_m`` (two runs in one loop: the
    masked tiles before and after the slice's fully covered rows). Masked
    tiles load only rows in ``[m_lo, m_hi)`` and apply the slice's element
    mask; unmasked tiles lie entirely inside the slice.
    """
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    # Diagonal bounds of key - row; a side the type does not cut is unbounded.
    d_hi = tl.where(has_upper, d_max, DEV_NO_DIAGONAL)
    d_lo = tl.where(has_lower, d_min, -DEV_NO_DIAGONAL)
    for t in range(0, n_tiles):
        start = tl.where(t < n_first, first_m + t * BLOCK_M, second_m + (t - n_first) * BLOCK_M)
        offs_m = start + tl.arange(0, BLOCK_M)
        rows = offs_m
        if IS_INT64:
            rows = offs_m.to(tl.int64)
        q_ptrs = q_head_ptr + rows[:, None] * stride_qt + offs_d[None, :]
        do_ptrs = do_head_ptr + rows[:, None] * stride_dot + offs_dv[None, :]
        if IS_MASKED:
            mask_m = (offs_m >= m_lo) & (offs_m < m_hi)
            q = tl.load(q_ptrs, mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0)
            lse2 = tl.load(lse2_head_ptr + offs_m, mask=mask_m, other=float("inf"))
        else:
            if IS_D_PADDED:
                q = tl.load(q_ptrs, mask=offs_d[None, :] < D, other=0.0)
            else:
                q = tl.load(q_ptrs)
            lse2 = tl.load(lse2_head_ptr + offs_m)
        if IS_BF16_EMULATED:
            q = q.to(tl.float32)
        pT, th = dkdv_probs(k, q, lse2, qk_scale2, scale, softcap, HAS_SOFTCAP, DOT_PRECISION)
        if IS_MASKED:
            # Rows outside [m_lo, m_hi) (inside the slice's rows) already have
            # p = 0 through lse = +inf; keys and diagonals remain.
            cell = dkdv_cells(offs_n, offs_m, ks, ke, d_lo, d_hi)
            pT = tl.where(cell, pT, 0.0)
            do = tl.load(do_ptrs, mask=mask_m[:, None] & (offs_dv[None, :] < DV), other=0.0)
            delta = tl.load(delta_head_ptr + offs_m, mask=mask_m, other=0.0)
        else:
            cell = pT  # unused
            if IS_DV_PADDED:
                do = tl.load(do_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                do = tl.load(do_ptrs)
            delta = tl.load(delta_head_ptr + offs_m)
        if IS_BF16_EMULATED:
            do = do.to(tl.float32)
        dk, dv, _ = dkdv_accumulate(dk, dv, v, q, do, delta, pT, th, cell, IS_MASKED, HAS_SOFTCAP, DOT_PRECISION,
                                    IS_BF16_EMULATED)
    return dk, dv


# Sizes and head counts vary from call to call; specializing on them (== 1,
# divisible by 16) would build a new kernel for each combination.
@triton.jit(do_not_specialize=["Tq", "Tk", "Hq", "Hkv", "G", "D", "DV"])
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, ws_ptr, dk_ptr, dv_ptr,
    slices_ptr, block_lo_ptr, block_hi_ptr, block_order_ptr,
    Tq, Tk, Hq, Hkv, G, D, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, softcap,
    HAS_SOFTCAP: tl.constexpr, IS_INT64: tl.constexpr, DOT_PRECISION: tl.constexpr, IS_BF16_EMULATED: tl.constexpr,
    IS_D_PADDED: tl.constexpr, IS_DV_PADDED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Unpadded head dims as the constant tile widths, so that column masks fold away and row loads and
    # stores vectorize (a mask against a runtime width keeps them 2 bytes wide).
    if not IS_D_PADDED:
        D = BLOCK_D
    if not IS_DV_PADDED:
        DV = BLOCK_DV
    # Heaviest key blocks first; all heads of one block are neighbours in the grid.
    # A program owns tile pid // Hkv % SPLIT of its plan block and reads the block's window.
    pid_hk, c0, c1, s_lo, s_hi = plan_program(tl.program_id(0), Hkv, Tk, block_order_ptr, block_lo_ptr,
                                              block_hi_ptr, SPLIT, BLOCK_N)
    offs_n, offs_d, offs_dv, mask_n, cols, hk, k, v, dk, dv = key_block(
        k_ptr, v_ptr, pid_hk, c0, Tk, D, DV, stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N, BLOCK_D, BLOCK_DV,
        IS_BF16_EMULATED)
    qk_scale2 = scale * DEV_LOG2E

    # The workspace: delta, then lse * log2(e), (Hq, Tq) each (written by the dQ kernel).
    lse2_ptr = ws_ptr + Hq.to(tl.int64) * Tq

    # One loop over (slice, query head of the group): a shallower loop nest
    # keeps fewer values live around the tile loops (registers).
    for sg in range(s_lo * G, s_hi * G):
        s = sg // G
        g = sg - s * G
        qs, qe, ks, ke, mtype = slice_row(slices_ptr, s)
        has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
        m_lo, m_hi = query_span(c0, c1, qs, qe, ks, ke, mtype)
        # Rows that read every key of the block form one run [f_lo, f_hi).
        f_lo, f_hi = full_row_run(c0, c1, qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, m_lo, m_hi)
        n_full = (f_hi - f_lo) // BLOCK_M
        n_pre = tl.cdiv(f_lo - m_lo, BLOCK_M)
        post = f_lo + n_full * BLOCK_M
        n_post = tl.cdiv(m_hi - post, BLOCK_M)
        h = (pid_hk * G + g).to(tl.int64)
        q_head_ptr = q_ptr + h * stride_qh
        do_head_ptr = do_ptr + h * stride_doh
        delta_head_ptr = ws_ptr + h * Tq
        lse2_head_ptr = lse2_ptr + h * Tq
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_head_ptr, do_head_ptr, lse2_head_ptr, delta_head_ptr,
            f_lo, n_full, f_lo, n_full, m_lo, m_hi,
            offs_n, offs_d, offs_dv, stride_qt, stride_dot,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            False, HAS_SOFTCAP, IS_D_PADDED, IS_DV_PADDED, IS_INT64, DOT_PRECISION, IS_BF16_EMULATED, BLOCK_M,
        )
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_head_ptr, do_head_ptr, lse2_head_ptr, delta_head_ptr,
            f_lo - n_pre * BLOCK_M, n_pre, post, n_pre + n_post, m_lo, m_hi,
            offs_n, offs_d, offs_dv, stride_qt, stride_dot,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            True, HAS_SOFTCAP, IS_D_PADDED, IS_DV_PADDED, IS_INT64, DOT_PRECISION, IS_BF16_EMULATED, BLOCK_M,
        )

    dk = dk * scale
    store_head_rows(dk_ptr, cast_rounded(dk, dk_ptr.dtype.element_ty, IS_BF16_EMULATED), hk, cols, mask_n, offs_d, D,
                    stride_dkt, stride_dkh)
    store_head_rows(dv_ptr, cast_rounded(dv, dv_ptr.dtype.element_ty, IS_BF16_EMULATED), hk, cols, mask_n, offs_dv,
                    DV, stride_dvt, stride_dvh)


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta,
    k_head_ptr, v_head_ptr,
    first_n, n_first, second_n, n_tiles, n_lo, n_hi,
    offs_m, offs_d, offs_dv,
    stride_kt, stride_vt,
    qs, qe, ks, ke, mtype,
    D, DV, qk_scale2, scale, softcap,
    IS_MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    IS_D_PADDED: tl.constexpr, IS_DV_PADDED: tl.constexpr, IS_INT64: tl.constexpr,
    DOT_PRECISION: tl.constexpr, IS_BF16_EMULATED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate ``n_tiles`` key tiles into one query block (two runs, as :func:`_dkdv_tiles`)."""
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    d_hi = tl.where(has_upper, d_max, DEV_NO_DIAGONAL)
    d_lo = tl.where(has_lower, d_min, -DEV_NO_DIAGONAL)
    for t in range(0, n_tiles):
        start = tl.where(t < n_first, first_n + t * BLOCK_N, second_n + (t - n_first) * BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)
        cols = offs_n
        if IS_INT64:
            cols = offs_n.to(tl.int64)
        k_ptrs = k_head_ptr + cols[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_head_ptr + cols[:, None] * stride_vt + offs_dv[None, :]
        if IS_MASKED:
            mask_n = (offs_n >= n_lo) & (offs_n < n_hi)
            k = tl.load(k_ptrs, mask=mask_n[:, None] & (offs_d[None, :] < D), other=0.0)
            v = tl.load(v_ptrs, mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
        else:
            if IS_D_PADDED:
                k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
            else:
                k = tl.load(k_ptrs)
            if IS_DV_PADDED:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                v = tl.load(v_ptrs)
        if IS_BF16_EMULATED:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            th = tanh_exp2(qk * (scale / softcap))
            p = tl.exp2(th * (softcap * DEV_LOG2E) - lse2[:, None])
        else:
            p = tl.exp2(qk * qk_scale2 - lse2[:, None])
        if IS_MASKED:
            # Keys outside [n_lo, n_hi) were loaded as zeros: mask them with the rows and diagonals.
            p = tl.where(row_cells(offs_m, offs_n, (offs_m >= qs) & (offs_m < qe), n_lo, n_hi, d_lo, d_hi), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - th * th)
        dq += tl.dot(cast_rounded(ds, k.dtype, IS_BF16_EMULATED), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["Tq", "Tk", "Hq", "G", "D", "DV"])
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, ws_ptr, dq_ptr,
    slices_ptr, block_lo_ptr, block_hi_ptr, block_order_ptr,
    Tq, Tk, Hq, G, D, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_ot, stride_oh, stride_lt, stride_lh, stride_dlt, stride_dlh,
    stride_dqt, stride_dqh,
    scale, softcap,
    HAS_DLSE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, IS_INT64: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_BF16_EMULATED: tl.constexpr,
    IS_D_PADDED: tl.constexpr, IS_DV_PADDED: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Unpadded head dims as constants, as in the dK/dV kernel.
    if not IS_D_PADDED:
        D = BLOCK_D
    if not IS_DV_PADDED:
        DV = BLOCK_DV
    pid_h, r0, r1, s_lo, s_hi = plan_program(tl.program_id(0), Hq, Tq, block_order_ptr, block_lo_ptr, block_hi_ptr,
                                             SPLIT, BLOCK_M)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < Tq
    rows = offs_m.to(tl.int64)
    h = pid_h.to(tl.int64)
    hk = (pid_h // G).to(tl.int64)
    q = tl.load(q_ptr + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0)
    # Rows no slice covers (lse = -inf) and rows past Tq get lse = +inf: p = 0 there, whatever the
    # tile. Their dO, O and dlse are not loaded (dO = 0, delta = 0), so a NaN in them cannot turn
    # dS = 0 * (dP - delta) into NaN.
    lse = tl.load(lse_ptr + h * stride_lh + rows * stride_lt, mask=mask_m, other=float("-inf")).to(tl.float32)
    covered = lse != float("-inf")
    lse2 = tl.where(covered, lse * DEV_LOG2E, float("inf"))
    mask_do = covered[:, None] & (offs_dv[None, :] < DV)
    do = tl.load(do_ptr + h * stride_doh + rows[:, None] * stride_dot + offs_dv[None, :], mask=mask_do, other=0.0)
    o = tl.load(o_ptr + h * stride_oh + rows[:, None] * stride_ot + offs_dv[None, :], mask=mask_do, other=0.0)
    # The rows' delta, for this program and, through the workspace, for the dK/dV kernel launched after it.
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + h * stride_dlh + rows * stride_dlt, mask=covered, other=0.0).to(tl.float32)
    # The workspace: delta, then lse * log2(e), (Hq, Tq) each.
    tl.store(ws_ptr + h * Tq + offs_m, delta, mask=mask_m)
    tl.store(ws_ptr + (Hq + h) * Tq + offs_m, lse2, mask=mask_m)
    if IS_BF16_EMULATED:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    k_head_ptr = k_ptr + hk * stride_kh
    v_head_ptr = v_ptr + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale2 = scale * DEV_LOG2E

    for s in range(s_lo, s_hi):
        qs, qe, ks, ke, mtype = slice_row(slices_ptr, s)
        has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
        n_lo, n_hi = key_span(r0, r1, qs, qe, ks, ke, mtype)
        # Keys that every row of the block reads form one run [f_lo, f_hi).
        f_lo = tl.where(has_lower, tl.maximum(ks, r1 - 1 + d_min), ks)
        f_hi = tl.where(has_upper, tl.minimum(ke, r0 + d_max + 1), ke)
        f_lo = tl.minimum(tl.maximum(f_lo, n_lo), n_hi)
        f_hi = tl.minimum(tl.maximum(f_hi, f_lo), n_hi)
        rows_inside = (r0 >= qs) & (r1 <= qe)
        f_lo = tl.where(rows_inside, f_lo, n_hi)
        f_hi = tl.where(rows_inside, f_hi, n_hi)
        n_full = (f_hi - f_lo) // BLOCK_N
        n_pre = tl.cdiv(f_lo - n_lo, BLOCK_N)
        post = f_lo + n_full * BLOCK_N
        n_post = tl.cdiv(n_hi - post, BLOCK_N)
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_head_ptr, v_head_ptr,
            f_lo, n_full, f_lo, n_full, n_lo, n_hi,
            offs_m, offs_d, offs_dv, stride_kt, stride_vt,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            False, HAS_SOFTCAP, IS_D_PADDED, IS_DV_PADDED, IS_INT64, DOT_PRECISION, IS_BF16_EMULATED, BLOCK_N,
        )
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_head_ptr, v_head_ptr,
            f_lo - n_pre * BLOCK_N, n_pre, post, n_pre + n_post, n_lo, n_hi,
            offs_m, offs_d, offs_dv, stride_kt, stride_vt,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            True, HAS_SOFTCAP, IS_D_PADDED, IS_DV_PADDED, IS_INT64, DOT_PRECISION, IS_BF16_EMULATED, BLOCK_N,
        )

    dq = dq * scale
    tl.store(dq_ptr + h * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :],
             cast_rounded(dq, dq_ptr.dtype.element_ty, IS_BF16_EMULATED), mask=mask_m[:, None] & (offs_d[None, :] < D))


@dataclass(frozen=True)
class BwdConfig:
    """Launch shape of the two gradient kernels.

    The dK/dV kernel owns ``kv_block_n`` keys and walks rows ``kv_block_m`` at
    a time (the Gluon one, with 64-row tiles and a padded head dim of 128,
    or 128-row tiles at 64, holds their scores by rows); the dQ kernel owns ``q_block_m`` rows and
    walks keys ``q_block_n`` at a time. Chosen from the head dims and dtype
    only (never from the mask), so that a mask change cannot change the
    accumulation order. The owned
    blocks (``kv_block_n``, ``q_block_m``) divide the plan's block.
    """

    kv_block_m: int
    kv_block_n: int
    kv_warps: int
    kv_stages: int
    q_block_m: int
    q_block_n: int
    q_warps: int
    q_stages: int
    # The dK/dV (dQ) kernel is the Hopper one of kernels/backward_sm90.py (Gluon): needs a
    # compute-capability-9 GPU and kv_block_n (q_block_m) 128. Calls it cannot take (fp32, padded
    # head dims other than 64/128, views not 16-byte aligned) run the Triton kernel.
    gluon_dkdv: bool = False
    gluon_dq: bool = False
    # The Gluon kernels launch one program per SM, each walking several of the Triton grid's work
    # items (docs/design.md, "The Hopper backward"); the Triton kernels keep their grid.
    persistent: bool = False
    # With persistent: the programs take their next work item from a counter shared by the launch as they
    # finish one (the same list and order; no fixed share per program, which leaves some programs idle
    # while others still work when the items' costs differ: docs/design.md, "Dynamic schedule").
    dynamic: bool = False
    # With dynamic: each launch takes the counter's order only when the slice where the mask's work is has at
    # most constants.BWD_DYNAMIC_MAX_LEN tokens along each kernel's major axis (queries for dQ, keys for
    # dK/dV), else the fixed share's items (docs/design.md, "Dynamic schedule").
    adaptive: bool = False
    # One key-major Triton launch that also accumulates dQ, in turns (kernels/backward_fused.py): five
    # matmuls per tile instead of seven, the same bits on every run. Opt-in (slower than the default on the
    # H200, BENCHMARKS.md); takes the dK/dV fields' tiles (kv_block_m rows, kv_block_n keys) and none of
    # the dQ fields.
    fused_dq: bool = False
    # The query heads of each GQA group split into this many chunks for the dK/dV kernel: each chunk is a work
    # item of its own (more items when key blocks x KV heads are few, as with one KV head at short T), its
    # heads summed into float32 partial dK/dV that one fixed-shape reduction adds afterwards. Must divide the
    # group; 1 never splits. A call without a config picks it from the shapes (kv_head_chunks_for), a config
    # passed in is taken as it is. Deterministic either way, but the bits of dK/dV depend on it.
    kv_head_chunks: int = 1
    # The Gluon kernels mask an edge tile by one interval per row or key, one unsigned compare per cell, instead
    # of the four inequalities per cell (the same cells; the Triton kernels' form; docs/design.md, "Edge tiles").
    row_intervals: bool = False

    def __post_init__(self):
        for f in fields(self):
            if f.name in ("gluon_dkdv", "gluon_dq", "persistent", "dynamic", "adaptive", "fused_dq", "row_intervals"):
                if not isinstance(getattr(self, f.name), bool):
                    raise ValueError(f"BwdConfig.{f.name} must be a bool, got {getattr(self, f.name)!r}")
                continue
            x = getattr(self, f.name)
            if not isinstance(x, int) or x <= 0:
                raise ValueError(f"BwdConfig.{f.name} must be a positive int, got {x!r}")
            if "block" in f.name and (x < 16 or x & (x - 1)):
                raise ValueError(f"BwdConfig.{f.name} must be a power of two >= 16, got {x}")
        plan_split(self.kv_block_n)
        plan_split(self.q_block_m)
        if self.gluon_dkdv and self.kv_block_n != 128:
            raise ValueError(f"BwdConfig.gluon_dkdv needs kv_block_n=128, got {self.kv_block_n}")
        if self.gluon_dq and self.q_block_m != 128:
            raise ValueError(f"BwdConfig.gluon_dq needs q_block_m=128, got {self.q_block_m}")
        if self.fused_dq and (self.gluon_dkdv or self.gluon_dq):
            raise ValueError("BwdConfig.fused_dq runs a Triton kernel: set gluon_dkdv and gluon_dq to False")
        if self.fused_dq and self.kv_head_chunks != 1:
            raise ValueError("BwdConfig.kv_head_chunks applies to the dK/dV kernel of the two-launch backward: "
                             "leave it 1 with fused_dq")
        if self.persistent and not (self.gluon_dkdv or self.gluon_dq):
            raise ValueError("BwdConfig.persistent applies to the Gluon kernels only: set gluon_dkdv or gluon_dq "
                             "too, or leave persistent False")
        if self.dynamic and not self.persistent:
            raise ValueError("BwdConfig.dynamic schedules a persistent grid: set persistent too, or leave dynamic "
                             "False")
        if self.row_intervals and not (self.gluon_dkdv or self.gluon_dq):
            raise ValueError("BwdConfig.row_intervals applies to the Gluon kernels (the Triton ones always use them): "
                             "set gluon_dkdv or gluon_dq too, or leave row_intervals False")
        if self.adaptive and not self.dynamic:
            raise ValueError("BwdConfig.adaptive chooses per launch whether the dynamic schedule takes the counter: "
                             "set dynamic (and persistent) too, or leave adaptive False")


def default_config(D: int, Dv: int, dtype: torch.dtype, device: torch.device, *, softcap: bool = False,
                   short_slices: bool = False) -> BwdConfig:
    """The launch shape used for head dims ``D``/``Dv`` and ``dtype`` on ``device`` (``softcap``: whether the
    call has one; it changes only tile shapes that give the same bits; ``short_slices``: the mask's slots are
    short on average, :func:`flashrange.constants.has_short_slices`, which may change the schedule on Hopper,
    not the bits)."""
    cuda = device.type == "cuda"
    return _default_config(D, Dv, dtype, cuda, cuda and _has_gluon_sm90(device.index), softcap, short_slices)


# Set when a Gluon backward kernel failed to build here: every later call takes the Triton kernels.
_GLUON_FAILURES = []


@functools.lru_cache(maxsize=None)
def _has_gluon_sm90(device_index) -> bool:
    """Whether the Hopper backward kernels can run on this device (and have not failed to build here)."""
    return not _GLUON_FAILURES and gluon_sm90_ready(device_index)


@functools.lru_cache(maxsize=None)
def _default_config(D: int, Dv: int, dtype: torch.dtype, cuda: bool, hopper: bool, softcap: bool = False,
                    short_slices: bool = False) -> BwdConfig:
    if not cuda:
        # The interpreter: small tiles, so that small test shapes still cross
        # several tiles, masked and unmasked.
        return BwdConfig(32, 32, 4, 1, 32, 32, 4, 1)
    d = max(D, Dv)
    if Dv > 256:
        # Wide values (D <= 64): dV and the dO tiles are the large operands; small
        # tiles over 8 warps keep them in registers. Not timed.
        return BwdConfig(16, 32, 8, 1, 32, 16, 8, 1)
    # d = 128: the fastest of the shapes timed on an H200 (flashrange bench --sweep);
    # other head dims: shapes whose offline sm_90 builds fit in 255 registers
    # without spilling (d = 256 spills a little), not timed.
    if dtype == torch.float32:
        return BwdConfig(32, 64, 4, 2, 64, 32, 4, 2) if d <= 128 else BwdConfig(16, 32, 4, 1, 32, 16, 4, 1)
    if d <= 64:
        # On Hopper both Gluon kernels, the dK/dV one walking 64-row query tiles: faster than
        # the Triton ones on every mask timed (BENCHMARKS.md, seventh and tenth sessions); the
        # dQ one walking 128-key tiles (the same bits as 64-key tiles, whose matmuls add in the same
        # order; faster on both masks timed, eleventh session) unless there is a softcap, whose
        # build with 128-key tiles spills far more (tests/sm90_builds.py). The Triton dQ kernel
        # keeps 64-key tiles (not timed with 128). Short slots on average take the dynamic schedule, as at
        # head dim 128 (same bits): 20% faster on 16 documents in 32k, level on 128 (twenty-seventh session).
        gluon = hopper and dtype.itemsize == 2 and pad_dim(D) == pad_dim(Dv) == 64
        return BwdConfig(64, 128, 8, 3, 128, 128 if gluon and not softcap else 64, 8, 3, gluon_dkdv=gluon,
                         gluon_dq=gluon, persistent=gluon, dynamic=gluon and short_slices)
    if d <= 128:
        # Padded to 128 on Hopper: the Gluon kernels (faster on every mask timed but dense
        # full in the sixth session, and 12-18% faster since, BENCHMARKS.md tenth session).
        # Their dK/dV kernel walks 64-row tiles, which it holds by rows (kernels/backward_sm90.py):
        # the same bits as 32-row tiles and faster on every mask and head dim timed (D = Dv = 128
        # in the eleventh session; D = 96, D = 64 with Dv = 128 and D = 128 with Dv = 64 in the
        # twelfth). The Triton kernels keep 32-row tiles. Short slots on average take the dynamic schedule
        # (same bits): 8-15% faster on 16 and 128 documents, 2-3% slower on single long slices (twenty-fifth
        # session); its adaptive variant, slower than both on full masks, is not used.
        gluon = hopper and dtype.itemsize == 2 and max(pad_dim(D), pad_dim(Dv)) == 128
        return BwdConfig(64 if gluon else 32, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=gluon, gluon_dq=gluon,
                         persistent=gluon, dynamic=gluon and short_slices)
    return BwdConfig(16, 64, 8, 2, 64, 32, 8, 2)


def range_attention_backward_triton(
    dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale=None, softcap=0.0, dlse=None,
    *, plan=None, config: BwdConfig | None = None,
):
    """Gradients of range attention on the GPU (or under ``TRITON_INTERPRET=1``).

    Same semantics and signature as
    :func:`flashrange.reference.range_attention_backward`:
    `dout`, `out`: `(Tq, Hq, Dv)`; `q`: `(Tq, Hq, D)`; `k`: `(Tk, Hkv, D)`;
    `v`: `(Tk, Hkv, Dv)`; `lse`: `(Tq, Hq)` float32 from the forward; `dlse`:
    optional `(Tq, Hq)` gradient of `lse`; `q_ranges`, `k_ranges`: `(S, 2)`
    int32; `mask_types`: `(S,)` int32. Returns `(dq, dk, dv)` in the dtypes of
    `q, k, v`. Deterministic (no atomics), no host synchronisation, two kernel
    launches (dQ, then dK/dV), extra memory O((Tq + Tk) * H + S); with
    ``config.fused_dq``, one launch that also accumulates dQ in turns
    (:mod:`flashrange.kernels.backward_fused`: deterministic too, O(Tq * H * D) more memory). `plan`: the
    mask's :class:`~flashrange.plan.RangePlan` (the forward's; built here when
    ``None``). `config` overrides :func:`default_config`.
    """
    args = (dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse)
    try:
        return _backward(*args, plan, config)
    except _GluonBuildError:
        # A Gluon kernel did not build (warned once): this call, as every later one, runs the Triton
        # kernels with their own default tiles (which the Gluon defaults' need not be).
        return _backward(*args, plan, None)


class _GluonBuildError(Exception):
    """A default Gluon backward kernel failed to build in this call (see ``_disable_gluon``)."""


def _backward(dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse, plan, config):
    _check_shapes(dout, q, k, v, out, lse, dlse)
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    if Tq == 0 or Tk == 0 or Hq == 0 or D == 0 or Dv == 0 or mask_types.numel() == 0:
        return _zeros(q, k, v)
    if config is None:
        cfg = default_config(D, Dv, q.dtype, q.device, softcap=softcap != 0,
                             short_slices=has_short_slices(Tq, Tk, mask_types.shape[0]))
    elif isinstance(config, BwdConfig):
        cfg = config
        device_index = q.device.index if q.device.type == "cuda" else None
        if (cfg.gluon_dkdv or cfg.gluon_dq) and not _has_gluon_sm90(device_index):
            raise ValueError(
                "BwdConfig.gluon_dkdv / gluon_dq select the Hopper (Gluon) backward kernels: they need a "
                "compute-capability-9 GPU and a Triton with Gluon's Hopper ops (and had not failed to build "
                "here); set both to False for the Triton kernels")
    else:
        raise TypeError(f"config must be a BwdConfig, got {type(config).__name__}")
    q, k, v, dout, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, dout, out))
    gluon = (cfg.gluon_dq or cfg.gluon_dkdv) and _gluon_takes(q, k, v, dout)
    if config is None and (cfg.gluon_dq or cfg.gluon_dkdv) and not gluon:
        # Views the Gluon kernels cannot take: the Triton kernels with their own default tiles.
        cfg = _default_config(D, Dv, q.dtype, True, False, softcap != 0)
    q_split, dq_meta, kv_split, dkdv_meta = _static_args(D, Dv, q.dtype, cfg, interpreting())
    scale = resolve_scale(softmax_scale, D)
    softcap = float(softcap)
    has_softcap = softcap > 0.0
    if not has_softcap:
        softcap = 1.0  # never read; keeps the division in the kernels' dead branch finite
    dev = q.device
    # Triton launches on the current device; the inputs may live on another one.
    other_device = dev.type == "cuda" and dev.index != torch.cuda.current_device()
    with torch.cuda.device(dev) if other_device else contextlib.nullcontext():
        if plan is None:
            plan = build_plan(q_ranges, k_ranges, mask_types, Tq, Tk)
        if cfg.fused_dq:
            dot_prec, emu_bf16 = dkdv_meta[:2]
            dq, dk, dv, _ = fused_backward(
                dout, q, k, v, out, lse, dlse, plan, scale, softcap if has_softcap else 0.0,
                block_m=cfg.kv_block_m, block_n=cfg.kv_block_n, num_warps=cfg.kv_warps, num_stages=cfg.kv_stages,
                dot_precision=dot_prec, bf16_emulated=emu_bf16, block_d=pad_dim(D), block_dv=pad_dim(Dv),
                max_spins=1 if interpreting() else MAX_SPINS_GPU)
            return dq, dk, dv
        # Row offsets inside the tile loops stay int32 unless some operand they walk (q, dO: dK/dV; k, v: dQ)
        # has an element offset, strides included (a view into a fused qkv buffer), that reaches 2**31. The
        # per-program loads and stores (O, lse, dlse, dQ, dK, dV, the workspace) use 64-bit offsets always.
        row64 = needs_int64(q, k, v, dout)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        # delta (plane 0) and lse * log2(e) (plane 1), (Hq, Tq) each: written by the dQ kernel, read by dK/dV.
        ws = _workspace(Hq, Tq, dev)
        has_dlse = dlse is not None
        if not has_dlse:
            dlse = lse  # never read
        G = Hq // Hkv
        # One stride() call per tensor (each is a call into torch).
        sq, sk, sv, sdo, so, sl, sdl = (t.stride() for t in (q, k, v, dout, out, lse, dlse))
        sdq, sdk, sdv = dq.stride(), dk.stride(), dv.stride()
        dq_args = (
            q, k, v, dout, out, lse, dlse, ws, dq,
            plan.q_slices, plan.q_block_lo, plan.q_block_hi, plan.q_block_order,
            Tq, Tk, Hq, G, D, Dv,
            sq[0], sq[1], sk[0], sk[1], sv[0], sv[1],
            sdo[0], sdo[1], so[0], so[1], sl[0], sl[1], sdl[0], sdl[1], sdq[0], sdq[1],
            scale, softcap,
            has_dlse, has_softcap, row64, *dq_meta,
        )
        dq_grid = (plan.q_block_order.shape[0] * q_split * Hq,)
        n_kv_items = plan.k_block_order.shape[0] * kv_split * Hkv
        if config is None:
            chunks = kv_head_chunks_for(n_kv_items, G, _processors(dev))
        else:
            chunks = _check_chunks(cfg.kv_head_chunks, G)
        if chunks > 1:
            # Each KV head repeated once per chunk of its group's query heads: the kernel sees Hkv * chunks
            # heads of G / chunks query heads each, and writes float32 partial dK/dV per (head, chunk).
            kx, vx = (t.unsqueeze(2).expand(Tk, Hkv, chunks, t.shape[2]).reshape(Tk, Hkv * chunks, t.shape[2])
                      for t in (k, v))
            dkx = torch.empty(Tk, Hkv * chunks, D, dtype=torch.float32, device=dev)
            dvx = torch.empty(Tk, Hkv * chunks, Dv, dtype=torch.float32, device=dev)
            skx, svx, sdkx, sdvx = kx.stride(), vx.stride(), dkx.stride(), dvx.stride()
            row64 = row64 or needs_int64(kx, vx)
        else:
            kx, vx, dkx, dvx, skx, svx, sdkx, sdvx = k, v, dk, dv, sk, sv, sdk, sdv
        dkdv_args = (
            q, kx, vx, dout, ws, dkx, dvx,
            plan.k_slices, plan.k_block_lo, plan.k_block_hi, plan.k_block_order,
            Tq, Tk, Hq, Hkv * chunks, G // chunks, D, Dv,
            sq[0], sq[1], skx[0], skx[1], svx[0], svx[1],
            sdo[0], sdo[1], sdkx[0], sdkx[1], sdvx[0], sdvx[1],
            scale, softcap,
            has_softcap, row64, *dkdv_meta,
        )
        dkdv_grid = (n_kv_items * chunks,)
        # A dynamic schedule's counters of taken work items, one per Gluon kernel, zeroed per call.
        dynamic = gluon and cfg.dynamic
        tickets = _tickets(dev) if dynamic else None
        # dQ first: it writes the workspace that dK/dV reads (both kernels write the same one).
        for use_gluon, name, grid, args, stages, warps, kv, ticket in (
            (gluon and cfg.gluon_dq, "bwd_dq_sm90_kernel", dq_grid, dq_args, cfg.q_stages, cfg.q_warps, (k, v),
             tickets[0:1] if dynamic else ws),
            (gluon and cfg.gluon_dkdv, "bwd_dkdv_sm90_kernel", dkdv_grid, dkdv_args, cfg.kv_stages, cfg.kv_warps,
             (kx, vx), tickets[1:2] if dynamic else ws),
        ):
            triton_kernel = _bwd_dq_kernel if name == "bwd_dq_sm90_kernel" else _bwd_dkdv_kernel
            if use_gluon:
                try:
                    ensure_tma_allocator()
                    # The Triton kernel below (a fallback) keeps the full grid.
                    persistent = cfg.persistent and dev.type == "cuda"
                    gluon_grid = (min(grid[0], sm_count(dev.index)),) if persistent else grid
                    # STAGES, NUM_WARPS, HAS_PACKED_HEADS, IS_DYNAMIC, IS_ADAPTIVE, IS_ROW_INTERVAL, ticket_ptr
                    # (the workspace stands in for a counter the kernel does not touch)
                    launch(_gluon_kernel(name), gluon_grid,
                           args + (stages, 4, packed_heads(q, *kv, dout), dynamic, dynamic and cfg.adaptive,
                                   cfg.row_intervals, ticket),
                           num_warps=4, maxnreg=WS_MAXNREG)
                    continue
                except Exception as e:  # noqa: BLE001 - a Gluon kernel that does not build; others re-raise
                    if config is not None:
                        raise
                    _disable_gluon(e)
                    raise _GluonBuildError from e
            launch(triton_kernel, grid, args, num_warps=warps, num_stages=stages)
        if chunks > 1:
            # The chunks' partial sums added by one reduction of a fixed shape: the same order, so the same bits,
            # on every run.
            dk.copy_(dkx.view(Tk, Hkv, chunks, D).sum(2))
            dv.copy_(dvx.view(Tk, Hkv, chunks, Dv).sum(2))
    return dq, dk, dv


def _tickets(dev):
    """A dynamic schedule's counters of taken work items, dQ's then dK/dV's, zeroed for one call."""
    return torch.zeros(2, dtype=torch.int32, device=dev)


def kv_head_chunks_for(n_items: int, group: int, n_sms: int) -> int:
    """The chunks a default call splits each GQA group into for the dK/dV kernel (``BwdConfig.kv_head_chunks``):
    the fewest (a divisor of ``group``, the query heads per KV head) that give the kernel's ``n_items`` work
    items (key blocks x KV heads) at least one per streaming multiprocessor of ``n_sms``, or ``group`` when
    none does; 1 without a multiprocessor count (the interpreter). From shapes and the device only, never the
    mask, so a mask change cannot change the bits (docs/design.md, "Backward")."""
    if n_sms <= 0:
        return 1
    for chunks in range(1, group + 1):
        if group % chunks == 0 and n_items * chunks >= n_sms:
            return chunks
    return group


def _processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 0 elsewhere."""
    return sm_count(device.index) if device.type == "cuda" else 0


def _check_chunks(chunks: int, G: int) -> int:
    """``BwdConfig.kv_head_chunks`` for a group of ``G`` query heads, checked."""
    if G % chunks:
        raise ValueError(f"BwdConfig.kv_head_chunks={chunks} must divide the query heads per KV head, {G}: "
                         "pick a divisor of Hq // Hkv (1 never splits)")
    return chunks


def _gluon_takes(q, k, v, dout) -> bool:
    """Whether the Gluon kernels can take these tensors (else a Gluon config runs the Triton kernels)."""
    if q.dtype.itemsize != 2 or pad_dim(q.shape[2]) not in (64, 128) or pad_dim(v.shape[2]) not in (64, 128):
        return False
    return all(tma_aligned(t) for t in (q, k, v, dout))


@functools.lru_cache(maxsize=None)
def _gluon_kernel(name: str):
    from . import backward_sm90

    return getattr(backward_sm90, name)


def _disable_gluon(error: Exception) -> None:
    """A Gluon backward kernel failed to build: say so once; every later call takes the Triton kernels."""
    _GLUON_FAILURES.append(f"{type(error).__name__}: {error}")
    for cached in (_has_gluon_sm90, _default_config):
        cached.cache_clear()
    warn_gluon_fallback("backward", error, stacklevel=6)


def _workspace(Hq, Tq, device):
    """``(2, Hq, Tq)`` float32: delta, then lse * log2(e); every entry is written by the dQ kernel."""
    return torch.empty(2, Hq, Tq, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=256)
def _static_args(D, Dv, dtype, cfg, interp):
    """``(SPLIT, constexprs)`` of the dQ kernel, then of the dK/dV kernel; constexprs: those after ``IS_INT64``.

    They depend only on head dims, dtype, config and the interpreter, so they are worked out once.
    """
    emu_bf16 = dtype == torch.bfloat16 and interp
    dot_prec = "ieee" if dtype == torch.float32 or emu_bf16 else "tf32"
    block_d, block_dv = pad_dim(D), pad_dim(Dv)
    # DOT_PRECISION, IS_BF16_EMULATED, IS_D_PADDED, IS_DV_PADDED, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV
    common = (dot_prec, emu_bf16, block_d != D, block_dv != Dv)
    q_split, kv_split = plan_split(cfg.q_block_m), plan_split(cfg.kv_block_n)
    dq_meta = common + (q_split, cfg.q_block_m, cfg.q_block_n, block_d, block_dv)
    dkdv_meta = common + (kv_split, cfg.kv_block_m, cfg.kv_block_n, block_d, block_dv)
    return q_split, dq_meta, kv_split, dkdv_meta


def _zeros(q, k, v):
    return (torch.zeros_like(q, memory_format=torch.contiguous_format),
            torch.zeros_like(k, memory_format=torch.contiguous_format),
            torch.zeros_like(v, memory_format=torch.contiguous_format))


def _check_shapes(dout, q, k, v, out, lse, dlse):
    for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be (T, H, D), got shape {tuple(t.shape)}")
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    if k.shape != (Tk, Hkv, D):
        raise ValueError(f"k must have shape {(Tk, Hkv, D)}, got {tuple(k.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if dout.shape != (Tq, Hq, Dv) or out.shape != (Tq, Hq, Dv):
        raise ValueError(f"dout and out must have shape {(Tq, Hq, Dv)}, got {tuple(dout.shape)}, {tuple(out.shape)}")
    if lse.shape != (Tq, Hq) or (dlse is not None and dlse.shape != (Tq, Hq)):
        raise ValueError(f"lse and dlse must have shape {(Tq, Hq)}")
    if not kernel_head_dims_ok(max(D, 1), max(Dv, 1)):
        raise ValueError(
            f"head dims up to {MAX_HEAD_DIM} (and Dv up to {MAX_HEAD_DIM_V} with D <= {WIDE_V_MAX_HEAD_DIM}) "
            f"are supported, got D={D}, Dv={Dv}"
        )
