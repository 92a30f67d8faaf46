"""Hopper (sm_90) backward of range attention in Gluon: the dK/dV and dQ kernels (docs/design.md §7).

Supported: bfloat16 and float16, padded head dims ``D`` and ``Dv`` of 64 or
128, views whose rows are 16-byte aligned, every slice type, overlapping and
empty slices, GQA, softcap and a gradient through lse. Anything else runs the
Triton kernels of :mod:`flashrange.kernels.backward`, which launch these.

Each kernel has its Triton twin's parameters (plus ``STAGES`` and
``NUM_WARPS``), work items, plan and arithmetic, so the gradients are
deterministic and invariant to slice order and empty slices in the same
way. On the Triton kernel's grid a program computes one work item; on a
smaller (persistent) grid each program walks several (``sm90_common.nth_work``,
or with ``IS_DYNAMIC`` one by one from a counter, ``sm90_common.take_item``),
with the same bits. The dQ kernel runs first and writes the ``(delta, lse * log2(e))``
workspace that the dK/dV kernel reads. Both are warp-specialized like the
Hopper forward: a producer warp issues every TMA load into a ring of
``STAGES`` slots ("ready" and "empty" mbarriers), and two consumer
warpgroups each own half of the program's block, with registers split
240 / 240 / 24.

- dK/dV: a program owns ``BLOCK_N`` keys of one key/value head and walks every
  (slice, query head of its group) pair of its plan window, accumulating dK
  and dV in registers (no atomics). The producer loads the block's K and V
  halves once, then each pair's query tiles (``BLOCK_M`` rows of q and dO). A
  slice's tiles start at its first row that reads the block (``m_lo``) and
  its q and dO descriptors end at its last (``m_hi``): every row loaded is a
  row the slice covers, so a NaN in an uncovered row of q or dO cannot reach
  a gradient through a zero probability. Per tile each consumer computes
  ``S^T = K Q^T``, ``P^T``, ``dV += P^T dO``, ``dP^T = V dO^T``, ``dS^T`` and
  ``dK += dS^T Q``; a tile's dV and dK matmuls are issued with the next tile's
  ``S^T`` and ``dP^T`` and run under its element-wise work, and the slot is released
  once they are done (the dQ kernel overlaps its dQ matmul the same way).
  With 64-row tiles and a padded head dim of 128 (or 128-row tiles at 64) the
  consumer holds the scores by rows instead (``S = Q K^T``, ``dP = dO V^T``, as
  wide as its 64 keys, where 32-row tiles held by keys make 32-wide score
  matmuls), and ``P`` and ``dS`` go through shared memory, read transposed by
  the dV and dK matmuls.
  Each key's sums over rows run in the same order either way: the same bits.
- dQ: a program owns ``BLOCK_M`` query rows of one head; the producer loads
  its q halves once, then each slice's K/V tiles, with descriptors ending at
  the slice's last key; dO and O come through pointer loads so that rows no
  slice covers stay zero.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..constants import BWD_DYNAMIC_MAX_LEN
from .common import (DEV_LOG2E, DEV_NO_DIAGONAL, full_row_run, key_span, plan_program, query_span,
                     slice_diagonals)
from .sm90_common import (bounded_desc, cta_barrier, issue_run, key_cells, load_slice, next_item, nth_work,
                          packed_qkv, post_item, read_ticket, read_work, row_cells, sched_buffers, store_rows,
                          takes_tickets, tma_load, wait_halves_free)

__all__ = ["bwd_dkdv_sm90_kernel", "bwd_dq_sm90_kernel"]

# The adaptive schedule's slice lengths that take the counter (sm90_common.takes_tickets).
_MIN_LEN = gl.constexpr(0)
_MAX_LEN = gl.constexpr(BWD_DYNAMIC_MAX_LEN)


@gluon.jit
def _slice_rows(slices_ptr, s, c0, c1, BLOCK_M: gl.constexpr):
    """A slice's rows ``[m_lo, m_hi)`` that read keys ``[c0, c1)``, its tiles from ``m_lo``, and its geometry."""
    qs, qe, ks, ke, mtype = load_slice(slices_ptr, s)
    m_lo, m_hi = query_span(c0, c1, qs, qe, ks, ke, mtype)
    n_tiles = gl.cdiv(gl.maximum(m_hi - m_lo, 0), BLOCK_M)
    return qs, qe, ks, ke, mtype, m_lo, m_hi, n_tiles


@gluon.jit
def _cell(offs_n, offs_m, ks, ke, d_lo, d_hi, IS_ROW_INTERVAL: gl.constexpr):
    """The slice's cells of a (keys x rows) tile; rows outside the slice already have p = 0 through lse. With
    ``IS_ROW_INTERVAL`` one interval of rows per key (``sm90_common.key_cells``, the same cells)."""
    if IS_ROW_INTERVAL:
        return key_cells(offs_n, offs_m, ks, ke, d_lo, d_hi)
    else:
        diag = gl.expand_dims(offs_n, 1) - gl.expand_dims(offs_m, 0)
        return gl.expand_dims((offs_n >= ks) & (offs_n < ke), 1) & (diag <= d_hi) & (diag >= d_lo)


@gluon.jit
def _cell_rows(offs_m, offs_n, ks, ke, d_lo, d_hi, IS_ROW_INTERVAL: gl.constexpr):
    """``_cell`` of a (rows x keys) tile (``sm90_common.row_cells`` with ``IS_ROW_INTERVAL``)."""
    if IS_ROW_INTERVAL:
        # Rows unchecked, as below: every row counts as inside the slice.
        return row_cells(offs_m, offs_n, 0, offs_m >= 0, ks, ke, d_lo, d_hi)
    else:
        diag = gl.expand_dims(offs_n, 0) - gl.expand_dims(offs_m, 1)
        return gl.expand_dims((offs_n >= ks) & (offs_n < ke), 0) & (diag <= d_hi) & (diag >= d_lo)


@gluon.jit
def _probs(s, lse2, qk_scale2, scale, softcap, KEY_DIM: gl.constexpr, HAS_SOFTCAP: gl.constexpr):
    """``(p, th)``: a tile's probabilities from its scores and its rows' ``lse * log2(e)`` (broadcast along the
    key dimension ``KEY_DIM``), and with softcap the capped scores' ``tanh`` that dS needs (else ``s``)."""
    if HAS_SOFTCAP:
        e = gl.exp2(s * (2.0 * DEV_LOG2E * scale / softcap))
        th = 1.0 - 2.0 / (e + 1.0)
        p = gl.exp2(th * (softcap * DEV_LOG2E) - gl.expand_dims(lse2, KEY_DIM))
    else:
        th = s
        p = gl.exp2(s * qk_scale2 - gl.expand_dims(lse2, KEY_DIM))
    return p, th


