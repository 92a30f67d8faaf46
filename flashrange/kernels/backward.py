"""Triton backward of range attention: dQ, dK, dV (DESIGN §4).

Three launches, no atomics, so every gradient is bitwise reproducible:

1. ``_bwd_preprocess``: per row and head, ``delta = rowsum(dO * O) - dlse``
   and ``lse * log2(e)`` (``+inf`` where ``lse = -inf``, so ``exp2(s - lse)``
   is exactly 0 on rows no slice covers), both laid out ``(Hq, Tq)``.
2. ``_bwd_dkdv_kernel``: key-block-major. A program owns ``BLOCK_N`` keys of
   one key/value head and walks, in the plan's canonical slice order, every
   slice that reaches those keys, every query head of the GQA group and every
   query tile of the slice's rows; it writes dK and dV once.
3. ``_bwd_dq_kernel``: query-block-major. A program owns ``BLOCK_M`` rows of
   one query head and walks every slice and key tile that the rows reach; it
   writes dQ once.

Each slice is processed on its own (a cell covered twice counts twice). Along
the walked axis the tiles of one slice are laid out around the run of tiles
that the slice covers entirely: those skip the element mask and the bounds
checks; the few tiles on the slice's edges and diagonals are masked. The
accumulation order depends only on the plan's canonical slice order, hence
not on the order of the slice list nor on empty slices in it.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..plan import build_plan
from ._mask import key_span, query_span, slice_diagonals

__all__ = ["range_attention_backward_triton", "BwdConfig", "default_config"]


@triton.jit
def _tanh(x):
    # Portable across Triton versions (no libdevice); saturates to +-1 cleanly.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _cast(x, dtype: tl.constexpr, EMU_BF16: tl.constexpr):
    """``x.to(dtype)``; with ``EMU_BF16``, float32 rounded to bfloat16 values instead.

    The Triton interpreter cannot multiply bfloat16 and truncates when it
    converts to it; emulating keeps the GPU's numerics (operands rounded to
    nearest even, float32 accumulation) in CPU tests.
    """
    if EMU_BF16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype)


# Sizes and head counts vary from call to call; specializing on them (== 1,
# divisible by 16) would build a new kernel for each combination.
@triton.jit(do_not_specialize=["Tq", "DV"])
def _bwd_preprocess(
    O, DO, LSE, DLSE, DELTA, LSE2,
    Tq, DV,
    stride_ot, stride_oh, stride_dot, stride_doh,
    stride_lt, stride_lh, stride_dlt, stride_dlh,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < Tq
    mask = mask_m[:, None] & (offs_d[None, :] < DV)
    rows = offs_m.to(tl.int64)
    o = tl.load(O + pid_h * stride_oh + rows[:, None] * stride_ot + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + pid_h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + pid_h * stride_dlh + rows * stride_dlt, mask=mask_m, other=0.0).to(tl.float32)
    lse = tl.load(LSE + pid_h * stride_lh + rows * stride_lt, mask=mask_m, other=0.0).to(tl.float32)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + pid_h * Tq + offs_m, delta, mask=mask_m)
    tl.store(LSE2 + pid_h * Tq + offs_m, lse2, mask=mask_m)


@triton.jit
def _dkdv_tiles(
    dk, dv, k, v,
    Q_h, DO_h, LSE2_h, DELTA_h,
    first_m, n_first, second_m, n_tiles, m_lo, m_hi,
    offs_n, offs_d, offs_dv,
    stride_qt, stride_dot,
    qs, qe, ks, ke, mtype,
    D, DV, qk_scale2, scale, softcap,
    IS_MASKED: tl.constexpr, IS_SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr, PAD_DV: tl.constexpr, ROW64: tl.constexpr,
    DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
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
    d_hi = tl.where(has_upper, d_max, 1 << 30)
    d_lo = tl.where(has_lower, d_min, -(1 << 30))
    for t in range(0, n_tiles):
        start = tl.where(t < n_first, first_m + t * BLOCK_M, second_m + (t - n_first) * BLOCK_M)
        offs_m = start + tl.arange(0, BLOCK_M)
        rows = offs_m
        if ROW64:
            rows = offs_m.to(tl.int64)
        q_ptrs = Q_h + rows[:, None] * stride_qt + offs_d[None, :]
        do_ptrs = DO_h + rows[:, None] * stride_dot + offs_dv[None, :]
        if IS_MASKED:
            mask_m = (offs_m >= m_lo) & (offs_m < m_hi)
            q = tl.load(q_ptrs, mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0)
            lse2 = tl.load(LSE2_h + offs_m, mask=mask_m, other=float("inf"))
        else:
            if PAD_D:
                q = tl.load(q_ptrs, mask=offs_d[None, :] < D, other=0.0)
            else:
                q = tl.load(q_ptrs)
            lse2 = tl.load(LSE2_h + offs_m)
        if EMU_BF16:
            q = q.to(tl.float32)
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
        if IS_SOFTCAP:
            th = _tanh(qkT * (scale / softcap))
            pT = tl.exp2(th * (softcap * 1.4426950408889634) - lse2[None, :])
        else:
            pT = tl.exp2(qkT * qk_scale2 - lse2[None, :])
        if IS_MASKED:
            # Rows outside [m_lo, m_hi) (inside the slice's rows) already have
            # p = 0 through lse = +inf; keys and diagonals remain.
            diag = offs_n[:, None] - offs_m[None, :]
            cell = ((offs_n >= ks) & (offs_n < ke))[:, None] & (diag <= d_hi) & (diag >= d_lo)
            pT = tl.where(cell, pT, 0.0)
            do = tl.load(do_ptrs, mask=mask_m[:, None] & (offs_dv[None, :] < DV), other=0.0)
            delta = tl.load(DELTA_h + offs_m, mask=mask_m, other=0.0)
        else:
            if PAD_DV:
                do = tl.load(do_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                do = tl.load(do_ptrs)
            delta = tl.load(DELTA_h + offs_m)
        if EMU_BF16:
            do = do.to(tl.float32)
        dv += tl.dot(_cast(pT, do.dtype, EMU_BF16), do, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dsT = pT * (dpT - delta[None, :])
        if IS_SOFTCAP:
            dsT = dsT * (1.0 - th * th)
        dk += tl.dot(_cast(dsT, q.dtype, EMU_BF16), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=["Tq", "Tk", "Hq", "Hkv", "G", "D", "DV"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV_,
    SLICES, BLOCK_LO, BLOCK_HI, BLOCK_ORDER,
    Tq, Tk, Hq, Hkv, G, D, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, softcap,
    IS_SOFTCAP: tl.constexpr, ROW64: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
    PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Heaviest key blocks first; all heads of one block are neighbours in the grid.
    pid = tl.program_id(0)
    pid_hk = pid % Hkv
    pid_n = tl.load(BLOCK_ORDER + pid // Hkv)
    c0 = pid_n * BLOCK_N
    c1 = tl.minimum(c0 + BLOCK_N, Tk)
    offs_n = c0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_n = offs_n < Tk
    cols = offs_n.to(tl.int64)
    hk = pid_hk.to(tl.int64)
    k = tl.load(K + hk * stride_kh + cols[:, None] * stride_kt + offs_d[None, :],
                mask=mask_n[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + hk * stride_vh + cols[:, None] * stride_vt + offs_dv[None, :],
                mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if EMU_BF16:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale2 = scale * 1.4426950408889634

    s_lo = tl.load(BLOCK_LO + pid_n)
    s_hi = tl.load(BLOCK_HI + pid_n)
    # One loop over (slice, query head of the group): a shallower loop nest
    # keeps fewer values live around the tile loops (registers).
    for sg in range(s_lo * G, s_hi * G):
        s = sg // G
        g = sg - s * G
        qs = tl.load(SLICES + s * 5)
        qe = tl.load(SLICES + s * 5 + 1)
        ks = tl.load(SLICES + s * 5 + 2)
        ke = tl.load(SLICES + s * 5 + 3)
        mtype = tl.load(SLICES + s * 5 + 4)
        has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
        m_lo, m_hi = query_span(c0, c1, qs, qe, ks, ke, mtype)
        # Rows that read every key of the block form one run [f_lo, f_hi).
        f_lo = tl.where(has_upper, tl.maximum(qs, c1 - 1 - d_max), qs)
        f_hi = tl.where(has_lower, tl.minimum(qe, c0 - d_min + 1), qe)
        f_lo = tl.minimum(tl.maximum(f_lo, m_lo), m_hi)
        f_hi = tl.minimum(tl.maximum(f_hi, f_lo), m_hi)
        keys_inside = (c0 >= ks) & (c1 <= ke)
        f_lo = tl.where(keys_inside, f_lo, m_hi)
        f_hi = tl.where(keys_inside, f_hi, m_hi)
        n_full = (f_hi - f_lo) // BLOCK_M
        n_pre = tl.cdiv(f_lo - m_lo, BLOCK_M)
        post = f_lo + n_full * BLOCK_M
        n_post = tl.cdiv(m_hi - post, BLOCK_M)
        h = (pid_hk * G + g).to(tl.int64)
        Q_h = Q + h * stride_qh
        DO_h = DO + h * stride_doh
        LSE2_h = LSE2 + h * Tq
        DELTA_h = DELTA + h * Tq
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, Q_h, DO_h, LSE2_h, DELTA_h,
            f_lo, n_full, f_lo, n_full, m_lo, m_hi,
            offs_n, offs_d, offs_dv, stride_qt, stride_dot,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            False, IS_SOFTCAP, PAD_D, PAD_DV, ROW64, DOT_PREC, EMU_BF16, BLOCK_M,
        )
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, Q_h, DO_h, LSE2_h, DELTA_h,
            f_lo - n_pre * BLOCK_M, n_pre, post, n_pre + n_post, m_lo, m_hi,
            offs_n, offs_d, offs_dv, stride_qt, stride_dot,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            True, IS_SOFTCAP, PAD_D, PAD_DV, ROW64, DOT_PREC, EMU_BF16, BLOCK_M,
        )

    dk = dk * scale
    tl.store(DK + hk * stride_dkh + cols[:, None] * stride_dkt + offs_d[None, :],
             _cast(dk, DK.dtype.element_ty, EMU_BF16), mask=mask_n[:, None] & (offs_d[None, :] < D))
    tl.store(DV_ + hk * stride_dvh + cols[:, None] * stride_dvt + offs_dv[None, :],
             _cast(dv, DV_.dtype.element_ty, EMU_BF16), mask=mask_n[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta,
    K_h, V_h,
    first_n, n_first, second_n, n_tiles, n_lo, n_hi,
    offs_m, offs_d, offs_dv,
    stride_kt, stride_vt,
    qs, qe, ks, ke, mtype,
    D, DV, qk_scale2, scale, softcap,
    IS_MASKED: tl.constexpr, IS_SOFTCAP: tl.constexpr,
    PAD_D: tl.constexpr, PAD_DV: tl.constexpr, ROW64: tl.constexpr,
    DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Accumulate ``n_tiles`` key tiles into one query block (two runs, as :func:`_dkdv_tiles`)."""
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    d_hi = tl.where(has_upper, d_max, 1 << 30)
    d_lo = tl.where(has_lower, d_min, -(1 << 30))
    for t in range(0, n_tiles):
        start = tl.where(t < n_first, first_n + t * BLOCK_N, second_n + (t - n_first) * BLOCK_N)
        offs_n = start + tl.arange(0, BLOCK_N)
        cols = offs_n
        if ROW64:
            cols = offs_n.to(tl.int64)
        k_ptrs = K_h + cols[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = V_h + cols[:, None] * stride_vt + offs_dv[None, :]
        if IS_MASKED:
            mask_n = (offs_n >= n_lo) & (offs_n < n_hi)
            k = tl.load(k_ptrs, mask=mask_n[:, None] & (offs_d[None, :] < D), other=0.0)
            v = tl.load(v_ptrs, mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
        else:
            if PAD_D:
                k = tl.load(k_ptrs, mask=offs_d[None, :] < D, other=0.0)
            else:
                k = tl.load(k_ptrs)
            if PAD_DV:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
            else:
                v = tl.load(v_ptrs)
        if EMU_BF16:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if IS_SOFTCAP:
            th = _tanh(qk * (scale / softcap))
            p = tl.exp2(th * (softcap * 1.4426950408889634) - lse2[:, None])
        else:
            p = tl.exp2(qk * qk_scale2 - lse2[:, None])
        if IS_MASKED:
            # Keys outside [n_lo, n_hi) were loaded as zeros: mask them with the rows and diagonals.
            diag = offs_n[None, :] - offs_m[:, None]
            cell = (((offs_m >= qs) & (offs_m < qe))[:, None] & ((offs_n >= n_lo) & (offs_n < n_hi))[None, :]
                    & (diag <= d_hi) & (diag >= d_lo))
            p = tl.where(cell, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        if IS_SOFTCAP:
            ds = ds * (1.0 - th * th)
        dq += tl.dot(_cast(ds, k.dtype, EMU_BF16), k, input_precision=DOT_PREC)
    return dq


@triton.jit(do_not_specialize=["Tq", "Tk", "Hq", "G", "D", "DV"])
def _bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ,
    SLICES, BLOCK_LO, BLOCK_HI, BLOCK_ORDER,
    Tq, Tk, Hq, G, D, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    scale, softcap,
    IS_SOFTCAP: tl.constexpr, ROW64: tl.constexpr, DOT_PREC: tl.constexpr, EMU_BF16: tl.constexpr,
    PAD_D: tl.constexpr, PAD_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_h = pid % Hq
    pid_m = tl.load(BLOCK_ORDER + pid // Hq)
    r0 = pid_m * BLOCK_M
    r1 = tl.minimum(r0 + BLOCK_M, Tq)
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_m = offs_m < Tq
    rows = offs_m.to(tl.int64)
    h = pid_h.to(tl.int64)
    hk = (pid_h // G).to(tl.int64)
    q = tl.load(Q + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + h * stride_doh + rows[:, None] * stride_dot + offs_dv[None, :],
                 mask=mask_m[:, None] & (offs_dv[None, :] < DV), other=0.0)
    if EMU_BF16:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # Rows past Tq get lse = +inf: p = 0 there, whatever the tile.
    lse2 = tl.load(LSE2 + h * Tq + offs_m, mask=mask_m, other=float("inf"))
    delta = tl.load(DELTA + h * Tq + offs_m, mask=mask_m, other=0.0)
    K_h = K + hk * stride_kh
    V_h = V + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale2 = scale * 1.4426950408889634

    s_lo = tl.load(BLOCK_LO + pid_m)
    s_hi = tl.load(BLOCK_HI + pid_m)
    for s in range(s_lo, s_hi):
        qs = tl.load(SLICES + s * 5)
        qe = tl.load(SLICES + s * 5 + 1)
        ks = tl.load(SLICES + s * 5 + 2)
        ke = tl.load(SLICES + s * 5 + 3)
        mtype = tl.load(SLICES + s * 5 + 4)
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
            dq, q, do, lse2, delta, K_h, V_h,
            f_lo, n_full, f_lo, n_full, n_lo, n_hi,
            offs_m, offs_d, offs_dv, stride_kt, stride_vt,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            False, IS_SOFTCAP, PAD_D, PAD_DV, ROW64, DOT_PREC, EMU_BF16, BLOCK_N,
        )
        dq = _dq_tiles(
            dq, q, do, lse2, delta, K_h, V_h,
            f_lo - n_pre * BLOCK_N, n_pre, post, n_pre + n_post, n_lo, n_hi,
            offs_m, offs_d, offs_dv, stride_kt, stride_vt,
            qs, qe, ks, ke, mtype, D, DV, qk_scale2, scale, softcap,
            True, IS_SOFTCAP, PAD_D, PAD_DV, ROW64, DOT_PREC, EMU_BF16, BLOCK_N,
        )

    dq = dq * scale
    tl.store(DQ + h * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :],
             _cast(dq, DQ.dtype.element_ty, EMU_BF16), mask=mask_m[:, None] & (offs_d[None, :] < D))


class BwdConfig(NamedTuple):
    """Launch shape of the two gradient kernels.

    The dK/dV kernel owns ``kv_block_n`` keys and walks rows ``kv_block_m`` at
    a time; the dQ kernel owns ``q_block_m`` rows and walks keys ``q_block_n``
    at a time. Chosen from the head dims and dtype only (never from the mask),
    so that a mask change cannot change the accumulation order.
    """

    kv_block_m: int
    kv_block_n: int
    kv_warps: int
    kv_stages: int
    q_block_m: int
    q_block_n: int
    q_warps: int
    q_stages: int

    def check(self) -> "BwdConfig":
        for name, x in zip(self._fields, self):
            if not isinstance(x, int) or x <= 0:
                raise ValueError(f"BwdConfig.{name} must be a positive int, got {x!r}")
            if "block" in name and (x < 16 or x & (x - 1)):
                raise ValueError(f"BwdConfig.{name} must be a power of two >= 16, got {x}")
        return self


def default_config(D: int, Dv: int, dtype: torch.dtype, device: torch.device) -> BwdConfig:
    """The launch shape used for head dims ``D``/``Dv`` and ``dtype`` on ``device``."""
    if device.type != "cuda":
        # The interpreter: small tiles, so that small test shapes still cross
        # several tiles, masked and unmasked.
        return BwdConfig(32, 32, 4, 1, 32, 32, 4, 1)
    d = max(D, Dv)
    # d = 128: the fastest of the shapes timed on an H200 (Triton 3.6; causal
    # 32k: 29.6 ms against 33.4 ms for (64, 128, 8, 2, 128, 32, 8, 3) and 38.8 ms
    # with 2 stages). Other head dims: shapes whose offline sm_90 builds fit in
    # 255 registers without spilling (d = 256 spills a little), not timed.
    if dtype == torch.float32:
        return BwdConfig(32, 64, 4, 2, 64, 32, 4, 2) if d <= 128 else BwdConfig(16, 32, 4, 1, 32, 16, 4, 1)
    if d <= 64:
        return BwdConfig(64, 128, 8, 3, 128, 64, 8, 3)
    if d <= 128:
        return BwdConfig(32, 128, 8, 3, 128, 64, 8, 3)
    return BwdConfig(16, 64, 8, 2, 64, 32, 8, 2)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _block_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def range_attention_backward_triton(
    dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale=None, softcap=0.0, dlse=None,
    *, config: BwdConfig | None = None,
):
    """Gradients of range attention on the GPU (or under ``TRITON_INTERPRET=1``).

    Same semantics and signature as
    :func:`flashrange.reference.range_attention_backward`:
    `dout`, `out`: `(Tq, Hq, Dv)`; `q`: `(Tq, Hq, D)`; `k`: `(Tk, Hkv, D)`;
    `v`: `(Tk, Hkv, Dv)`; `lse`: `(Tq, Hq)` float32 from the forward; `dlse`:
    optional `(Tq, Hq)` gradient of `lse`; `q_ranges`, `k_ranges`: `(S, 2)`
    int32; `mask_types`: `(S,)` int32. Returns `(dq, dk, dv)` in the dtypes of
    `q, k, v`. Deterministic (no atomics), no host synchronisation, extra
    memory O((Tq + Tk) * H + S). `config` overrides :func:`default_config`.
    """
    st = _prepare(dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse, config)
    if st is None:
        return _zeros(q, k, v)
    _launch_preprocess(st)
    _launch_dkdv(st)
    _launch_dq(st)
    return st.dq, st.dk, st.dv


class _State:
    """Everything the three launches share (tensors made contiguous, scalars, config)."""

    __slots__ = ("dout", "q", "k", "v", "out", "lse", "dlse", "q_ranges", "k_ranges", "mask_types", "scale",
                 "softcap", "cfg", "dq", "dk", "dv", "delta", "lse2", "row64", "emu_bf16", "dot_prec")


def _zeros(q, k, v):
    return (torch.zeros_like(q, memory_format=torch.contiguous_format),
            torch.zeros_like(k, memory_format=torch.contiguous_format),
            torch.zeros_like(v, memory_format=torch.contiguous_format))


def _prepare(dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse, config):
    """Checks shapes and allocates outputs; ``None`` when there is nothing to compute."""
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
    if max(D, Dv) > 256:
        raise ValueError(f"head dims up to 256 are supported, got D={D}, Dv={Dv}")
    S = mask_types.reshape(-1).shape[0]
    if Tq == 0 or Tk == 0 or Hq == 0 or S == 0 or D == 0 or Dv == 0:
        return None

    def last_dim_contiguous(t):
        return t if t.stride(-1) == 1 else t.contiguous()

    st = _State()
    st.q, st.k, st.v, st.dout, st.out = (last_dim_contiguous(t) for t in (q, k, v, dout, out))
    st.lse, st.dlse = lse, dlse
    st.q_ranges, st.k_ranges, st.mask_types = q_ranges, k_ranges, mask_types
    st.scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    st.softcap = float(softcap)
    dev = q.device
    st.cfg = BwdConfig(*config).check() if config is not None else default_config(D, Dv, q.dtype, dev)
    st.dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    st.dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    st.dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    st.emu_bf16 = q.dtype == torch.bfloat16 and _interpreting()
    st.dot_prec = "ieee" if q.dtype == torch.float32 or st.emu_bf16 else "tf32"
    # Row offsets stay int32 unless some tensor spans 2**31 elements.
    st.row64 = max(t.numel() for t in (q, k, v, dout)) >= 2**31 - 1
    st.delta = torch.empty(Hq, Tq, dtype=torch.float32, device=dev)
    st.lse2 = torch.empty(Hq, Tq, dtype=torch.float32, device=dev)
    return st


def _launch_preprocess(st):
    Tq, Hq, _ = st.q.shape
    Dv = st.v.shape[2]
    out, dout, lse, dlse = st.out, st.dout, st.lse, st.dlse
    PRE_M = 64
    _bwd_preprocess[(triton.cdiv(Tq, PRE_M), Hq)](
        out, dout, lse, dlse if dlse is not None else lse, st.delta, st.lse2,
        Tq, Dv,
        out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        lse.stride(0), lse.stride(1),
        dlse.stride(0) if dlse is not None else 0, dlse.stride(1) if dlse is not None else 0,
        HAS_DLSE=dlse is not None, BLOCK_M=PRE_M, BLOCK_DV=_block_dim(Dv),
    )


def _launch_dkdv(st):
    q, k, v, dout, dk, dv, cfg = st.q, st.k, st.v, st.dout, st.dk, st.dv, st.cfg
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    is_softcap = st.softcap > 0.0
    plan = build_plan(st.q_ranges, st.k_ranges, st.mask_types, Tq, Tk, cfg.kv_block_n, transpose=True)
    n_blocks = plan.block_order.shape[0]
    _bwd_dkdv_kernel[(n_blocks * Hkv,)](
        q, k, v, dout, st.lse2, st.delta, dk, dv,
        plan.slices, plan.block_lo, plan.block_hi, plan.block_order,
        Tq, Tk, Hq, Hkv, Hq // Hkv, D, Dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        st.scale, st.softcap if is_softcap else 1.0,
        IS_SOFTCAP=is_softcap, ROW64=st.row64, DOT_PREC=st.dot_prec, EMU_BF16=st.emu_bf16,
        PAD_D=_block_dim(D) != D, PAD_DV=_block_dim(Dv) != Dv,
        BLOCK_M=cfg.kv_block_m, BLOCK_N=cfg.kv_block_n, BLOCK_D=_block_dim(D), BLOCK_DV=_block_dim(Dv),
        num_warps=cfg.kv_warps, num_stages=cfg.kv_stages,
    )


def _launch_dq(st):
    q, k, v, dout, dq, cfg = st.q, st.k, st.v, st.dout, st.dq, st.cfg
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    is_softcap = st.softcap > 0.0
    plan = build_plan(st.q_ranges, st.k_ranges, st.mask_types, Tq, Tk, cfg.q_block_m)
    n_blocks = plan.block_order.shape[0]
    _bwd_dq_kernel[(n_blocks * Hq,)](
        q, k, v, dout, st.lse2, st.delta, dq,
        plan.slices, plan.block_lo, plan.block_hi, plan.block_order,
        Tq, Tk, Hq, Hq // Hkv, D, Dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
        st.scale, st.softcap if is_softcap else 1.0,
        IS_SOFTCAP=is_softcap, ROW64=st.row64, DOT_PREC=st.dot_prec, EMU_BF16=st.emu_bf16,
        PAD_D=_block_dim(D) != D, PAD_DV=_block_dim(Dv) != Dv,
        BLOCK_M=cfg.q_block_m, BLOCK_N=cfg.q_block_n, BLOCK_D=_block_dim(D), BLOCK_DV=_block_dim(Dv),
        num_warps=cfg.q_warps, num_stages=cfg.q_stages,
    )
