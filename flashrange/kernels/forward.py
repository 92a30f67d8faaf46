"""Triton forward kernel of range attention (docs/design.md §6): the CUDA slot of ``flashrange::fwd``.

One program owns one block of ``BLOCK_M`` query rows of one query head. It
walks the slices of its window in the plan's query-major half
(:class:`flashrange.plan.RangePlan`),
key tile by key tile, with a single online softmax (base 2, ``log2(e)``
folded into the scale), and writes ``out`` and the float32 ``lse`` once: no
atomics, no second pass.

Per slice the key tiles run in one loop, in key order. The tiles entirely
inside the slice (a run found in closed form) skip the element mask by a
runtime branch; the edge tiles on the slice's sides and diagonals take it.
One loop rather than one per kind keeps the next tile's loads in flight
across the change of kind, which is most of the time of short documents.

Launch configurations live in :data:`FWD_CONFIGS`, a named list; a default
is fixed per head dim, dtype and, on Hopper, whether the mask's slots are
short on average (:func:`default_config`; the shapes alone decide, and every
choice gives the same bits) so that results are bitwise reproducible across
processes, the plan's block follows the config without any autotuning round-trip, and the launcher never syncs with the host
(CUDA-graph capture, ``set_sync_debug_mode("error")``). Hopper features
(device-side tensor descriptors, warp specialization) are used only where the
installed Triton has them and the interpreter is off.

On Hopper the default for 2-byte dtypes at padded head dim 128 is the
warp-specialized Gluon kernel of :mod:`flashrange.kernels.forward_sm90`
(configs flagged ``gluon``), launched from here with the same arguments; if
it does not build, the default falls back to this kernel with one warning.

Blocks straddling slice boundaries run every key tile masked for every
slice they meet. Measured speeds are in BENCHMARKS.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..constants import has_short_slices
from ..validation import resolve_scale
from .common import (
    DEV_LN2,
    DEV_NO_DIAGONAL,
    LOG2E,
    WS_MAXNREG,
    ensure_tma_allocator,
    fast_launch_enabled,
    forward_walk,
    full_tile_run,
    gluon_sm90_ready,
    interpreting,
    jit_launch,
    launch,
    merged_rows,
    merged_span,
    needs_int64,
    pad_dim,
    packed_heads,
    plan_program,
    plan_split,
    row_cells,
    run_compiled,
    sm_count,
    tma_aligned,
    warn_gluon_fallback,
)
from .plan import build_plan

__all__ = [
    "FwdConfig",
    "FWD_CONFIGS",
    "configs_for",
    "default_config",
    "range_attention_forward_triton",
]


@triton.jit
def _tile_step(
    acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, c0, k_hi, is_edge, stride_kt, stride_vt,
    offs_m, row_ok, ks, ke, d_lo, d_hi, qk_scale, cap_in, cap_out,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, IS_SCALE_FOLDED: tl.constexpr, IS_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, IS_BF16_EMULATED: tl.constexpr, IS_INT64: tl.constexpr,
):
    """One online-softmax step over keys ``[c0, c0 + BLOCK_N)``; scores are kept in base 2.

    ``is_edge`` (a runtime flag, not a constexpr): the tile is not entirely
    inside the slice, so the slice's element mask applies. One loop runs
    both kinds of tile, so the loads of the next tile are in flight whatever
    its kind (docs/design.md §6). Keys no slice covers never reach ``p @ v``:
    the pointer path reads only keys below ``k_hi``; with TMA the caller's
    value descriptor ends at the slice's last key ``ke`` (rows past it read as
    zeros), and every key of ``[k_hi, ke)`` is covered by a later row of the
    slice, its ``p`` being 0 here.
    Everything a tile needs sits in this one function: under the interpreter each
    nested ``@triton.jit`` call costs milliseconds.
    """
    offs_n = c0 + tl.arange(0, BLOCK_N)
    if IS_TMA:
        # Out-of-bounds rows and columns come back as zeros.
        k = k_desc.load([c0, 0])
        v = v_desc.load([c0, 0])
    else:
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        if IS_INT64:
            rows = offs_n.to(tl.int64)
        else:
            rows = offs_n
        k_ptrs = k_base + rows[:, None] * stride_kt + offs_d[None, :]
        v_ptrs = v_base + rows[:, None] * stride_vt + offs_dv[None, :]
        # The last tile may run past the slice into keys no slice covers (or past the
        # tensor): a NaN there must not reach p @ v (0 * NaN), so only its keys are read.
        mask_n = offs_n[:, None] < k_hi
        k = tl.load(k_ptrs, mask=mask_n & (offs_d[None, :] < D), other=0.0)
        v = tl.load(v_ptrs, mask=mask_n & (offs_dv[None, :] < DV), other=0.0)

    k_t = tl.trans(k)
    if IS_BF16_EMULATED:
        # Triton's interpreter multiplies bf16 operands wrongly (3.9): give it fp32
        # copies of the same values.
        qk = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        qk = tl.dot(q, k_t, input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        # tanh through exp2: libdevice is not reachable from the interpreter on every
        # Triton version; the absolute error stays at fp32 rounding.
        e = tl.exp2(qk * cap_in)
        s = cap_out * (1.0 - 2.0 / (e + 1.0))
    elif IS_SCALE_FOLDED:
        # The scale is applied inside the row max and the exponent (one FMA per score).
        s = qk
    else:
        s = qk * qk_scale
    if is_edge != 0:
        # The slice's cells, one interval of keys per row (the diagonal bounds are +-inf-like when the
        # type has no such diagonal).
        s = tl.where(row_cells(offs_m, offs_n, row_ok, ks, ke, d_lo, d_hi), s, float("-inf"))
    if IS_SCALE_FOLDED:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    if IS_SCALE_FOLDED:
        p = tl.exp2(s * qk_scale - m_use[:, None])
    else:
        p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IS_BF16_EMULATED:
        # The interpreter also truncates fp32 -> bf16 where the GPU rounds to nearest
        # even: round on the bits, then the truncation is exact.
        bits = p.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        p_lo = bits.to(tl.float32, bitcast=True).to(v.dtype)
        acc = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["Tq", "Tk", "GROUP"])
def _range_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, rowmax_ptr,
    slices_ptr, block_lo_ptr, block_hi_ptr, block_order_ptr,
    Tq, Tk, Hq,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_mt,
    qk_scale, cap_in, cap_out, GROUP,
    D: tl.constexpr, DV: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, IS_SCALE_FOLDED: tl.constexpr, IS_TMA: tl.constexpr, IS_WARP_SPECIALIZED: tl.constexpr,
    DOT_PRECISION: tl.constexpr, IS_BF16_EMULATED: tl.constexpr, IS_INT64: tl.constexpr,
    HAS_MAX_LOGITS: tl.constexpr, IS_ONE_SLICE: tl.constexpr, IS_MERGING: tl.constexpr,
):
    """1-D grid of ``n_plan_blocks * SPLIT * Hq`` programs, ranked heaviest first over all heads.

    Program ``pid`` takes tile ``pid // Hq % SPLIT`` of plan block
    ``block_order[pid // (Hq * SPLIT)]``, head ``pid % Hq``: the hardware
    starts programs in ``pid`` order, so every head's heavy blocks start
    before any light one (longest-processing-time order), and the query heads
    that share a key/value head run side by side (L2 reuse). A tile reads its
    plan block's window (``SPLIT`` tiles of ``BLOCK_M`` rows per block).

    ``slices`` ``(S, 5)`` int32 rows ``(qs, qe, ks, ke, type)``, already clamped;
    ``block_lo/hi`` give each query block's window into them. With
    ``HAS_MAX_LOGITS``, each row's largest score (``-inf`` on uncovered rows)
    goes to ``rowmax`` ``(Tq, Hq)`` float32. ``IS_ONE_SLICE``: the mask has
    one slice, so the TMA value descriptor that ends at its last key is built
    once per program rather than once per slice. ``IS_MERGING``: a block whose
    slices split its rows and whose keys form one interval may walk them as
    one run of tiles (``common.merged_span``).
    """
    pid_h, r0, r1, s_lo, s_hi = plan_program(tl.program_id(0), Hq, Tq, block_order_ptr, block_lo_ptr, block_hi_ptr,
                                             SPLIT, BLOCK_M)
    pid_kvh = pid_h // GROUP

    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # int64 head offsets: T * H * D can pass 2**31 at long contexts.
    q_base = q_ptr + pid_h.to(tl.int64) * stride_qh
    k_base = k_ptr + pid_kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + pid_kvh.to(tl.int64) * stride_vh

    if IS_TMA:
        q_desc = tl.make_tensor_descriptor(q_base, shape=[Tq, D], strides=[stride_qt, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        k_desc = tl.make_tensor_descriptor(k_base, shape=[Tk, D], strides=[stride_kt, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        if IS_ONE_SLICE:
            # Rows of v at or past the slice's end read as zeros (see _tile_step).
            v_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(tl.load(slices_ptr + 3), 1), DV],
                                               strides=[stride_vt, 1], block_shape=[BLOCK_N, BLOCK_DV])
        else:
            v_desc = None
        q = q_desc.load([r0, 0])
    else:
        q_desc = None
        k_desc = None
        v_desc = None
        q_ptrs = q_base + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :]
        q = tl.load(q_ptrs, mask=(offs_m[:, None] < Tq) & (offs_d[None, :] < D), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    s_end = s_hi
    if IS_MERGING and not IS_ONE_SLICE:
        is_merged, m_lo, m_tiles, m_end = merged_span(slices_ptr, s_lo, s_hi, r0, r1, BLOCK_N)
        if is_merged:
            # Every tile masked, each row by its own slice; keys from m_end on read as zeros.
            row_ok_m, ks_m, ke_m, d_lo_m, d_hi_m = merged_rows(slices_ptr, s_lo, s_hi, r0, r1, offs_m, BLOCK_N)
            if IS_TMA:
                v_run_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(m_end, 1), DV],
                                                       strides=[stride_vt, 1], block_shape=[BLOCK_N, BLOCK_DV])
            else:
                v_run_desc = v_desc
            for t in range(0, m_tiles):
                acc, l_i, m_i = _tile_step(
                    acc, l_i, m_i, q, k_base, v_base, k_desc, v_run_desc, m_lo + t * BLOCK_N, m_end, 1,
                    stride_kt, stride_vt, offs_m, row_ok_m, ks_m, ke_m, d_lo_m, d_hi_m,
                    qk_scale, cap_in, cap_out, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
                    HAS_SOFTCAP, IS_SCALE_FOLDED, IS_TMA, DOT_PRECISION, IS_BF16_EMULATED, IS_INT64)
        s_end = tl.where(is_merged, s_lo, s_hi)
    for s_idx in range(s_lo, s_end):
        row = slices_ptr + s_idx * 5
        qs = tl.load(row + 0)
        qe = tl.load(row + 1)
        ks = tl.load(row + 2)
        ke = tl.load(row + 3)
        mtype = tl.load(row + 4)
        has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles = forward_walk(r0, r1, qs, qe, ks, ke, mtype,
                                                                                BLOCK_N)
        n_full_lo, n_full_hi = full_tile_run(r0, r0 + BLOCK_M, qs, qe, ks, ke, has_upper, d_max, has_lower, d_min,
                                             k_lo, n_tiles, BLOCK_N)
        # Masked tiles: rows of the slice, and diagonal bounds no cell can miss when
        # the type has no such diagonal (|j - i| < 2**30 since T <= MAX_TOKENS).
        row_ok = (offs_m >= qs) & (offs_m < qe)
        d_hi = tl.where(has_upper, d_max, DEV_NO_DIAGONAL)
        d_lo = tl.where(has_lower, d_min, -DEV_NO_DIAGONAL)

        # A fresh name each slice: a descriptor cannot be a loop-carried value.
        if IS_TMA and not IS_ONE_SLICE:
            # Ends at the slice's last key: the tile past k_hi reads zeros there (see _tile_step).
            v_slice_desc = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(ke, 1), DV], strides=[stride_vt, 1],
                                                     block_shape=[BLOCK_N, BLOCK_DV])
        else:
            v_slice_desc = v_desc
        for t in tl.range(0, n_tiles, warp_specialize=IS_WARP_SPECIALIZED):
            is_edge = ((t < n_full_lo) | (t >= n_full_hi)).to(tl.int32)
            acc, l_i, m_i = _tile_step(
                acc, l_i, m_i, q, k_base, v_base, k_desc, v_slice_desc, k_lo + t * BLOCK_N, k_hi, is_edge,
                stride_kt, stride_vt, offs_m, row_ok, ks, ke, d_lo, d_hi,
                qk_scale, cap_in, cap_out, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV,
                HAS_SOFTCAP, IS_SCALE_FOLDED, IS_TMA, DOT_PRECISION, IS_BF16_EMULATED, IS_INT64)

    # l = 0 exactly on rows no slice covers; a NaN l (NaN in a covered input) stays NaN.
    covered = l_i != 0.0
    l_safe = tl.where(covered, l_i, 1.0)
    # One reciprocal per row, not one division per element (the GPU divides through its
    # reciprocal unit, a few per clock).
    out = acc * (1.0 / l_safe)[:, None]
    if IS_BF16_EMULATED:
        bits = out.to(tl.uint32, bitcast=True)
        out = ((bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000).to(tl.float32, bitcast=True)
    lse = tl.where(covered, (m_i + tl.log2(l_safe)) * DEV_LN2, float("-inf"))
    mask_m = offs_m < Tq
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_ot + pid_h.to(tl.int64) * stride_oh \
        + offs_dv[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_dv[None, :] < DV))
    tl.store(lse_ptr + offs_m.to(tl.int64) * stride_lt + pid_h, lse, mask=mask_m)
    if HAS_MAX_LOGITS:
        # The running max is the row's largest score in base 2 (the scale and softcap
        # applied, no weight for overlaps); -inf where nothing is covered.
        tl.store(rowmax_ptr + offs_m.to(tl.int64) * stride_mt + pid_h, m_i * DEV_LN2, mask=mask_m)


# ---------------------------------------------------------------------------------------------
# Launcher


@dataclass(frozen=True)
class FwdConfig:
    """One launch configuration; ``BLOCK_M`` is also the plan's block."""

    name: str
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    warp_spec: bool = False
    # The Hopper kernel of kernels/forward_sm90.py (Gluon) instead of the Triton one.
    gluon: bool = False
    # Gluon only: its two consumer warpgroups take turns issuing their matmuls.
    pingpong: bool = False
    # Gluon only: one program per SM walks the work items (query block x head, heavy first),
    # instead of one program per item (docs/design.md, "The Hopper forward").
    persistent: bool = False
    # A query block whose slices split its rows and whose keys form one interval walks them
    # as one run of key tiles, each row masked by its own slice, when that takes fewer tiles
    # (docs/design.md, "Merged tiles").
    merge: bool = False
    # Gluon only: programs take their next work item from a counter shared by the launch as they
    # finish one (the same order, no fixed share per program; docs/design.md, "Dynamic schedule").
    dynamic: bool = False
    # Gluon only, with dynamic: each launch takes the counter's order only when the slice where the mask's
    # work is has at least constants.FWD_DYNAMIC_MIN_LEN rows, else the fixed share's items (docs/design.md,
    # "Dynamic schedule").
    adaptive: bool = False
    # Gluon only: a ring slot's key and value tiles have barriers of their own, and each key tile is loaded
    # ahead of the value tile before it (docs/design.md, "Split key and value barriers").
    split_kv: bool = False
    # Gluon only, fixed share: query blocks used by turns; with 2 the producer loads the next item's queries
    # while this item's are in use (docs/design.md, "Split key and value barriers").
    q_buffers: int = 1
    # Gluon only: how many quarters (0, 1 or 2) of the probabilities' exponentials a polynomial computes on
    # the FMA pipe instead of MUFU, whose throughput bounds the softmax at head dim 64 (docs/design.md,
    # "Exponentials on two pipes").
    poly_exp2: int = 0
    # Gluon only: an edge tile's element mask from one key interval per row, one unsigned compare per cell
    # (the Triton kernel's form; docs/design.md, "Edge tiles"), instead of the four inequalities per cell.
    row_intervals: bool = False


# Every configuration the GPU tests force one by one (tests/test_gpu_forward.py);
# configs_for() drops the ones a head dim, dtype or Triton build cannot run.
FWD_CONFIGS = [
    FwdConfig("ptr_m128_n64_w4_s3", 128, 64, 4, 3),
    FwdConfig("ptr_m128_n64_w8_s2", 128, 64, 8, 2),
    FwdConfig("ptr_m128_n64_w8_s3", 128, 64, 8, 3),
    FwdConfig("ptr_m128_n64_w8_s4", 128, 64, 8, 4),
    FwdConfig("ptr_m128_n128_w8_s2", 128, 128, 8, 2),
    FwdConfig("ptr_m128_n128_w8_s3", 128, 128, 8, 3),
    FwdConfig("ptr_m128_n128_w4_s3", 128, 128, 4, 3),
    FwdConfig("ptr_m64_n64_w4_s3", 64, 64, 4, 3),
    FwdConfig("ptr_m64_n64_w4_s4", 64, 64, 4, 4),
    FwdConfig("ptr_m64_n128_w4_s3", 64, 128, 4, 3),
    FwdConfig("ptr_m64_n32_w4_s2", 64, 32, 4, 2),
    FwdConfig("ptr_m64_n64_w4_s2", 64, 64, 4, 2),
    FwdConfig("ptr_m128_n32_w8_s3", 128, 32, 8, 3),
    # Wide values (Dv up to 512): a 64-row accumulator over 8 warps keeps to the register file.
    FwdConfig("ptr_m64_n32_w8_s2", 64, 32, 8, 2),
    FwdConfig("ptr_m64_n32_w8_s3", 64, 32, 8, 3),
    FwdConfig("ptr_m64_n64_w8_s2", 64, 64, 8, 2),
    FwdConfig("tma_m128_n64_w4_s2", 128, 64, 4, 2, use_tma=True),
    FwdConfig("tma_m128_n64_w4_s3", 128, 64, 4, 3, use_tma=True),
    FwdConfig("tma_m128_n64_w8_s3", 128, 64, 8, 3, use_tma=True),
    FwdConfig("tma_m128_n128_w8_s2", 128, 128, 8, 2, use_tma=True),
    FwdConfig("tma_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True),
    FwdConfig("tma_m64_n64_w4_s3", 64, 64, 4, 3, use_tma=True),
    FwdConfig("tma_m64_n64_w4_s2", 64, 64, 4, 2, use_tma=True),
    # Warp specialization: on Triton 3.6 the 4-warp variants fail to compile this kernel
    # (WSDataPartition asserts on the loop nest: "value not sliced"), so only 8 warps.
    FwdConfig("ws_m128_n128_w8_s2", 128, 128, 8, 2, use_tma=True, warp_spec=True),
    # The Hopper kernel (Gluon, kernels/forward_sm90.py): a producer warp and two consumer
    # warpgroups of 64 rows (4 warps each), a ring of `num_stages` K/V slots.
    FwdConfig("sm90ws_m128_n128_w4_s2", 128, 128, 4, 2, use_tma=True, warp_spec=True, gluon=True),
    FwdConfig("sm90ws_m128_n64_w4_s3", 128, 64, 4, 3, use_tma=True, warp_spec=True, gluon=True),
    FwdConfig("sm90pp_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True, pingpong=True),
    FwdConfig("sm90ppp_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True, pingpong=True,
              persistent=True),
    FwdConfig("sm90pppm_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True, pingpong=True,
              persistent=True, merge=True),
    FwdConfig("sm90pppmd_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True, pingpong=True,
              persistent=True, merge=True, dynamic=True),
    FwdConfig("sm90pppma_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True, pingpong=True,
              persistent=True, merge=True, dynamic=True, adaptive=True),
    FwdConfig("sm90pppmar_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True, pingpong=True,
              persistent=True, merge=True, dynamic=True, adaptive=True, row_intervals=True),
    FwdConfig("sm90pppmakr_m128_n128_w4_s2", 128, 128, 4, 2, use_tma=True, warp_spec=True, gluon=True,
              pingpong=True, persistent=True, merge=True, dynamic=True, adaptive=True, split_kv=True,
              row_intervals=True),
    FwdConfig("sm90pppmax1_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True,
              pingpong=True, persistent=True, merge=True, dynamic=True, adaptive=True, poly_exp2=1),
    FwdConfig("sm90pppmax2_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True,
              pingpong=True, persistent=True, merge=True, dynamic=True, adaptive=True, poly_exp2=2),
    FwdConfig("sm90pppmak_m128_n128_w4_s2", 128, 128, 4, 2, use_tma=True, warp_spec=True, gluon=True,
              pingpong=True, persistent=True, merge=True, dynamic=True, adaptive=True, split_kv=True),
    FwdConfig("sm90pppmk_m128_n128_w4_s2", 128, 128, 4, 2, use_tma=True, warp_spec=True, gluon=True, pingpong=True,
              persistent=True, merge=True, split_kv=True),
    FwdConfig("sm90pppmk_m128_n128_w4_s3", 128, 128, 4, 3, use_tma=True, warp_spec=True, gluon=True, pingpong=True,
              persistent=True, merge=True, split_kv=True),
    FwdConfig("sm90pppmkq_m128_n128_w4_s2", 128, 128, 4, 2, use_tma=True, warp_spec=True, gluon=True,
              pingpong=True, persistent=True, merge=True, split_kv=True, q_buffers=2),
    # For the interpreter (CPU): few large tiles, since every tile step costs tens of
    # milliseconds there; the small ones let tests reach many tiles on small inputs.
    FwdConfig("cpu_m64_n64", 64, 64, 4, 1, merge=True),
    FwdConfig("cpu_m32_n16", 32, 16, 4, 1),
    FwdConfig("cpu_m16_n32", 16, 32, 4, 1),
]
_BY_NAME = {c.name: c for c in FWD_CONFIGS}

# Defaults per padded head dim, for 2-byte dtypes on a GPU, from a sweep of every
# config on an H200 (Triton 3.6; flashrange bench --sweep): the best single
# choice over full, causal, document-causal and sliding-window masks.
_DEFAULTS = {
    16: "ptr_m128_n64_w4_s3",
    32: "ptr_m128_n64_w4_s3",
    64: "tma_m128_n64_w4_s3",
    128: "tma_m128_n64_w4_s2",
    256: "ptr_m128_n64_w8_s2",
    # Not timed: the pointer tiles whose accumulator fits (Dv up to 512 needs D <= 64).
    512: "ptr_m64_n32_w8_s2",
}


# On Hopper, where the Gluon kernel builds (2-byte dtypes), per padded head dim. Merged tiles:
# a large gain with very short documents against a small loss elsewhere (docs/design.md,
# "Merged tiles"). At head dim 64 the persistent kernel won raw-launcher A/Bs by 2-5% in the
# eighth session and again in the thirteenth (BENCHMARKS.md); the eighth session's noisy
# public-call run had kept the Triton kernel there until then. At head dim 128 the adaptive schedule
# (the counter's order where the mask's heaviest slice is long) won the twenty-fifth session's A/B on
# every case but one within 3%; with short slots on average (constants.has_short_slices) the split key
# and value barriers add 2-8% on documents, and lose 2-3% on long single slices, hence the two. At head
# dim 64 the adaptive schedule gained 18% on 16 documents in 32k and was level elsewhere (twenty-seventh
# session), while the split barriers lost 1-4% on every mask timed there: no short-slice default.
_SM90_DEFAULTS = {
    64: "sm90pppma_m128_n128_w4_s3",
    128: "sm90pppma_m128_n128_w4_s3",
}
_SM90_SHORT_SLICES = {
    128: "sm90pppmak_m128_n128_w4_s2",
}


@functools.lru_cache(maxsize=None)
def _smem_limit(device_index: int, gluon: bool) -> int:
    """Shared memory a program's tiles may take: the device's limit, less a margin for
    Triton's own scratch, or for a Gluon kernel's few barriers (it takes exactly its tiles)."""
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024
    return optin - (1024 if gluon else 8 * 1024)


@functools.lru_cache(maxsize=None)
def _has_tma() -> bool:
    # Callers rule out the interpreter themselves (this answer is cached).
    if not hasattr(tl, "make_tensor_descriptor") or not hasattr(triton, "set_allocator"):
        return False
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


# Set when the Gluon kernel failed to build here: every later call takes the Triton kernel.
_GLUON_FAILURES = []


@functools.lru_cache(maxsize=None)
def _has_gluon_sm90() -> bool:
    """Whether the Hopper kernel can run on the current device (and has not failed to build here)."""
    return not _GLUON_FAILURES and gluon_sm90_ready(None)


@functools.lru_cache(maxsize=None)
def _gluon_kernel():
    from .forward_sm90 import range_attn_fwd_sm90_ws_kernel

    return range_attn_fwd_sm90_ws_kernel


@functools.lru_cache(maxsize=None)
def _has_warp_spec() -> bool:
    import inspect

    try:
        return "warp_specialize" in inspect.signature(tl.range.__init__).parameters
    except (TypeError, ValueError):
        return False


def configs_for(head_dim: int, head_dim_v: int, dtype: torch.dtype, *, device_type: str = "cuda"):
    """The configurations of :data:`FWD_CONFIGS` that can run this problem here."""
    dev = torch.cuda.current_device() if device_type == "cuda" and torch.cuda.is_available() else -1
    return list(_configs_for(head_dim, head_dim_v, dtype, device_type, interpreting(), dev))


@functools.lru_cache(maxsize=None)
def _configs_for(head_dim, head_dim_v, dtype, device_type, interpreting, device_index):
    bd, bdv = pad_dim(head_dim), pad_dim(head_dim_v)
    es = dtype.itemsize
    out = []
    for c in FWD_CONFIGS:
        if device_type != "cuda" or interpreting:
            if c.use_tma or c.warp_spec:
                continue
        else:
            if c.name.startswith("cpu_"):
                continue
            if c.use_tma and not _has_tma():
                continue
            if c.warp_spec and not c.gluon and not _has_warp_spec():
                continue
            if c.gluon and not (
                _has_gluon_sm90() and es == 2 and bd in (64, 128) and bdv in (64, 128)
                and head_dim * es % 16 == 0 and head_dim_v * es % 16 == 0
            ):
                continue
            # TMA needs 16-byte aligned rows; fp32 keeps to small pointer tiles.
            if c.use_tma and (head_dim * es % 16 or head_dim_v * es % 16):
                continue
            # A TMA box spans at most 256 elements per dimension (wide values: pointers only).
            if c.use_tma and max(bd, bdv) > 256:
                continue
            if es == 4 and (c.use_tma or c.BLOCK_M * c.BLOCK_N > 64 * 64):
                continue
            smem = (c.BLOCK_M * bd + max(c.num_stages, 1) * c.BLOCK_N * (bd + bdv)) * es
            if device_index >= 0 and smem > _smem_limit(device_index, c.gluon):
                continue
            # Registers: the accumulator and the score tile per thread.
            regs = (c.BLOCK_M * bdv + c.BLOCK_M * c.BLOCK_N) // (32 * c.num_warps)
            if regs > 256:
                continue
        out.append(c)
    return tuple(out)


def default_config(head_dim: int, head_dim_v: int, dtype: torch.dtype, *, device_type: str = "cuda",
                   short_slices: bool = False) -> FwdConfig:
    """A fixed choice per head dim and dtype: deterministic results, plan block known up front.

    ``short_slices``: the mask's slots are short on average
    (:func:`flashrange.constants.has_short_slices`, which the launcher asks of
    the call's shapes); on Hopper it may pick another schedule of the same
    tiles, with the same bits. Cached: the launcher asks on every call, and the
    host time counts for short kernels.
    """
    dev = torch.cuda.current_device() if device_type == "cuda" and torch.cuda.is_available() else -1
    return _default_config(head_dim, head_dim_v, dtype, device_type, interpreting(), dev, short_slices)


@functools.lru_cache(maxsize=None)
def _default_config(head_dim, head_dim_v, dtype, device_type, interpreting, device_index, short_slices=False):
    if device_type != "cuda" or interpreting:
        return _BY_NAME["cpu_m64_n64"]
    allowed = _configs_for(head_dim, head_dim_v, dtype, device_type, interpreting, device_index)
    if dtype.itemsize == 4:
        name = "ptr_m64_n32_w4_s2" if pad_dim(head_dim_v) <= 256 else "ptr_m64_n32_w8_s2"
    else:
        name = _DEFAULTS[min(k for k in _DEFAULTS if k >= pad_dim(max(head_dim, head_dim_v)))]
    cfg = _BY_NAME[name]
    padded = max(pad_dim(head_dim), pad_dim(head_dim_v))
    # The short-slice schedule where it applies and fits this device, else the Hopper default.
    for sm90 in ((_SM90_SHORT_SLICES.get(padded),) if short_slices else ()) + (_SM90_DEFAULTS.get(padded),):
        if dtype.itemsize == 2 and sm90 is not None and _BY_NAME[sm90] in allowed:
            return _BY_NAME[sm90]
    if cfg not in allowed:  # e.g. no TMA on this build or chip: fall back to the pointer path
        cfg = next(c for c in allowed if not c.use_tma)
    return cfg


# Per call signature (see _signature): the compiled kernel and every launch argument
# that follows from it, so a repeated call skips the checks, the config choice and
# the dispatcher. Bounded: shapes that change every step must not grow it forever.
_RECIPES = {}
_MAX_RECIPES = 1024


class _Recipe(NamedTuple):
    handle: object
    grid: tuple
    tail: tuple  # the arguments after the plan's four query-major tensors (a Gluon kernel's ticket left out)
    uses_tma: bool  # the kernel builds tensor descriptors: it needs Triton's allocator in this thread
    is_gluon: bool  # the Gluon kernel: its last argument, the work counter, is this call's (_ticket)
    dynamic: bool  # ... and the kernel takes its items from that counter


def _ticket(dynamic, lse):
    """The Gluon kernel's last argument: under a dynamic schedule a zeroed counter of taken work items, new
    for each launch (each counts from 0); else a tensor of this call that the kernel never touches."""
    return torch.zeros(1, dtype=torch.int32, device=lse.device) if dynamic else lse


def _recorded_args(recipe, q, k, v, out, lse, rowmax, plan):
    """A recorded call's launch arguments: this call's tensors, then the recorded tail (see :func:`_launch`)."""
    args = (q, k, v, out, lse, lse if rowmax is None else rowmax, plan[0], plan[1], plan[2], plan[3]) + recipe.tail
    return args + (_ticket(recipe.dynamic, lse),) if recipe.is_gluon else args


def _signature(q, k, v, plan, softmax_scale, softcap, config, return_max_logits):
    """Everything the launch derives its arguments and its Triton specialization from.

    Shapes and strides (tiles, 64-bit offsets, TMA), dtypes and 16-byte
    alignment of every pointer argument (Triton specializes on both), the
    device, the settings. ``out``, ``lse`` and the row maxima are fresh
    allocations, so their shapes follow from these and their bases are aligned.
    """
    pq, plo, phi, por = plan[0], plan[1], plan[2], plan[3]
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
        q.data_ptr() & 15, k.data_ptr() & 15, v.data_ptr() & 15,
        pq.dtype, plo.dtype, phi.dtype, por.dtype, pq.shape, por.shape,
        pq.data_ptr() & 15, plo.data_ptr() & 15, phi.data_ptr() & 15, por.data_ptr() & 15,
        softmax_scale, softcap, config, return_max_logits,
    )


def range_attention_forward_triton(
    q, k, v, q_ranges, k_ranges, mask_types, softmax_scale=None, softcap=0.0, *, plan=None, config=None,
    return_max_logits=False,
):
    """Range attention forward on the Triton kernel.

    `q`: `(Tq, Hq, D)`, `k`: `(Tk, Hkv, D)`, `v`: `(Tk, Hkv, Dv)`;
    `q_ranges`, `k_ranges`: `(S, 2)` int32, `mask_types`: `(S,)` int32, on q's device.
    Returns `out`: `(Tq, Hq, Dv)` in q's dtype and `lse`: `(Tq, Hq)` float32, as
    :func:`flashrange.reference.range_attention_forward` does. `plan`: the
    mask's :class:`~flashrange.plan.RangePlan` (built here when ``None``).
    `config` (a :class:`FwdConfig` or its name) overrides :func:`default_config`.
    `return_max_logits`: also return `max_logits` `(Hq,)` float32, each head's
    largest score over the covered cells (`-inf` for a head with none), as
    :func:`flashrange.reference.range_attention_max_logits` computes it.

    Static shapes and no host reads of tensor values: capturable in CUDA graphs.
    A call whose signature (shapes, strides, dtypes, alignment, settings) was
    seen before, with a plan given, goes straight to the compiled kernel.
    """
    sig = None
    if plan is not None and q.is_cuda and fast_launch_enabled():
        sig = _signature(q, k, v, plan, softmax_scale, softcap, config, return_max_logits)
        recipe = _RECIPES.get(sig)
        device = torch.cuda.current_device()
        if recipe is not None and q.device.index == device:
            Tq, Hq = q.shape[0], q.shape[1]
            out = torch.empty(Tq, Hq, v.shape[2], dtype=q.dtype, device=q.device)
            lse = torch.empty(Tq, Hq, dtype=torch.float32, device=q.device)
            rowmax = torch.empty(Tq, Hq, dtype=torch.float32, device=q.device) if return_max_logits else None
            if recipe.uses_tma:
                ensure_tma_allocator()
            run_compiled(recipe.handle, recipe.grid, _recorded_args(recipe, q, k, v, out, lse, rowmax, plan), device)
            return _with_max_logits(out, lse, rowmax)
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    if k.shape[2] != D or k.shape[:2] != v.shape[:2] or Hq % Hkv:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = resolve_scale(softmax_scale, D)
    softcap = float(softcap)
    out = torch.empty(Tq, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(Tq, Hq, dtype=torch.float32, device=q.device)
    # Each row's largest score; reduced over the rows after the launch.
    rowmax = torch.empty(Tq, Hq, dtype=torch.float32, device=q.device) if return_max_logits else None
    if Tq == 0 or Hq == 0:
        return _with_max_logits(out, lse, rowmax)
    if Tk == 0 or q_ranges.shape[0] == 0:
        if rowmax is not None:
            rowmax.fill_(float("-inf"))
        return _with_max_logits(out.zero_(), lse.fill_(float("-inf")), rowmax)

    is_interp = interpreting()
    may_fall_back = config is None
    if config is None:
        dev_index = q.device.index if q.device.type == "cuda" else -1
        if dev_index is None:
            dev_index = torch.cuda.current_device()
        config = _default_config(D, Dv, q.dtype, q.device.type, is_interp, dev_index,
                                 has_short_slices(Tq, Tk, q_ranges.shape[0]))
    elif isinstance(config, str):
        config = _BY_NAME[config]
    if config.gluon and not (q.device.type == "cuda" and not is_interp and _has_gluon_sm90()):
        raise ValueError(
            f"config {config.name!r} is the Hopper (Gluon) kernel: it needs a compute-capability-9 GPU, "
            "the interpreter off and a Triton with Gluon; pass config=None for the default here"
        )
    # The kernel wants unit stride along the head dim (a copied input has another signature).
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        sig = None
        q = q if q.stride(-1) == 1 else q.contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
    # TMA also needs 16-byte aligned bases and row strides (views into packed qkv
    # tensors may not have them); the same tiles run on plain pointers otherwise.
    use_tma = (
        config.use_tma and q.device.type == "cuda" and not is_interp
        and all(tma_aligned(t) for t in (q, k, v))
    )
    if use_tma:
        ensure_tma_allocator()
    split = plan_split(config.BLOCK_M)
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():
        # Triton launches on the current device; the inputs live on another one.
        with torch.cuda.device(q.device):
            if plan is None:
                plan = build_plan(q_ranges, k_ranges, mask_types, Tq, Tk)
            return _launch(q, k, v, out, lse, rowmax, plan, scale, softcap, config, split, use_tma, is_interp, None,
                           may_fall_back=may_fall_back)
    if plan is None:
        plan = build_plan(q_ranges, k_ranges, mask_types, Tq, Tk)
    return _launch(q, k, v, out, lse, rowmax, plan, scale, softcap, config, split, use_tma, is_interp, sig,
                   may_fall_back=may_fall_back)


def _with_max_logits(out, lse, rowmax):
    """``(out, lse)``, or ``(out, lse, max_logits)`` when a row-max buffer ``(Tq, Hq)`` was filled."""
    if rowmax is None:
        return out, lse
    if rowmax.shape[0] == 0:
        # amax refuses an empty dimension; no row means no covered cell.
        return out, lse, rowmax.new_full((rowmax.shape[1],), float("-inf"))
    # Uncovered rows hold -inf, the identity of max.
    return out, lse, rowmax.amax(dim=0)


def _disable_gluon(error: Exception) -> None:
    """The Gluon kernel failed to build: say so once, and let every later call take the Triton kernel."""
    _GLUON_FAILURES.append(f"{type(error).__name__}: {error}")
    for cached in (_has_gluon_sm90, _configs_for, _default_config):
        cached.cache_clear()
    _RECIPES.clear()
    warn_gluon_fallback("forward", error, stacklevel=4)


def _launch(q, k, v, out, lse, rowmax, plan, scale, softcap, config, split, use_tma, is_interp, sig, *,
            may_fall_back=False):
    """Launch the kernel; with a signature (see :func:`_signature`), record the recipe for the next call.

    ``may_fall_back``: ``config`` is the default, so a Gluon kernel that fails
    to build is replaced by the Triton kernel (one warning per process) rather
    than raising.
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    n_blocks = plan.q_block_order.shape[0] * split
    if softcap > 0:
        # tanh(x) = 1 - 2 / (exp2(2 log2(e) x) + 1), with x = scale * qk / softcap.
        cap_in, cap_out = 2.0 * LOG2E * scale / softcap, softcap * LOG2E
    else:
        cap_in, cap_out = 0.0, 0.0
    grid = (n_blocks * Hq,)
    args = (
        # Without max logits the kernel never touches the row-max pointer: lse stands in.
        q, k, v, out, lse, lse if rowmax is None else rowmax,
        plan.q_slices, plan.q_block_lo, plan.q_block_hi, plan.q_block_order,
        Tq, Tk, Hq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), 0 if rowmax is None else rowmax.stride(0),
        scale * LOG2E, cap_in, cap_out, Hq // Hkv,
        D, Dv, split, config.BLOCK_M, config.BLOCK_N, pad_dim(D), pad_dim(Dv),
        softcap > 0,  # HAS_SOFTCAP
        softcap <= 0 and scale > 0,  # IS_SCALE_FOLDED
        use_tma,  # IS_TMA
        config.warp_spec and use_tma,  # IS_WARP_SPECIALIZED
        "ieee" if q.dtype == torch.float32 else "tf32",  # DOT_PRECISION
        is_interp and q.dtype == torch.bfloat16,  # IS_BF16_EMULATED
        # Row offsets past 2**31 elements need 64-bit pointer arithmetic.
        needs_int64(q, k, v, out),  # IS_INT64
        rowmax is not None,  # HAS_MAX_LOGITS
        plan.q_slices.shape[0] == 1,  # IS_ONE_SLICE
        config.merge,  # IS_MERGING
    )
    kernel, num_stages, maxnreg = _range_attn_fwd_kernel, config.num_stages, None
    if config.gluon and use_tma:
        # Without TMA-aligned inputs a Gluon config's tiles run on the Triton kernel's pointer path.
        kernel, num_stages, maxnreg = _gluon_kernel(), None, WS_MAXNREG
        if config.persistent and q.device.type == "cuda":
            grid = (min(grid[0], sm_count(q.device.index)),)
        # STAGES, NUM_WARPS, IS_PINGPONG, HAS_PACKED_HEADS, IS_DYNAMIC, IS_ADAPTIVE, IS_KV_SPLIT, Q_BUFS,
        # POLY_QUARTERS, IS_ROW_INTERVAL, ticket_ptr
        args = args + (config.num_stages, config.num_warps, config.pingpong, packed_heads(q, k, v), config.dynamic,
                       config.adaptive, config.split_kv, config.q_buffers, config.poly_exp2, config.row_intervals,
                       _ticket(config.dynamic, lse))
    try:
        if sig is None:
            launch(kernel, grid, args, num_warps=config.num_warps, num_stages=num_stages, maxnreg=maxnreg)
        else:
            handle = jit_launch(kernel, grid, args, config.num_warps, num_stages, maxnreg)
            if len(_RECIPES) >= _MAX_RECIPES:
                _RECIPES.clear()
            is_gluon = kernel is not _range_attn_fwd_kernel
            _RECIPES[sig] = _Recipe(handle, grid, args[10:-1] if is_gluon else args[10:], use_tma, is_gluon,
                                    config.dynamic)
    except Exception as e:  # noqa: BLE001 - any failure to build the Gluon kernel; others re-raise
        if kernel is _range_attn_fwd_kernel or not may_fall_back:
            raise
        _disable_gluon(e)
        config = _default_config(D, Dv, q.dtype, "cuda", False, torch.cuda.current_device())
        return _launch(q, k, v, out, lse, rowmax, plan, scale, softcap, config, plan_split(config.BLOCK_M),
                       config.use_tma and use_tma, is_interp, None)
    return _with_max_logits(out, lse, rowmax)