@gluon.jit
def _pair_geometry(slices_ptr, s, c0, c1, BLOCK_M: gl.constexpr):
    """What a dK/dV consumer needs of slice ``s`` for keys ``[c0, c1)``: ``(ks, ke, m_lo, m_hi, n_tiles, f_lo, f_hi,
    d_lo, d_hi)``, its tiles from row ``m_lo``, the rows ``[f_lo, f_hi)`` that read every key of the block and its
    diagonal bounds."""
    qs, qe, ks, ke, mtype, m_lo, m_hi, n_tiles = _slice_rows(slices_ptr, s, c0, c1, BLOCK_M)
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    f_lo, f_hi = full_row_run(c0, c1, qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, m_lo, m_hi)
    d_hi = gl.where(has_upper, d_max, DEV_NO_DIAGONAL)
    d_lo = gl.where(has_lower, d_min, -DEV_NO_DIAGONAL)
    return ks, ke, m_lo, m_hi, n_tiles, f_lo, f_hi, d_lo, d_hi


@gluon.jit
def _tile_rows(lse2_head_ptr, delta_head_ptr, r, m_hi, layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """A dK/dV tile's rows from ``r`` (in ``layout``) and their ``lse * log2(e)`` and ``delta``. Rows past the
    slice's reach get p = 0 through lse = +inf (their q and dO read as zeros)."""
    offs_m = r + gl.arange(0, BLOCK_M, layout=layout)
    mask_m = offs_m < m_hi
    lse2 = gl.load(lse2_head_ptr + offs_m, mask=mask_m, other=float("inf"))
    delta = gl.load(delta_head_ptr + offs_m, mask=mask_m, other=0.0)
    return offs_m, lse2, delta


@gluon.jit
def _dkdv_scores(qkT, dpT, lse2, delta, offs_n, offs_m, r, f_lo, f_hi, ks, ke, d_lo, d_hi, qk_scale2, scale, softcap,
                 HAS_SOFTCAP: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """P^T and dS^T of one tile from its S^T and dP^T (keys by rows), masked at the slice's cells."""
    pT, th = _probs(qkT, lse2, qk_scale2, scale, softcap, 0, HAS_SOFTCAP)
    is_edge = (r < f_lo) | (r + BLOCK_M > f_hi)
    if is_edge:
        pT = gl.where(_cell(offs_n, offs_m, ks, ke, d_lo, d_hi, IS_ROW_INTERVAL), pT, 0.0)
    dsT = pT * (dpT - gl.expand_dims(delta, 0))
    if HAS_SOFTCAP:
        dsT = dsT * (1.0 - th * th)
    if is_edge:
        # A key of the block that these rows do not read may hold NaN in v (dpT):
        # 0 * NaN must not reach its dK.
        dsT = gl.where(_cell(offs_n, offs_m, ks, ke, d_lo, d_hi, IS_ROW_INTERVAL), dsT, 0.0)
    return pT, dsT


@gluon.jit
def _opaque(x):
    """``x``, through an instruction the compiler cannot move out of a loop (see ``_dkdv_scores_rows``)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dkdv_scores_rows(s, dp, lse2, delta, n0, offs_m, r, f_lo, f_hi, ks, ke, d_lo, d_hi, qk_scale2, scale, softcap,
                      key_s: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr,
                      BLOCK_M: gl.constexpr):
    """``_dkdv_scores`` of a tile held by rows (``S`` and ``dP``, rows by keys): ``P`` and ``dS``."""
    HALF: gl.constexpr = s.shape[1]
    p, th = _probs(s, lse2, qk_scale2, scale, softcap, 1, HAS_SOFTCAP)
    ds = p * (dp - gl.expand_dims(delta, 1))
    if HAS_SOFTCAP:
        ds = ds * (1.0 - th * th)
    is_edge = (r < f_lo) | (r + BLOCK_M > f_hi)
    if is_edge:
        # The keys' vector is rebuilt here, per tile: held across the loop (where the compiler would hoist it)
        # it costs a register per key column the thread owns. Masking P and dS at the end gives the same values
        # as masking P before dS: a masked cell's dS is zero either way (a NaN of v included).
        offs_n = _opaque(n0) + gl.arange(0, HALF, layout=key_s)
        cell = _cell_rows(offs_m, offs_n, ks, ke, d_lo, d_hi, IS_ROW_INTERVAL)
        p = gl.where(cell, p, 0.0)
        ds = gl.where(cell, ds, 0.0)
    return p, ds


@gluon.jit
def _produce_dkdv_work(ptrs, smem, scalars, work, it, n_pairs, last_a, last_b, packed, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr,
                       HAS_PACKED_HEADS: gl.constexpr):
    """Loads of one work item, once both consumers are done with the previous one's K and V
    (``sm90_common.wait_halves_free``): the key block's K and V halves, then every (slice, query head) pair's
    q and dO tiles into ring tiles from ``it``. ``n_pairs`` counts bounded pairs so far (the descriptors'
    call site alternates); ``last_a`` / ``last_b`` is the last tile through each pair of descriptors.
    Returns them advanced. ``packed``: the program's k, v, q, dO descriptors over ``(T, H * D)`` (with
    ``HAS_PACKED_HEADS``)."""
    q_ptr, k_ptr, v_ptr, do_ptr, ws_ptr, dk_ptr, dv_ptr, slices_ptr, order_ptrs = ptrs
    k_smem, v_smem, q_smem, do_smem, kv_ready, kv_free, ready, empty, ps_smem = smem
    (Tq, Tk, Hq, Hkv, G, D, DV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
     stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale, softcap) = scalars
    pid_hk, c0, c1, s_lo, s_hi = work
    HALF: gl.constexpr = BLOCK_N // 2
    d_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_D * 2, 128), element_bitwidth=16)
    dv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_DV * 2, 128), element_bitwidth=16)
    hk = pid_hk.to(gl.int64)
    if HAS_PACKED_HEADS:
        k_desc, v_desc, q_all, do_all = packed
        k_col = pid_hk * BLOCK_D
        v_col = pid_hk * BLOCK_DV
    else:
        k_desc = tma.make_tensor_descriptor(k_ptr + hk * stride_kh, shape=[Tk, D], strides=[stride_kt, 1],
                                            block_shape=[HALF, BLOCK_D], layout=d_layout)
        v_desc = tma.make_tensor_descriptor(v_ptr + hk * stride_vh, shape=[Tk, DV], strides=[stride_vt, 1],
                                            block_shape=[HALF, BLOCK_DV], layout=dv_layout)
        k_col = 0
        v_col = 0
        q_all = 0
        do_all = 0
    for j in gl.static_range(2):
        mbarrier.expect(kv_ready.index(j), HALF * (BLOCK_D + BLOCK_DV) * 2)
        tma_load(k_desc, [c0 + j * HALF, k_col], kv_ready.index(j), k_smem.index(j))
        tma_load(v_desc, [c0 + j * HALF, v_col], kv_ready.index(j), v_smem.index(j))
    for sg in range(s_lo * G, s_hi * G):
        s = sg // G
        h32 = pid_hk * G + sg - s * G
        h = h32.to(gl.int64)
        qs, qe, ks, ke, mtype, m_lo, m_hi, n_tiles = _slice_rows(slices_ptr, s, c0, c1, BLOCK_M)
        # Rows at or past m_hi read as zeros.
        n_pairs, last_a, last_b = issue_run(q_all, do_all, h32 * BLOCK_D, h32 * BLOCK_DV, q_ptr + h * stride_qh,
                                            do_ptr + h * stride_doh, m_hi, D, DV, stride_qt, stride_dot, q_smem,
                                            do_smem, ready, empty, it, n_tiles, m_lo, n_pairs, last_a, last_b, BLOCK_M,
                                            BLOCK_D, BLOCK_DV, STAGES, HAS_PACKED_HEADS)
        it += n_tiles
    return it, n_pairs, last_a, last_b


@gluon.jit
def _producer(ptrs, smem, scalars, sched, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
              HAS_PACKED_HEADS: gl.constexpr, IS_BY_ROWS: gl.constexpr, IS_D_PADDED: gl.constexpr,
              IS_DV_PADDED: gl.constexpr, IS_DYNAMIC: gl.constexpr, IS_ADAPTIVE: gl.constexpr,
              IS_ROW_INTERVAL: gl.constexpr):
    q_ptr, k_ptr, v_ptr, do_ptr = ptrs[0], ptrs[1], ptrs[2], ptrs[3]
    block_lo_ptr, block_hi_ptr, block_order_ptr = ptrs[8]
    Tq, Tk, Hq, Hkv = scalars[0], scalars[1], scalars[2], scalars[3]
    stride_qt, stride_kt, stride_vt, stride_dot = scalars[7], scalars[9], scalars[11], scalars[13]
    n_work = gl.cdiv(Tk, BLOCK_N * SPLIT) * SPLIT * Hkv
    if HAS_PACKED_HEADS:
        # One descriptor per tensor for the whole program (sm90_common); the head is a column.
        q_all, k_all, v_all = packed_qkv(q_ptr, k_ptr, v_ptr, Tq, Tk, Hq, Hkv, stride_qt, stride_kt, stride_vt,
                                         BLOCK_M, BLOCK_N // 2, BLOCK_D, BLOCK_DV)
        packed = (k_all, v_all, q_all, bounded_desc(do_ptr, Tq, Hq * BLOCK_DV, stride_dot, BLOCK_M, BLOCK_DV))
    else:
        packed = (0, 0, 0, 0)
    it = 0
    n_pairs = 0
    wi = 0
    # The last tile loaded through each of the two pairs of descriptors (sm90_common: a
    # descriptor is rewritten only once the loads through it have landed).
    last_a = it - 1
    last_b = it - 1
    kv_free = smem[5]
    if IS_DYNAMIC:
        is_ticketed = takes_tickets(ptrs[7], ptrs[8], Tk, True, IS_ADAPTIVE, _MIN_LEN, _MAX_LEN)
        w = next_item(sched[0], wi, is_ticketed, IS_ADAPTIVE)
        while w < n_work:
            work = plan_program(w, Hkv, Tk, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT, BLOCK_N)
            post_item(sched, kv_free, wi, w, work)
            it, n_pairs, last_a, last_b = _produce_dkdv_work(ptrs, smem, scalars, work, it, n_pairs, last_a, last_b,
                                                             packed, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                                                             HAS_PACKED_HEADS)
            wi += 1
            w = next_item(sched[0], wi, is_ticketed, IS_ADAPTIVE)
        # The end: a ticket past the list.
        post_item(sched, kv_free, wi, w, (0, 0, 0, 0, 0))
    else:
        n_prog = gl.num_programs(0)
        for i in range(0, gl.cdiv(n_work, n_prog)):
            w = nth_work(i, n_prog)
            # The last round is short: some programs have no item in it.
            if w < n_work:
                wait_halves_free(kv_free, wi)
                work = plan_program(w, Hkv, Tk, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT, BLOCK_N)
                it, n_pairs, last_a, last_b = _produce_dkdv_work(ptrs, smem, scalars, work, it, n_pairs, last_a,
                                                                 last_b, packed, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                                                                 STAGES, HAS_PACKED_HEADS)
                wi += 1


@gluon.jit
def _store_dkdv(dk, dv, ptrs, scalars, pid_hk, n0, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
                IS_D_PADDED: gl.constexpr, IS_DV_PADDED: gl.constexpr):
    """A consumer's keys ``[n0, n0 + HALF)`` of dK (scaled here) and dV, in 16-byte runs (sm90_common.store_rows)."""
    dk_ptr, dv_ptr = ptrs[5], ptrs[6]
    (Tq, Tk, Hq, Hkv, G, D, DV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
     stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale, softcap) = scalars
    # Unpadded head dims as the constant tile widths (as the Triton kernels do), so that the column masks
    # fold away and the stores vectorize (a mask against a runtime width keeps them 2 bytes wide).
    if not IS_D_PADDED:
        D = BLOCK_D
    if not IS_DV_PADDED:
        DV = BLOCK_DV
    hk = pid_hk.to(gl.int64)
    store_rows(dk_ptr + hk * stride_dkh, dk * scale, n0, Tk, stride_dkt, D, True)
    store_rows(dv_ptr + hk * stride_dvh, dv, n0, Tk, stride_dvt, DV, True)


@gluon.jit
def _consume_dkdv_work(ptrs, smem, scalars, work, it, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                       STAGES: gl.constexpr, IS_BY_ROWS: gl.constexpr, IS_D_PADDED: gl.constexpr,
                       IS_DV_PADDED: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, J: gl.constexpr):
    """Keys ``[c0 + J * BLOCK_N / 2, ...)`` of one work item's block, on one warpgroup, from ring tile ``it``;
    returns ``it`` advanced. The K and V halves are released after their last matmul.

    Held by keys: per tile ``S^T = K Q^T`` and ``dP^T = V dO^T``, then ``P^T`` and ``dS^T`` stay in
    registers as the first operands of ``dV += P^T dO`` and ``dK += dS^T Q``. With ``IS_BY_ROWS``
    the scores are held by rows: ``S = Q K^T`` and ``dP = dO V^T`` (rows by this warpgroup's keys, so each
    thread keeps two rows' lse and delta, and with ``BLOCK_M`` as wide as the warpgroup's keys every score
    matmul is ``HALF`` wide), and ``P`` and ``dS`` go through shared memory, read transposed by the dV and
    dK matmuls. The sums over each tile's rows run inside one matmul either way: the same bits."""
    q_ptr, k_ptr, v_ptr, do_ptr, ws_ptr, dk_ptr, dv_ptr, slices_ptr, order_ptrs = ptrs
    k_smem, v_smem, q_smem, do_smem, kv_ready, kv_free, ready, empty, ps_smem = smem
    (Tq, Tk, Hq, Hkv, G, D, DV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
     stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale, softcap) = scalars
    pid_hk, c0, c1, s_lo, s_hi = work
    HALF: gl.constexpr = BLOCK_N // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    if IS_BY_ROWS:
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF, 16])
    else:
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    mma_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_D, 16])
    mma_v: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_DV, 16])
    if IS_BY_ROWS:
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        key_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    else:
        pt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_v, k_width=2)
        dst_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_k, k_width=2)
        key_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        row_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    qk_scale2 = scale * DEV_LOG2E
    n0 = c0 + J * HALF
    if not IS_BY_ROWS:
        # By rows it is rebuilt per edge tile (_dkdv_scores_rows).
        offs_n = n0 + gl.arange(0, HALF, layout=key_s)
    dk = gl.zeros([HALF, BLOCK_D], gl.float32, layout=mma_k)
    dv = gl.zeros([HALF, BLOCK_DV], gl.float32, layout=mma_v)
    if not IS_BY_ROWS:
        t_zero = gl.zeros([HALF, BLOCK_M], gl.float32, layout=mma_s)
    k_half = k_smem.index(J)
    v_half = v_smem.index(J)
    if IS_BY_ROWS:
        # This warpgroup's P and dS of the last tile ([BLOCK_M, HALF] each).
        p_buf = ps_smem.index(2 * J)
        ds_buf = ps_smem.index(2 * J + 1)
    lse2_ptr = ws_ptr + Hq.to(gl.int64) * Tq
    # Released after the item's last score matmuls, so that a persistent program's next K and V
    # load under this item's last dV / dK matmuls and its epilogue (at the end if it has no tile).
    kv_held = 1
    # A tile's dV / dK matmuls are issued after the next tile's score matmuls and run under its
    # element-wise work (the same accumulations in the same order): ``pending`` says a tile's
    # operands wait (in ``pt_op`` / ``dst_op``, or by rows in shared memory, written over only after
    # those matmuls are done), its q and dO still in ring slot ``p_slot``.
    pending = 0
    p_slot = 0
    if not IS_BY_ROWS:
        pt_op = gl.zeros([HALF, BLOCK_M], dtype, layout=pt_layout)
        dst_op = gl.zeros([HALF, BLOCK_M], dtype, layout=dst_layout)
    for sg in range(s_lo * G, s_hi * G):
        s = sg // G
        h = (pid_hk * G + sg - s * G).to(gl.int64)
        ks, ke, m_lo, m_hi, n_tiles, f_lo, f_hi, d_lo, d_hi = _pair_geometry(slices_ptr, s, c0, c1, BLOCK_M)
        delta_head_ptr = ws_ptr + h * Tq
        lse2_head_ptr = lse2_ptr + h * Tq
        is_last_pair = sg == s_hi * G - 1
        for t in range(n_tiles):
            cur = it + t
            slot = cur % STAGES
            r = m_lo + t * BLOCK_M
            offs_m, lse2, delta = _tile_rows(lse2_head_ptr, delta_head_ptr, r, m_hi, row_s, BLOCK_M)
            mbarrier.wait(ready.index(slot), (cur // STAGES) & 1)
            q_tile = q_smem.index(slot)
            do_tile = do_smem.index(slot)
            # This tile's score matmuls in one batch, then the previous tile's dV and dK in another;
            # both are waited for within this iteration (an accumulator in flight cannot be carried).
            # An async accumulator cannot leave a (runtime) branch: each branch waits for what it issued.
            if IS_BY_ROWS:
                # Fresh zeros per tile: a zero tile kept across the loop would hold registers throughout.
                qk = warpgroup_mma(q_tile, k_half.permute((1, 0)),
                                   gl.zeros([BLOCK_M, HALF], gl.float32, layout=mma_s), use_acc=False,
                                   is_async=True)
                dp = warpgroup_mma(do_tile, v_half.permute((1, 0)),
                                   gl.zeros([BLOCK_M, HALF], gl.float32, layout=mma_s), use_acc=False,
                                   is_async=True)
                if pending == 1:
                    dv = warpgroup_mma(p_buf.permute((1, 0)), do_smem.index(p_slot), dv, is_async=True)
                    dk = warpgroup_mma(ds_buf.permute((1, 0)), q_smem.index(p_slot), dk, is_async=True)
                    sv, dpv = warpgroup_mma_wait(2, deps=(qk, dp))
                    p, ds = _dkdv_scores_rows(sv, dpv, lse2, delta, n0, offs_m, r, f_lo, f_hi, ks, ke, d_lo,
                                              d_hi, qk_scale2, scale, softcap, key_s, HAS_SOFTCAP, IS_ROW_INTERVAL,
                                              BLOCK_M)
                    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                    mbarrier.arrive(empty.index(p_slot), count=1)
                else:
                    sv, dpv = warpgroup_mma_wait(0, deps=(qk, dp))
                    p, ds = _dkdv_scores_rows(sv, dpv, lse2, delta, n0, offs_m, r, f_lo, f_hi, ks, ke, d_lo,
                                              d_hi, qk_scale2, scale, softcap, key_s, HAS_SOFTCAP, IS_ROW_INTERVAL,
                                              BLOCK_M)
            else:
                qkT = warpgroup_mma(k_half, q_tile.permute((1, 0)), t_zero, use_acc=False, is_async=True)
                dpT = warpgroup_mma(v_half, do_tile.permute((1, 0)), t_zero, use_acc=False, is_async=True)
                if pending == 1:
                    dv = warpgroup_mma(pt_op, do_smem.index(p_slot), dv, is_async=True)
                    dk = warpgroup_mma(dst_op, q_smem.index(p_slot), dk, is_async=True)
                    sT, dT = warpgroup_mma_wait(2, deps=(qkT, dpT))
                    pT, dsT = _dkdv_scores(sT, dT, lse2, delta, offs_n, offs_m, r, f_lo, f_hi, ks, ke, d_lo, d_hi,
                                           qk_scale2, scale, softcap, HAS_SOFTCAP, IS_ROW_INTERVAL, BLOCK_M)
                    dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
                    mbarrier.arrive(empty.index(p_slot), count=1)
                else:
                    sT, dT = warpgroup_mma_wait(0, deps=(qkT, dpT))
                    pT, dsT = _dkdv_scores(sT, dT, lse2, delta, offs_n, offs_m, r, f_lo, f_hi, ks, ke, d_lo, d_hi,
                                           qk_scale2, scale, softcap, HAS_SOFTCAP, IS_ROW_INTERVAL, BLOCK_M)
            if is_last_pair & (t == n_tiles - 1):
                mbarrier.arrive(kv_free.index(J), count=1)
                kv_held = 0
            if IS_BY_ROWS:
                p_buf.store(p.to(dtype))
                ds_buf.store(ds.to(dtype))
                # Every thread's stores reach the matmuls' (async) reads: a proxy fence, then the
                # warpgroup's barrier.
                fence_async_shared()
                cta_barrier()
            else:
                pt_op = gl.convert_layout(pT.to(dtype), pt_layout)
                dst_op = gl.convert_layout(dsT.to(dtype), dst_layout)
            pending = 1
            p_slot = slot
        it += n_tiles
    if kv_held == 1:
        mbarrier.arrive(kv_free.index(J), count=1)
    if pending == 1:
        if IS_BY_ROWS:
            dv = warpgroup_mma(p_buf.permute((1, 0)), do_smem.index(p_slot), dv, is_async=True)
            dk = warpgroup_mma(ds_buf.permute((1, 0)), q_smem.index(p_slot), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        else:
            dv = warpgroup_mma(pt_op, do_smem.index(p_slot), dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_smem.index(p_slot), dk, is_async=True)
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
        mbarrier.arrive(empty.index(p_slot), count=1)
    _store_dkdv(dk, dv, ptrs, scalars, pid_hk, n0, BLOCK_D, BLOCK_DV, IS_D_PADDED, IS_DV_PADDED)
    return it


@gluon.jit
def _consumer(ptrs, smem, scalars, sched, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
              IS_BY_ROWS: gl.constexpr, IS_D_PADDED: gl.constexpr, IS_DV_PADDED: gl.constexpr,
              IS_DYNAMIC: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, J: gl.constexpr):
    """Half ``J`` of every work item of this program, on one warpgroup."""
    block_lo_ptr, block_hi_ptr, block_order_ptr = ptrs[8]
    kv_ready = smem[4]
    Tk, Hkv = scalars[1], scalars[3]
    n_work = gl.cdiv(Tk, BLOCK_N * SPLIT) * SPLIT * Hkv
    it = 0
    wi = 0
    if IS_DYNAMIC:
        w = read_ticket(sched, wi)
        while w < n_work:
            work = read_work(sched)
            mbarrier.wait(kv_ready.index(J), wi & 1)
            it = _consume_dkdv_work(ptrs, smem, scalars, work, it, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP,
                                    STAGES, IS_BY_ROWS, IS_D_PADDED, IS_DV_PADDED, IS_ROW_INTERVAL, J)
            wi += 1
            w = read_ticket(sched, wi)
    else:
        n_prog = gl.num_programs(0)
        for i in range(0, gl.cdiv(n_work, n_prog)):
            w = nth_work(i, n_prog)
            if w < n_work:
                work = plan_program(w, Hkv, Tk, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT, BLOCK_N)
                mbarrier.wait(kv_ready.index(J), wi & 1)
                it = _consume_dkdv_work(ptrs, smem, scalars, work, it, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                                        HAS_SOFTCAP, STAGES, IS_BY_ROWS, IS_D_PADDED, IS_DV_PADDED, IS_ROW_INTERVAL, J)
                wi += 1


@gluon.jit
def _consumer_1(ptrs, smem, scalars, sched, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, STAGES: gl.constexpr,
                HAS_PACKED_HEADS: gl.constexpr, IS_BY_ROWS: gl.constexpr, IS_D_PADDED: gl.constexpr,
                IS_DV_PADDED: gl.constexpr, IS_DYNAMIC: gl.constexpr, IS_ADAPTIVE: gl.constexpr,
                IS_ROW_INTERVAL: gl.constexpr):
    # Worker partitions share one signature: the second half's consumer, in the producer's.
    _consumer(ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, STAGES,
              IS_BY_ROWS, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ROW_INTERVAL, 1)


@gluon.jit(do_not_specialize=["Tq", "Tk", "Hq", "Hkv", "G", "D", "DV"])
def bwd_dkdv_sm90_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, ws_ptr, dk_ptr, dv_ptr,
    slices_ptr, block_lo_ptr, block_hi_ptr, block_order_ptr,
    Tq, Tk, Hq, Hkv, G, D, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, softcap,
    HAS_SOFTCAP: gl.constexpr, IS_INT64: gl.constexpr, DOT_PRECISION: gl.constexpr, IS_BF16_EMULATED: gl.constexpr,
    IS_D_PADDED: gl.constexpr, IS_DV_PADDED: gl.constexpr, SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr, IS_DYNAMIC: gl.constexpr,
    IS_ADAPTIVE: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, ticket_ptr,
):
    """The Triton dK/dV kernel's parameters, plus ``STAGES``, ``NUM_WARPS``, ``HAS_PACKED_HEADS`` (each row
    of q, k, v and dO holds its heads side by side, ``D`` and ``DV`` wide: one descriptor per tensor and
    program, sm90_common), ``IS_DYNAMIC`` and ``ticket_ptr`` (the programs take their items from this
    zeroed counter, sm90_common.take_item; untouched otherwise), ``IS_ADAPTIVE`` (with ``IS_DYNAMIC``: the
    counter only when the mask's heaviest slice is short, sm90_common.takes_tickets); launched with 4 warps
    (the first consumer) plus a 4-warp and a 1-warp worker, under a register cap the partitions split. On the Triton kernel's
    grid each program owns one work item; on a smaller (persistent) grid each walks several."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = BLOCK_N // 2
    d_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_D * 2, 128), element_bitwidth=16)
    dv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_DV * 2, 128), element_bitwidth=16)

    # The scores held by rows (_consume_dkdv_work), P and dS through shared memory: 64-row tiles at head dim
    # 128, 128-row tiles at head dim 64 (the same registers for the scores and accumulators).
    IS_BY_ROWS: gl.constexpr = (((BLOCK_M == HALF) and (max(BLOCK_D, BLOCK_DV) == 128))
                                or ((BLOCK_M == 2 * HALF) and (max(BLOCK_D, BLOCK_DV) == 64)))
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], d_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_DV], dv_layout)
    if IS_BY_ROWS:
        ps_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(HALF * 2, 128), element_bitwidth=16)
        ps_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_M, HALF], ps_layout)
    else:
        ps_smem = 0
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], d_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_DV], dv_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)

    # Runtime values only in the tuple variables (a constexpr stored in one reaches the partitions as a tensor).
    ptrs = (q_ptr, k_ptr, v_ptr, do_ptr, ws_ptr, dk_ptr, dv_ptr, slices_ptr, (block_lo_ptr, block_hi_ptr,
                                                                             block_order_ptr))
    smem = (k_smem, v_smem, q_smem, do_smem, kv_ready, kv_free, ready, empty, ps_smem)
    scalars = (Tq, Tk, Hq, Hkv, G, D, DV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, scale, softcap)
    item, posted = sched_buffers()
    sched = (ticket_ptr, item, posted)
    gl.warp_specialize([
        (_consumer, (ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, STAGES,
                     IS_BY_ROWS, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ROW_INTERVAL, 0)),
        (_consumer_1, (ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, STAGES,
                       HAS_PACKED_HEADS, IS_BY_ROWS, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ADAPTIVE,
                       IS_ROW_INTERVAL)),
        (_producer, (ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, STAGES,
                     HAS_PACKED_HEADS, IS_BY_ROWS, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ADAPTIVE,
                     IS_ROW_INTERVAL)),
    ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------------------
# dQ (and the (delta, lse * log2(e)) workspace), same structure: a producer warp loads the query
# block's two halves once and each slice's K/V tiles into a ring (descriptors ending at the
# slice's last key); two consumer warpgroups of 64 rows each load their dO and O rows with
# pointers (uncovered rows read as zeros, so a NaN there cannot reach dQ), write delta and
# lse * log2(e) for their rows, then walk the key tiles: S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.


@gluon.jit
def _produce_dq_work(ptrs, smem, scalars, work, it, n_sl, last_a, last_b, packed, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr,
                     HAS_PACKED_HEADS: gl.constexpr):
    """Loads of one work item, once both consumers are done with the previous one's queries
    (``sm90_common.wait_halves_free``): its query halves, then every slice's K/V tiles into ring tiles from ``it``
    (counters and ``packed``, the q, k, v descriptors, as in ``_produce_dkdv_work``)."""
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, ws_ptr, dq_ptr, slices_ptr, order_ptrs = ptrs
    q_smem, k_smem, v_smem, q_ready, q_free, ready, empty = smem
    (Tq, Tk, Hq, G, D, DV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
     stride_ot, stride_oh, stride_lt, stride_lh, stride_dlt, stride_dlh, stride_dqt, stride_dqh, scale,
     softcap) = scalars
    pid_h, r0, r1, s_lo, s_hi = work
    HALF: gl.constexpr = BLOCK_M // 2
    d_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_D * 2, 128), element_bitwidth=16)
    h = pid_h.to(gl.int64)
    hk = (pid_h // G).to(gl.int64)
    if HAS_PACKED_HEADS:
        q_desc, k_all, v_all = packed
        q_col = pid_h * BLOCK_D
    else:
        q_desc = tma.make_tensor_descriptor(q_ptr + h * stride_qh, shape=[Tq, D], strides=[stride_qt, 1],
                                            block_shape=[HALF, BLOCK_D], layout=d_layout)
        q_col = 0
        k_all = 0
        v_all = 0
    for j in gl.static_range(2):
        mbarrier.expect(q_ready.index(j), HALF * BLOCK_D * 2)
        tma_load(q_desc, [r0 + j * HALF, q_col], q_ready.index(j), q_smem.index(j))
    for s in range(s_lo, s_hi):
        qs, qe, ks, ke, mtype, n_lo, n_hi, n_tiles = _slice_keys(slices_ptr, s, r0, r1, BLOCK_N)
        # Keys at or past the slice's end read as zeros.
        n_sl, last_a, last_b = issue_run(k_all, v_all, (pid_h // G) * BLOCK_D, (pid_h // G) * BLOCK_DV,
                                         k_ptr + hk * stride_kh, v_ptr + hk * stride_vh, ke, D, DV, stride_kt,
                                         stride_vt, k_smem, v_smem, ready, empty, it, n_tiles, n_lo, n_sl, last_a,
                                         last_b, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, HAS_PACKED_HEADS)
        it += n_tiles
    return it, n_sl, last_a, last_b


@gluon.jit
def _dq_producer(ptrs, smem, scalars, sched, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_DLSE: gl.constexpr,
                 STAGES: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr, IS_D_PADDED: gl.constexpr,
                 IS_DV_PADDED: gl.constexpr, IS_DYNAMIC: gl.constexpr, IS_ADAPTIVE: gl.constexpr,
                 IS_ROW_INTERVAL: gl.constexpr):
    q_ptr, k_ptr, v_ptr = ptrs[0], ptrs[1], ptrs[2]
    block_lo_ptr, block_hi_ptr, block_order_ptr = ptrs[10]
    Tq, Tk, Hq, G = scalars[0], scalars[1], scalars[2], scalars[3]
    stride_qt, stride_kt, stride_vt = scalars[6], scalars[8], scalars[10]
    n_work = gl.cdiv(Tq, BLOCK_M * SPLIT) * SPLIT * Hq
    if HAS_PACKED_HEADS:
        packed = packed_qkv(q_ptr, k_ptr, v_ptr, Tq, Tk, Hq, Hq // G, stride_qt, stride_kt, stride_vt, BLOCK_M // 2,
                            BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        packed = (0, 0, 0)
    it = 0
    n_sl = 0
    wi = 0
    # As in the dK/dV producer: two pairs of descriptors by turns.
    last_a = it - 1
    last_b = it - 1
    q_free = smem[4]
    if IS_DYNAMIC:
        is_ticketed = takes_tickets(ptrs[9], ptrs[10], Tq, False, IS_ADAPTIVE, _MIN_LEN, _MAX_LEN)
        w = next_item(sched[0], wi, is_ticketed, IS_ADAPTIVE)
        while w < n_work:
            work = plan_program(w, Hq, Tq, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT, BLOCK_M)
            post_item(sched, q_free, wi, w, work)
            it, n_sl, last_a, last_b = _produce_dq_work(ptrs, smem, scalars, work, it, n_sl, last_a, last_b, packed,
                                                        BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, HAS_PACKED_HEADS)
            wi += 1
            w = next_item(sched[0], wi, is_ticketed, IS_ADAPTIVE)
        # The end: a ticket past the list.
        post_item(sched, q_free, wi, w, (0, 0, 0, 0, 0))
    else:
        n_prog = gl.num_programs(0)
        for i in range(0, gl.cdiv(n_work, n_prog)):
            w = nth_work(i, n_prog)
            if w < n_work:
                wait_halves_free(q_free, wi)
                work = plan_program(w, Hq, Tq, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT, BLOCK_M)
                it, n_sl, last_a, last_b = _produce_dq_work(ptrs, smem, scalars, work, it, n_sl, last_a, last_b,
                                                            packed, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                                                            HAS_PACKED_HEADS)
                wi += 1


@gluon.jit
def _slice_keys(slices_ptr, s, r0, r1, BLOCK_N: gl.constexpr):
    """A slice's keys ``[n_lo, n_hi)`` that rows ``[r0, r1)`` read, its tiles from ``n_lo``, and its geometry."""
    qs, qe, ks, ke, mtype = load_slice(slices_ptr, s)
    n_lo, n_hi = key_span(r0, r1, qs, qe, ks, ke, mtype)
    n_tiles = gl.cdiv(gl.maximum(n_hi - n_lo, 0), BLOCK_N)
    return qs, qe, ks, ke, mtype, n_lo, n_hi, n_tiles


@gluon.jit
def _dq_scores(qk, dp, lse2, delta, offs_m, c, f_lo, f_hi, qs, qe, n_lo, n_hi, d_lo, d_hi, qk_scale2, scale, softcap,
               col_s: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """dS of one tile from its S and dP (rows by keys), masked at the slice's cells."""
    p, th = _probs(qk, lse2, qk_scale2, scale, softcap, 1, HAS_SOFTCAP)
    is_edge = (c < f_lo) | (c + BLOCK_N > f_hi)
    if is_edge:
        if IS_ROW_INTERVAL:
            cell = row_cells(offs_m, gl.arange(0, BLOCK_N, layout=col_s), c, (offs_m >= qs) & (offs_m < qe), n_lo,
                             n_hi, d_lo, d_hi)
        else:
            offs_n = c + gl.arange(0, BLOCK_N, layout=col_s)
            diag = gl.expand_dims(offs_n, 0) - gl.expand_dims(offs_m, 1)
            cell = (gl.expand_dims((offs_m >= qs) & (offs_m < qe), 1)
                    & gl.expand_dims((offs_n >= n_lo) & (offs_n < n_hi), 0) & (diag <= d_hi) & (diag >= d_lo))
        p = gl.where(cell, p, 0.0)
    ds = p * (dp - gl.expand_dims(delta, 1))
    if HAS_SOFTCAP:
        ds = ds * (1.0 - th * th)
    return ds


@gluon.jit
def _consume_dq_work(ptrs, smem, scalars, work, it, wi, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                     HAS_DLSE: gl.constexpr, STAGES: gl.constexpr, IS_D_PADDED: gl.constexpr,
                     IS_DV_PADDED: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, J: gl.constexpr):
    """Rows ``[r0 + J * BLOCK_M / 2, ...)`` of one work item's block, on one warpgroup, from ring tile ``it``
    (``wi`` items before it); returns ``it`` advanced. The query half is released after its last matmul."""
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, ws_ptr, dq_ptr, slices_ptr, order_ptrs = ptrs
    q_smem, k_smem, v_smem, q_ready, q_free, ready, empty = smem
    (Tq, Tk, Hq, G, D, DV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
     stride_ot, stride_oh, stride_lt, stride_lh, stride_dlt, stride_dlh, stride_dqt, stride_dqh, scale,
     softcap) = scalars
    # Unpadded head dims as constants, as in _store_dkdv: the dO / O loads and dQ stores vectorize.
    if not IS_D_PADDED:
        D = BLOCK_D
    if not IS_DV_PADDED:
        DV = BLOCK_DV
    pid_h, r0, r1, s_lo, s_hi = work
    HALF: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_D, 16])
    do_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_q, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    h = pid_h.to(gl.int64)
    h0 = r0 + J * HALF
    h1 = h0 + HALF
    # Rows no slice covers (lse = -inf) and rows past Tq: lse = +inf, so p = 0 whatever the tile; their
    # dO, O and dlse are not loaded (dO = 0, delta = 0).
    rows_b = h0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, blk))
    cols_b = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, blk))
    lse_b = gl.load(lse_ptr + h * stride_lh + rows_b.to(gl.int64) * stride_lt, mask=rows_b < Tq,
                    other=float("-inf"))
    covered_b = lse_b != float("-inf")
    m2 = gl.expand_dims(covered_b, 1) & gl.expand_dims(cols_b < DV, 0)
    do_b = gl.load(do_ptr + h * stride_doh + gl.expand_dims(rows_b.to(gl.int64) * stride_dot, 1)
                   + gl.expand_dims(cols_b, 0), mask=m2, other=0.0)
    o_b = gl.load(o_ptr + h * stride_oh + gl.expand_dims(rows_b.to(gl.int64) * stride_ot, 1)
                  + gl.expand_dims(cols_b, 0), mask=m2, other=0.0)
    delta_b = gl.sum(o_b.to(gl.float32) * do_b.to(gl.float32), 1)
    if HAS_DLSE:
        delta_b -= gl.load(dlse_ptr + h * stride_dlh + rows_b.to(gl.int64) * stride_dlt, mask=covered_b, other=0.0)
    lse2_b = gl.where(covered_b, lse_b * DEV_LOG2E, float("inf"))
    gl.store(ws_ptr + h * Tq + rows_b, delta_b, mask=rows_b < Tq)
    gl.store(ws_ptr + (Hq.to(gl.int64) + h) * Tq + rows_b, lse2_b, mask=rows_b < Tq)
    do_op = gl.convert_layout(do_b, do_layout)
    delta = gl.convert_layout(delta_b, row_s)
    lse2 = gl.convert_layout(lse2_b, row_s)
    offs_m = h0 + gl.arange(0, HALF, layout=row_s)
    dq = gl.zeros([HALF, BLOCK_D], gl.float32, layout=mma_q)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=mma_s)
    qk_scale2 = scale * DEV_LOG2E
    q_half = q_smem.index(J)
    mbarrier.wait(q_ready.index(J), wi & 1)
    # Released after the item's last S / dP matmuls, so that a persistent program's next queries load
    # under this item's last dQ matmul and its epilogue (at the end if it has no tile).
    q_held = 1
    # A tile's dQ matmul is issued after the next tile's S / dP and runs under its element-wise
    # work (the same accumulation in the same order): ``pending`` says a tile's dS waits in
    # ``ds_op``, its keys still in ring slot ``p_slot``.
    pending = 0
    p_slot = 0
    ds_op = gl.zeros([HALF, BLOCK_N], dtype, layout=ds_layout)
    for s in range(s_lo, s_hi):
        qs, qe, ks, ke, mtype, n_lo, n_hi, n_tiles = _slice_keys(slices_ptr, s, r0, r1, BLOCK_N)
        has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
        # Keys that every row of this half reads form one run [f_lo, f_hi).
        f_lo = gl.where(has_lower, gl.maximum(ks, h1 - 1 + d_min), ks)
        f_hi = gl.where(has_upper, gl.minimum(ke, h0 + d_max + 1), ke)
        f_lo = gl.minimum(gl.maximum(f_lo, n_lo), n_hi)
        f_hi = gl.minimum(gl.maximum(f_hi, f_lo), n_hi)
        rows_inside = (h0 >= qs) & (h1 <= qe)
        f_lo = gl.where(rows_inside, f_lo, n_hi)
        f_hi = gl.where(rows_inside, f_hi, n_hi)
        d_hi = gl.where(has_upper, d_max, DEV_NO_DIAGONAL)
        d_lo = gl.where(has_lower, d_min, -DEV_NO_DIAGONAL)
        is_last_slice = s == s_hi - 1
        for t in range(n_tiles):
            cur = it + t
            slot = cur % STAGES
            c = n_lo + t * BLOCK_N
            mbarrier.wait(ready.index(slot), (cur // STAGES) & 1)
            k_tile = k_smem.index(slot)
            # This tile's S and dP in one batch, then the previous tile's dQ (as in the dK/dV kernel).
            qk = warpgroup_mma(q_half, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_op, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # An async accumulator cannot leave a branch: each branch waits for what it issued.
            if pending == 1:
                dq = warpgroup_mma(ds_op, k_smem.index(p_slot), dq, is_async=True)
                sc, dpc, do_op = warpgroup_mma_wait(1, deps=(qk, dp, do_op))
                ds = _dq_scores(sc, dpc, lse2, delta, offs_m, c, f_lo, f_hi, qs, qe, n_lo, n_hi, d_lo, d_hi,
                                qk_scale2, scale, softcap, col_s, HAS_SOFTCAP, IS_ROW_INTERVAL, BLOCK_N)
                dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
                mbarrier.arrive(empty.index(p_slot), count=1)
            else:
                sc, dpc, do_op = warpgroup_mma_wait(0, deps=(qk, dp, do_op))
                ds = _dq_scores(sc, dpc, lse2, delta, offs_m, c, f_lo, f_hi, qs, qe, n_lo, n_hi, d_lo, d_hi,
                                qk_scale2, scale, softcap, col_s, HAS_SOFTCAP, IS_ROW_INTERVAL, BLOCK_N)
            if is_last_slice & (t == n_tiles - 1):
                mbarrier.arrive(q_free.index(J), count=1)
                q_held = 0
            ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
            pending = 1
            p_slot = slot
        it += n_tiles
    if q_held == 1:
        mbarrier.arrive(q_free.index(J), count=1)
    if pending == 1:
        dq = warpgroup_mma(ds_op, k_smem.index(p_slot), dq, is_async=True)
        dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
        mbarrier.arrive(empty.index(p_slot), count=1)

    dq = dq * scale
    store_rows(dq_ptr + h * stride_dqh, dq, h0, Tq, stride_dqt, D, True)
    return it


@gluon.jit
def _dq_consumer(ptrs, smem, scalars, sched, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_DLSE: gl.constexpr,
                 STAGES: gl.constexpr, IS_D_PADDED: gl.constexpr, IS_DV_PADDED: gl.constexpr,
                 IS_DYNAMIC: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, J: gl.constexpr):
    """Half ``J`` of every work item of this program, on one warpgroup."""
    block_lo_ptr, block_hi_ptr, block_order_ptr = ptrs[10]
    Tq, Hq = scalars[0], scalars[2]
    n_work = gl.cdiv(Tq, BLOCK_M * SPLIT) * SPLIT * Hq
    it = 0
    wi = 0
    if IS_DYNAMIC:
        # _consume_dq_work waits for the queries itself (its dO and O rows load first).
        w = read_ticket(sched, wi)
        while w < n_work:
            work = read_work(sched)
            it = _consume_dq_work(ptrs, smem, scalars, work, it, wi, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                                  HAS_SOFTCAP, HAS_DLSE, STAGES, IS_D_PADDED, IS_DV_PADDED, IS_ROW_INTERVAL, J)
            wi += 1
            w = read_ticket(sched, wi)
    else:
        n_prog = gl.num_programs(0)
        for i in range(0, gl.cdiv(n_work, n_prog)):
            w = nth_work(i, n_prog)
            if w < n_work:
                work = plan_program(w, Hq, Tq, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT, BLOCK_M)
                it = _consume_dq_work(ptrs, smem, scalars, work, it, wi, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                                      HAS_SOFTCAP, HAS_DLSE, STAGES, IS_D_PADDED, IS_DV_PADDED, IS_ROW_INTERVAL, J)
                wi += 1


@gluon.jit
def _dq_consumer_1(ptrs, smem, scalars, sched, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_DLSE: gl.constexpr,
                   STAGES: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr, IS_D_PADDED: gl.constexpr,
                   IS_DV_PADDED: gl.constexpr, IS_DYNAMIC: gl.constexpr, IS_ADAPTIVE: gl.constexpr,
                   IS_ROW_INTERVAL: gl.constexpr):
    _dq_consumer(ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, HAS_DLSE,
                 STAGES, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ROW_INTERVAL, 1)


@gluon.jit(do_not_specialize=["Tq", "Tk", "Hq", "G", "D", "DV"])
def bwd_dq_sm90_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, ws_ptr, dq_ptr,
    slices_ptr, block_lo_ptr, block_hi_ptr, block_order_ptr,
    Tq, Tk, Hq, G, D, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_dot, stride_doh, stride_ot, stride_oh, stride_lt, stride_lh, stride_dlt, stride_dlh,
    stride_dqt, stride_dqh,
    scale, softcap,
    HAS_DLSE: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_INT64: gl.constexpr, DOT_PRECISION: gl.constexpr,
    IS_BF16_EMULATED: gl.constexpr,
    IS_D_PADDED: gl.constexpr, IS_DV_PADDED: gl.constexpr, SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr, IS_DYNAMIC: gl.constexpr,
    IS_ADAPTIVE: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, ticket_ptr,
):
    """The Triton dQ kernel's parameters, plus ``STAGES``, ``NUM_WARPS`` (``BLOCK_M`` = 128),
    ``HAS_PACKED_HEADS`` (q, k and v), ``IS_DYNAMIC``, ``IS_ADAPTIVE`` and ``ticket_ptr``, as in the dK/dV
    kernel; on its grid each program owns one work item, on a smaller (persistent) grid each walks several."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = BLOCK_M // 2
    d_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_D * 2, 128), element_bitwidth=16)
    dv_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_DV * 2, 128), element_bitwidth=16)

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, BLOCK_D], d_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], d_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_DV], dv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)

    ptrs = (q_ptr, k_ptr, v_ptr, do_ptr, o_ptr, lse_ptr, dlse_ptr, ws_ptr, dq_ptr, slices_ptr,
            (block_lo_ptr, block_hi_ptr, block_order_ptr))
    smem = (q_smem, k_smem, v_smem, q_ready, q_free, ready, empty)
    scalars = (Tq, Tk, Hq, G, D, DV, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
               stride_doh, stride_ot, stride_oh, stride_lt, stride_lh, stride_dlt, stride_dlh, stride_dqt, stride_dqh,
               scale, softcap)
    item, posted = sched_buffers()
    sched = (ticket_ptr, item, posted)
    gl.warp_specialize([
        (_dq_consumer, (ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP,
                        HAS_DLSE, STAGES, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ROW_INTERVAL, 0)),
        (_dq_consumer_1, (ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP,
                          HAS_DLSE, STAGES, HAS_PACKED_HEADS, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ADAPTIVE,
                          IS_ROW_INTERVAL)),
        (_dq_producer, (ptrs, smem, scalars, sched, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP,
                        HAS_DLSE, STAGES, HAS_PACKED_HEADS, IS_D_PADDED, IS_DV_PADDED, IS_DYNAMIC, IS_ADAPTIVE,
                        IS_ROW_INTERVAL)),
    ], [4, 1], [240, 24])
