"""Hopper (sm_90) forward of range attention in Gluon (docs/design.md §6, "the Hopper forward").

Supported: bfloat16 and float16, padded head dims ``D`` and ``Dv`` of 64 or
128 whose rows are 16-byte aligned, every slice type, overlapping and empty
slices, GQA, softcap, max logits, CUDA graphs and ``torch.compile`` (through
the same op as the Triton kernel). Not supported here, so the Triton kernel of
:mod:`flashrange.kernels.forward` runs instead: float32, other head dims, GPUs
other than compute capability 9.x, and the interpreter.

Same work items (a block of ``BLOCK_M`` query rows of one head, walking the
slices of its plan window in order with one online softmax), heavy-first order
and plan as the Triton kernel. On the Triton kernel's grid a program computes
one item; on a persistent grid (the default config) each walks several
(``sm90_common.nth_work``), or with ``IS_DYNAMIC`` takes them one by one from a
counter (``sm90_common.take_item``; with ``IS_ADAPTIVE`` only where the mask's
heaviest slice is long, ``sm90_common.takes_tickets``), with the same bits. What differs is the schedule,
which Triton's compiler does not produce from the Triton kernel. The program is
warp-specialized:

- a producer warp issues every TMA load: the two 64-row halves of the query
  block, then each slice's K/V tiles into a ring of ``STAGES`` shared-memory
  slots, each slot with a "ready" mbarrier (TMA bytes) and an "empty" one
  (one arrival per consumer);
- two consumer warpgroups each own one 64-row half: scores, softmax and
  ``P @ V`` for every tile, then release the slot. While one runs its
  softmax, the other's matmuls keep the tensor cores busy. With
  ``IS_PINGPONG`` (the default config) they take turns issuing their
  matmuls in blocks ``[S_t, P_{t-1} V_{t-1}]`` through a pair of mbarriers
  (a consumer's softmax of ``S_t`` runs while its ``P_{t-1} V_{t-1}`` is in flight);
  without it they run freely and wait only on the producer;
- registers are split unevenly (``setmaxnreg``): 240 per consumer thread,
  24 for the producer.

With ``HAS_PACKED_HEADS`` the producer reads every head through one descriptor
per tensor (``sm90_common``); with ``IS_MERGING`` (the default config) a block of
short slices may walk them as one run of tiles (``common.merged_span``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ..constants import FWD_DYNAMIC_MIN_LEN, MAX_TOKENS
from .common import (DEV_LN2, DEV_NO_DIAGONAL, forward_walk, full_tile_run, merged_rows, merged_span,
                     plan_program)
from .sm90_common import (bounded_desc, issue_tiles, load_slice, next_item, nth_work, packed_qkv, post_item,
                          read_ticket, read_work, row_cells, sched_buffers, store_rows, takes_tickets, tma_load,
                          wait_halves_free, wait_tiles_landed)

__all__ = ["range_attn_fwd_sm90_ws_kernel"]

# The adaptive schedule's slice lengths that take the counter (sm90_common.takes_tickets).
_MIN_LEN = gl.constexpr(FWD_DYNAMIC_MIN_LEN)
_MAX_LEN = gl.constexpr(MAX_TOKENS)


@gluon.jit
def _exp2_poly(x):
    """``2^x`` on the FMA pipe, no MUFU, for ``x <= 127``: ``x = j + f`` with ``j`` an integer and ``|f| <= 1/2``,
    a degree-5 minimax polynomial for ``2^f`` (relative error within a few float32 ulps, as MUFU's), times
    ``2^j``. Exactly 0 below ``-126`` (masked cells' ``-inf`` included); NaN stays NaN."""
    # Adding 1.5 * 2^23 + 127 rounds x to an integer (the sum's ulp is 1) whose low mantissa bits are
    # j + 127: shifted into the exponent field they are 2^j as a float, with no integer add.
    t = x + 12583039.0
    f = x - (t - 12583039.0)
    p = 1.3276471287971983e-3 * f + 9.675541328939734e-3
    p = p * f + 5.550713275678607e-2
    p = p * f + 2.402211972397735e-1
    p = p * f + 6.93146967063425e-1
    p = p * f + 1.0000000716546422
    scale = (t.to(gl.int32, bitcast=True) << 23).to(gl.float32, bitcast=True)
    return gl.where(x < -126.0, 0.0, p * scale)


@gluon.jit
def _exp2_mixed(x, POLY_QUARTERS: gl.constexpr):
    """``2^x`` of a tile with ``POLY_QUARTERS`` quarters of it (0, 1 or 2) by :func:`_exp2_poly` on the FMA pipe
    and the rest on MUFU (docs/design.md, "Exponentials on two pipes"). The split follows the registers each
    thread holds (column pairs, then rows 8 apart), so that joining the parts back moves nothing."""
    if POLY_QUARTERS == 0:
        return gl.exp2(x)
    else:
        gl.static_assert(POLY_QUARTERS <= 2, "at most half of the exponentials go to the polynomial")
        M: gl.constexpr = x.shape[0]
        N2: gl.constexpr = x.shape[1] // 2
        x0, x1 = gl.split(gl.reshape(x, [M, N2, 2]))
        if POLY_QUARTERS == 2:
            e1 = _exp2_poly(x1)
        else:
            y0, y1 = gl.split(gl.permute(gl.reshape(x1, [M // 16, 2, 8, N2]), (0, 2, 3, 1)))
            e1 = gl.convert_layout(gl.reshape(gl.permute(gl.join(gl.exp2(y0), _exp2_poly(y1)), (0, 3, 1, 2)),
                                              [M, N2]), x0.type.layout)
        return gl.convert_layout(gl.reshape(gl.join(gl.exp2(x0), e1), x.shape), x.type.layout)


@gluon.jit
def _softmax_step(
    s, m_i, l_i, offs_m, k_tile, is_edge, row_ok, ks, ke, d_lo, d_hi, qk_scale, cap_in, cap_out,
    HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr, POLY_QUARTERS: gl.constexpr,
    IS_ROW_INTERVAL: gl.constexpr,
):
    """Scores of one tile (its first key ``k_tile``) to probabilities (base 2): ``(p, alpha, m_new, l_new)``; same
    rules as the Triton kernel."""
    if HAS_SOFTCAP:
        e = gl.exp2(s * cap_in)
        s = cap_out * (1.0 - 2.0 / (e + 1.0))
    elif not IS_SCALE_FOLDED:
        s = s * qk_scale
    if is_edge:
        cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        if IS_ROW_INTERVAL:
            mask = row_cells(offs_m, cols, k_tile, row_ok, ks, ke, d_lo, d_hi)
        else:
            j = gl.expand_dims(k_tile + cols, 0)
            diag = j - gl.expand_dims(offs_m, 1)
            mask = gl.expand_dims(row_ok, 1) & ((j >= ks) & (j < ke)) & (diag <= d_hi) & (diag >= d_lo)
        s = gl.where(mask, s, float("-inf"))
    if IS_SCALE_FOLDED:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1))
    # A row with nothing yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    if IS_SCALE_FOLDED:
        p = _exp2_mixed(s * qk_scale - gl.expand_dims(m_use, 1), POLY_QUARTERS)
    else:
        p = _exp2_mixed(s - gl.expand_dims(m_use, 1), POLY_QUARTERS)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _work(w, Hq, GROUP, Tq, order_ptrs, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr):
    """Work item ``w`` (the program ``w`` of the one-program-per-item grid): ``(pid_h, pid_kvh, r0, r1, s_lo, s_hi)``."""
    block_lo_ptr, block_hi_ptr, block_order_ptr = order_ptrs
    pid_h, r0, r1, s_lo, s_hi = plan_program(w, Hq, Tq, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT, BLOCK_M)
    return pid_h, pid_h // GROUP, r0, r1, s_lo, s_hi


@gluon.jit
def _query_half(wi, j, Q_BUFS: gl.constexpr):
    """The buffer (and barriers) of half ``j`` of the program's item number ``wi``, among ``Q_BUFS`` query
    blocks used by turns, and the phase of that use."""
    if Q_BUFS == 1:
        return j, wi & 1
    else:
        return (wi % Q_BUFS) * 2 + j, (wi // Q_BUFS) & 1


@gluon.jit
def _wait_query_free(q_free, wi, Q_BUFS: gl.constexpr):
    """A producer's wait until both halves of the query block that item ``wi`` will use are free: the
    consumers are done with item ``wi - Q_BUFS`` (``sm90_common.wait_halves_free`` when there is one block)."""
    if Q_BUFS == 1:
        wait_halves_free(q_free, wi)
    else:
        for j in gl.static_range(2):
            qh, phase = _query_half(wi, j, Q_BUFS)
            mbarrier.wait(q_free.index(qh), phase ^ 1)


@gluon.jit
def _load_tile(desc, buf, ready, empty, cur, row, col, TILE_BYTES: gl.constexpr, STAGES: gl.constexpr):
    """One tensor's ring tile ``cur`` (rows from ``row``, columns from ``col``), once both consumers have
    released the slot's previous tile (a fresh barrier passes phase 1)."""
    slot = cur % STAGES
    mbarrier.wait(empty.index(slot), ((cur // STAGES) & 1) ^ 1)
    bar = ready.index(slot)
    mbarrier.expect(bar, TILE_BYTES)
    tma_load(desc, [row, col], bar, buf.index(slot))


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, it, n_tiles, k_lo, k_col, v_col, BLOCK_N: gl.constexpr,
              BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr, IS_KV_SPLIT: gl.constexpr):
    """``n_tiles`` K/V tiles from key ``k_lo`` into ring tiles from ``it``. With ``IS_KV_SPLIT`` a slot's key
    and value tiles have barriers of their own, and each key tile is issued before the value tile ahead of it
    (``K_0, K_1, V_0, K_2, V_1, ...``): a key slot frees after both consumers' score matmul, a value slot
    after their ``P V``, so the next key tile need not wait for the last ``P V``."""
    ready, empty, v_ready, v_empty = bars
    if IS_KV_SPLIT:
        if n_tiles > 0:
            _load_tile(k_desc, k_smem, ready, empty, it, k_lo, k_col, BLOCK_N * BLOCK_D * 2, STAGES)
        for t in range(n_tiles):
            if t + 1 < n_tiles:
                _load_tile(k_desc, k_smem, ready, empty, it + t + 1, k_lo + (t + 1) * BLOCK_N, k_col,
                           BLOCK_N * BLOCK_D * 2, STAGES)
            _load_tile(v_desc, v_smem, v_ready, v_empty, it + t, k_lo + t * BLOCK_N, v_col, BLOCK_N * BLOCK_DV * 2,
                       STAGES)
    else:
        issue_tiles(k_desc, v_desc, k_smem, v_smem, ready, empty, it, n_tiles, k_lo, k_col, v_col, BLOCK_N,
                    BLOCK_N * (BLOCK_D + BLOCK_DV) * 2, STAGES)


@gluon.jit
def _issue_slice(k_desc, k_col, v_base, ke, DV, stride_vt, k_smem, v_smem, bars, it, n_tiles, k_lo, last,
                 BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, STAGES: gl.constexpr,
                 IS_KV_SPLIT: gl.constexpr):
    """One slice's K/V tiles through one call site's value descriptor (``sm90_common.issue_bounded``, with the
    key descriptor, head at column ``k_col``): returns the last tile through this call site."""
    # Value tiles land on the value barriers (the shared ones without IS_KV_SPLIT).
    wait_tiles_landed(bars[2], last, it, STAGES)
    v_desc = bounded_desc(v_base, ke, DV, stride_vt, BLOCK_N, BLOCK_DV)
    _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, it, n_tiles, k_lo, k_col, 0, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
              IS_KV_SPLIT)
    return gl.where(n_tiles > 0, it + n_tiles - 1, last)


@gluon.jit
def _issue_run(k_desc, v_desc, k_col, v_col, v_base, ke, DV, stride_vt, k_smem, v_smem, bars, it, n_tiles, k_lo,
               n_sl, last_a, last_b, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
               STAGES: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr, IS_KV_SPLIT: gl.constexpr):
    """``n_tiles`` K/V tiles from key ``k_lo`` whose keys end at ``ke``; returns ``(n_sl, last_a, last_b)``
    (see ``_produce_work``)."""
    # Rows of v at or past the slice's end read as zeros: a NaN in keys no row of the
    # slice covers cannot reach P @ V through a p of 0. Tiles that end inside the slice
    # need no bound.
    if HAS_PACKED_HEADS and (k_lo + n_tiles * BLOCK_N <= ke):
        _issue_kv(k_desc, v_desc, k_smem, v_smem, bars, it, n_tiles, k_lo, k_col, v_col, BLOCK_N, BLOCK_D, BLOCK_DV,
                  STAGES, IS_KV_SPLIT)
    else:
        if n_sl % 2 == 0:
            last_a = _issue_slice(k_desc, k_col, v_base, ke, DV, stride_vt, k_smem, v_smem, bars, it,
                                  n_tiles, k_lo, last_a, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, IS_KV_SPLIT)
        else:
            last_b = _issue_slice(k_desc, k_col, v_base, ke, DV, stride_vt, k_smem, v_smem, bars, it,
                                  n_tiles, k_lo, last_b, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, IS_KV_SPLIT)
        n_sl += 1
    return n_sl, last_a, last_b


@gluon.jit
def _produce_slices(slices_ptr, s_lo, s_hi, r0, r1, k_desc, v_desc, k_col, v_col, v_base, DV, stride_vt, k_smem, v_smem,
                    bars, it, n_sl, last_a, last_b, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                    BLOCK_DV: gl.constexpr, STAGES: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr,
                    IS_KV_SPLIT: gl.constexpr):
    """Rows ``[r0, r1)``'s window slice by slice: each slice's tiles from its first reachable key."""
    for s_idx in range(s_lo, s_hi):
        qs, qe, ks, ke, mtype = load_slice(slices_ptr, s_idx)
        has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles = forward_walk(r0, r1, qs, qe, ks, ke, mtype, BLOCK_N)
        n_sl, last_a, last_b = _issue_run(k_desc, v_desc, k_col, v_col, v_base, ke, DV, stride_vt, k_smem, v_smem,
                                          bars, it, n_tiles, k_lo, n_sl, last_a, last_b, BLOCK_N, BLOCK_D,
                                          BLOCK_DV, STAGES, HAS_PACKED_HEADS, IS_KV_SPLIT)
        it += n_tiles
    return it, n_sl, last_a, last_b


@gluon.jit
def _produce_work(
    ptrs, smem, scalars, work, wi, it, n_sl, last_a, last_b, packed,
    D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, STAGES: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr, IS_MERGING: gl.constexpr,
    IS_KV_SPLIT: gl.constexpr, Q_BUFS: gl.constexpr,
):
    """Loads of the program's item number ``wi``, once both consumers have freed the query halves it uses
    (``_wait_query_free``): its query halves, then every slice's K/V tiles into ring tiles from
    ``it``. ``n_sl`` counts bounded slices so far (the value descriptor's call site alternates); ``last_a`` /
    ``last_b`` is the last tile through each value descriptor. Returns them advanced. ``packed``: the
    program's q, k, v descriptors over ``(T, H * D)`` (with ``HAS_PACKED_HEADS``)."""
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, rowmax_ptr, slices_ptr, order_ptrs = ptrs
    q_smem, k_smem, v_smem, q_ready, q_free, ready, empty, turn, v_ready, v_empty = smem
    bars = (ready, empty, v_ready, v_empty)
    (Hq, GROUP, Tq, Tk, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
     stride_ot, stride_oh, stride_lt, stride_mt, qk_scale, cap_in, cap_out) = scalars
    pid_h, pid_kvh, r0, r1, s_lo, s_hi = work
    HALF: gl.constexpr = BLOCK_M // 2
    q_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_D * 2, 128), element_bitwidth=16)
    if HAS_PACKED_HEADS:
        q_desc, k_desc, v_desc = packed
        q_col = pid_h * D
        k_col = pid_kvh * D
        v_col = pid_kvh * DV
    else:
        if Q_BUFS > 1:
            # The query descriptor follows the head: the previous item's halves (another buffer, maybe
            # not yet consumed) land first.
            if wi > 0:
                for j in gl.static_range(2):
                    qh, phase = _query_half(wi - 1, j, Q_BUFS)
                    mbarrier.wait(q_ready.index(qh), phase)
        q_desc = tma.make_tensor_descriptor(q_ptr + pid_h.to(gl.int64) * stride_qh, shape=[Tq, D],
                                            strides=[stride_qt, 1], block_shape=[HALF, BLOCK_D], layout=q_layout)
        # The key descriptor follows the head: every key tile still in flight lands first.
        wait_tiles_landed(ready, it - 1, it, STAGES)
        k_desc = tma.make_tensor_descriptor(k_ptr + pid_kvh.to(gl.int64) * stride_kh, shape=[Tk, D],
                                            strides=[stride_kt, 1], block_shape=[BLOCK_N, BLOCK_D], layout=q_layout)
        q_col = 0
        k_col = 0
        v_desc = 0
        v_col = 0
    for j in gl.static_range(2):
        qh, phase = _query_half(wi, j, Q_BUFS)
        mbarrier.expect(q_ready.index(qh), HALF * BLOCK_D * 2)
        tma_load(q_desc, [r0 + j * HALF, q_col], q_ready.index(qh), q_smem.index(qh))
    v_base = v_ptr + pid_kvh.to(gl.int64) * stride_vh
    if IS_MERGING:
        # One call site for both kinds of run, as in the consumers.
        is_merged, m_lo, m_tiles, m_end = merged_span(slices_ptr, s_lo, s_hi, r0, r1, BLOCK_N)
        n_runs = gl.where(is_merged, 1, s_hi - s_lo)
        for run in range(0, n_runs):
            if is_merged:
                k_lo = m_lo
                n_tiles = m_tiles
                ke = m_end
            else:
                qs, qe, ks, ke, mtype = load_slice(slices_ptr, s_lo + run)
                has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles = forward_walk(r0, r1, qs, qe, ks, ke, mtype,
                                                                                        BLOCK_N)
            n_sl, last_a, last_b = _issue_run(k_desc, v_desc, k_col, v_col, v_base, ke, DV, stride_vt, k_smem, v_smem,
                                              bars, it, n_tiles, k_lo, n_sl, last_a, last_b, BLOCK_N, BLOCK_D,
                                              BLOCK_DV, STAGES, HAS_PACKED_HEADS, IS_KV_SPLIT)
            it += n_tiles
    else:
        it, n_sl, last_a, last_b = _produce_slices(slices_ptr, s_lo, s_hi, r0, r1, k_desc, v_desc, k_col, v_col,
                                                   v_base, DV, stride_vt, k_smem, v_smem, bars, it, n_sl,
                                                   last_a, last_b, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                                                   HAS_PACKED_HEADS, IS_KV_SPLIT)
    return it, n_sl, last_a, last_b


@gluon.jit
def _ws_producer(
    ptrs, smem, scalars, sched,
    D: gl.constexpr, DV: gl.constexpr, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr, STAGES: gl.constexpr, IS_PINGPONG: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr,
    IS_MERGING: gl.constexpr, IS_DYNAMIC: gl.constexpr, IS_ADAPTIVE: gl.constexpr, IS_KV_SPLIT: gl.constexpr,
    Q_BUFS: gl.constexpr, POLY_QUARTERS: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr,
):
    q_ptr, k_ptr, v_ptr = ptrs[0], ptrs[1], ptrs[2]
    order_ptrs = ptrs[7]
    Hq, GROUP, Tq, Tk = scalars[0], scalars[1], scalars[2], scalars[3]
    stride_qt, stride_kt, stride_vt = scalars[4], scalars[6], scalars[8]
    n_work = gl.cdiv(Tq, BLOCK_M * SPLIT) * SPLIT * Hq
    if HAS_PACKED_HEADS:
        # One descriptor per tensor for the whole program (sm90_common); the head is a column.
        packed = packed_qkv(q_ptr, k_ptr, v_ptr, Tq, Tk, Hq, Hq // GROUP, stride_qt, stride_kt, stride_vt,
                            BLOCK_M // 2, BLOCK_N, BLOCK_D, BLOCK_DV)
    else:
        packed = (0, 0, 0)
    it = 0
    n_sl = 0
    wi = 0
    # The last tile loaded through each of the two value descriptors (sm90_common: a
    # descriptor is rewritten only once the loads through it have landed).
    last_a = it - 1
    last_b = it - 1
    q_free = smem[4]
    if IS_DYNAMIC:
        # With IS_ADAPTIVE the fixed share's items may go through the same posting (measured free).
        is_ticketed = takes_tickets(ptrs[6], order_ptrs, Tq, False, IS_ADAPTIVE, _MIN_LEN, _MAX_LEN)
        w = next_item(sched[0], wi, is_ticketed, IS_ADAPTIVE)
        while w < n_work:
            work = _work(w, Hq, GROUP, Tq, order_ptrs, SPLIT, BLOCK_M)
            pid_h, pid_kvh, r0, r1, s_lo, s_hi = work
            post_item(sched, q_free, wi, w, (pid_h, r0, r1, s_lo, s_hi))
            it, n_sl, last_a, last_b = _produce_work(ptrs, smem, scalars, work, wi, it, n_sl, last_a, last_b,
                                                     packed, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                                                     HAS_PACKED_HEADS, IS_MERGING, IS_KV_SPLIT, Q_BUFS)
            wi += 1
            w = next_item(sched[0], wi, is_ticketed, IS_ADAPTIVE)
        # The end: a ticket past the list.
        post_item(sched, q_free, wi, w, (0, 0, 0, 0, 0))
    else:
        n_prog = gl.num_programs(0)
        for i in range(0, gl.cdiv(n_work, n_prog)):
            w = nth_work(i, n_prog)
            # The last round is short: some programs have no item in it.
            if w < n_work:
                _wait_query_free(q_free, wi, Q_BUFS)
                work = _work(w, Hq, GROUP, Tq, order_ptrs, SPLIT, BLOCK_M)
                it, n_sl, last_a, last_b = _produce_work(ptrs, smem, scalars, work, wi, it, n_sl, last_a, last_b,
                                                         packed, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                                                         HAS_PACKED_HEADS, IS_MERGING, IS_KV_SPLIT, Q_BUFS)
                wi += 1


@gluon.jit
def _release_query(q_free, qh):
    """This warpgroup's last score matmul of an item has completed: the producer may load the next item's
    query half into this one."""
    mbarrier.arrive(q_free.index(qh), count=1)


@gluon.jit
def _consume_tiles(
    smem, qh, it, n_blk, q_held, acc, m_i, l_i, offs_m, k_lo, n_tiles, n_full_lo, n_full_hi, is_last, row_ok, ks, ke,
    d_lo, d_hi, qk_scale, cap_in, cap_out, dtype: gl.constexpr, mma_s: gl.constexpr, mma_o: gl.constexpr,
    BLOCK_N: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr, STAGES: gl.constexpr,
    IS_PINGPONG: gl.constexpr, IS_KV_SPLIT: gl.constexpr, POLY_QUARTERS: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr,
    J: gl.constexpr,
):
    """``n_tiles`` key tiles from ``k_lo`` (ring tiles from ``it``) into one warpgroup's online softmax; tiles
    ``[n_full_lo, n_full_hi)`` skip the element mask. The mask's ``row_ok``, ``ks``, ``ke``, ``d_lo``, ``d_hi``
    are one slice's scalars or, for merged tiles, each row's own (``[HALF, 1]``). ``is_last``: the item's last
    tiles (the query half is released after their last score matmul). Returns ``(n_blk, q_held, acc, m_i, l_i)``.

    With ``IS_KV_SPLIT`` (ping-pong only) a key slot is released once its score matmul is done and a value
    tile is waited for just before its ``P V``; without it (the value barriers are the shared ones) a slot's
    two tiles land and are released together."""
    q_smem, k_smem, v_smem, q_ready, q_free, ready, empty, turn, v_ready, v_empty = smem
    q_half = q_smem.index(qh)
    HALF: gl.constexpr = q_half.shape[0]
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=mma_s)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    if IS_PINGPONG:
        if n_tiles > 0:
            # Matmul blocks [S_0], [S_1, P_0 V_0], ..., [P_{n-1} V_{n-1}]: the two warpgroups
            # take turns issuing them, so one's softmax runs under the other's matmuls.
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            mbarrier.wait(turn.index(J), (n_blk & 1) ^ (1 - J))
            s = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.arrive(turn.index(1 - J), count=1)
            s = warpgroup_mma_wait(0, deps=(s,))
            if IS_KV_SPLIT:
                mbarrier.arrive(empty.index(slot), count=1)
            n_blk += 1
            if (n_tiles == 1) & is_last:
                _release_query(q_free, qh)
                q_held = 0
            is_edge = (n_full_lo > 0) | (n_full_hi <= 0)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, k_lo, is_edge, row_ok, ks, ke, d_lo, d_hi,
                                               qk_scale, cap_in, cap_out, HAS_SOFTCAP, IS_SCALE_FOLDED, POLY_QUARTERS,
                                               IS_ROW_INTERVAL)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            prev = slot
            for t in range(1, n_tiles):
                cur = it + t
                slot = cur % STAGES
                mbarrier.wait(ready.index(slot), (cur // STAGES) & 1)
                if IS_KV_SPLIT:
                    mbarrier.wait(v_ready.index(prev), ((cur - 1) // STAGES) & 1)
                mbarrier.wait(turn.index(J), (n_blk & 1) ^ (1 - J))
                # The score matmul first: its softmax then runs while P_{t-1} V_{t-1} is still
                # in flight (the same arithmetic in the same order as waiting for both).
                s = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                mbarrier.arrive(turn.index(1 - J), count=1)
                s = warpgroup_mma_wait(1, deps=(s,))
                if IS_KV_SPLIT:
                    mbarrier.arrive(empty.index(slot), count=1)
                n_blk += 1
                if (t == n_tiles - 1) & is_last:
                    _release_query(q_free, qh)
                    q_held = 0
                is_edge = (t < n_full_lo) | (t >= n_full_hi)
                p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, k_lo + t * BLOCK_N, is_edge, row_ok, ks, ke,
                                                   d_lo, d_hi, qk_scale, cap_in, cap_out, HAS_SOFTCAP,
                                                   IS_SCALE_FOLDED, POLY_QUARTERS, IS_ROW_INTERVAL)
                acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
                mbarrier.arrive(v_empty.index(prev), count=1)
                # acc holds every tile up to t - 1 in the scale of m_{t-1}: alpha_t moves it to m_t.
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                prev = slot
            if IS_KV_SPLIT:
                mbarrier.wait(v_ready.index(prev), ((it + n_tiles - 1) // STAGES) & 1)
            mbarrier.wait(turn.index(J), (n_blk & 1) ^ (1 - J))
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            mbarrier.arrive(turn.index(1 - J), count=1)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            n_blk += 1
            mbarrier.arrive(v_empty.index(prev), count=1)
    else:
        for t in range(n_tiles):
            cur = it + t
            slot = cur % STAGES
            mbarrier.wait(ready.index(slot), (cur // STAGES) & 1)
            s = warpgroup_mma(q_half, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False)
            is_edge = (t < n_full_lo) | (t >= n_full_hi)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, k_lo + t * BLOCK_N, is_edge, row_ok, ks, ke,
                                               d_lo, d_hi, qk_scale, cap_in, cap_out, HAS_SOFTCAP, IS_SCALE_FOLDED,
                                               POLY_QUARTERS, IS_ROW_INTERVAL)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc = warpgroup_mma(p_op, v_smem.index(slot), acc)
            mbarrier.arrive(empty.index(slot), count=1)
    return n_blk, q_held, acc, m_i, l_i


@gluon.jit
def _slice_run(slices_ptr, s_idx, r0, r1, h0, offs_m, BLOCK_N: gl.constexpr):
    """Slice ``s_idx``'s tiles for a warpgroup's rows ``offs_m`` (``[h0, h0 + HALF)``) of block ``[r0, r1)``:
    ``(k_lo, n_tiles, n_full_lo, n_full_hi, row_ok, ks, ke, d_lo, d_hi)``, the mask's bounds as scalars."""
    HALF: gl.constexpr = offs_m.shape[0]
    qs, qe, ks, ke, mtype = load_slice(slices_ptr, s_idx)
    has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles = forward_walk(r0, r1, qs, qe, ks, ke, mtype, BLOCK_N)
    # Full tiles for this warpgroup's rows (the tiles themselves follow the whole block).
    n_full_lo, n_full_hi = full_tile_run(h0, h0 + HALF, qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, k_lo,
                                         n_tiles, BLOCK_N)
    row_ok = (offs_m >= qs) & (offs_m < qe)
    d_hi = gl.where(has_upper, d_max, DEV_NO_DIAGONAL)
    d_lo = gl.where(has_lower, d_min, -DEV_NO_DIAGONAL)
    return k_lo, n_tiles, n_full_lo, n_full_hi, row_ok, ks, ke, d_lo, d_hi


@gluon.jit
def _consume_slices(
    slices_ptr, smem, qh, s_lo, s_hi, r0, r1, h0, it, n_blk, q_held, acc, m_i, l_i, offs_m, qk_scale, cap_in, cap_out,
    dtype: gl.constexpr, mma_s: gl.constexpr, mma_o: gl.constexpr, BLOCK_N: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    IS_SCALE_FOLDED: gl.constexpr, STAGES: gl.constexpr, IS_PINGPONG: gl.constexpr, IS_KV_SPLIT: gl.constexpr,
    POLY_QUARTERS: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, J: gl.constexpr,
):
    """One warpgroup's rows ``offs_m`` (``[h0, h0 + HALF)``) over the window's slices one by one, each slice's
    tiles from its first reachable key; returns ``(it, n_blk, q_held, acc, m_i, l_i)``."""
    for s_idx in range(s_lo, s_hi):
        k_lo, n_tiles, n_full_lo, n_full_hi, row_ok, ks, ke, d_lo, d_hi = _slice_run(slices_ptr, s_idx, r0, r1, h0,
                                                                                     offs_m, BLOCK_N)
        n_blk, q_held, acc, m_i, l_i = _consume_tiles(
            smem, qh, it, n_blk, q_held, acc, m_i, l_i, offs_m, k_lo, n_tiles, n_full_lo, n_full_hi,
            s_idx == s_hi - 1, row_ok, ks, ke, d_lo, d_hi, qk_scale, cap_in, cap_out, dtype, mma_s, mma_o, BLOCK_N,
            HAS_SOFTCAP, IS_SCALE_FOLDED, STAGES, IS_PINGPONG, IS_KV_SPLIT, POLY_QUARTERS, IS_ROW_INTERVAL, J)
        it += n_tiles
    return it, n_blk, q_held, acc, m_i, l_i


@gluon.jit
def _consume_work(
    ptrs, smem, scalars, work, qh, it, n_blk,
    D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr, STAGES: gl.constexpr, IS_PINGPONG: gl.constexpr, IS_MERGING: gl.constexpr,
    IS_KV_SPLIT: gl.constexpr, Q_BUFS: gl.constexpr, POLY_QUARTERS: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr,
    J: gl.constexpr,
):
    """Rows ``[r0 + J * BLOCK_M / 2, ...)`` of a work item (``work`` decoded), on one warpgroup, its query half
    in buffer ``qh``: ring tiles from ``it``, ping-pong blocks from ``n_blk``; returns both advanced. The query
    half is released once its last score matmul is done."""
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, rowmax_ptr, slices_ptr, order_ptrs = ptrs
    q_free = smem[4]
    (Hq, GROUP, Tq, Tk, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
     stride_ot, stride_oh, stride_lt, stride_mt, qk_scale, cap_in, cap_out) = scalars
    pid_h, r0, r1, s_lo, s_hi = work
    HALF: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_DV, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    h0 = r0 + J * HALF
    offs_m = h0 + gl.arange(0, HALF, layout=row_s)
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([HALF], gl.float32, layout=row_s)
    acc = gl.zeros([HALF, BLOCK_DV], gl.float32, layout=mma_o)
    # The query half is released after its last score matmul (ping-pong; otherwise at the end),
    # so that a persistent program's next queries load under this item's last tile and epilogue.
    q_held = 1
    if IS_MERGING:
        # One call site of the tile loop for both kinds of run (a merged run, or one slice's tiles with
        # its bounds as [HALF, 1] columns): two would be two inlined copies of the loop.
        is_merged, m_lo, m_tiles, m_end = merged_span(slices_ptr, s_lo, s_hi, r0, r1, BLOCK_N)
        n_runs = gl.where(is_merged, 1, s_hi - s_lo)
        zero_col = gl.expand_dims(offs_m * 0, 1)
        for run in range(0, n_runs):
            if is_merged:
                row_ok, ks, ke, d_lo, d_hi = merged_rows(slices_ptr, s_lo, s_hi, r0, r1, offs_m, BLOCK_N)
                k_lo = m_lo
                n_tiles = m_tiles
                n_full_lo = m_lo * 0
                n_full_hi = m_lo * 0
            else:
                k_lo, n_tiles, n_full_lo, n_full_hi, row_ok, ks_s, ke_s, d_lo_s, d_hi_s = _slice_run(
                    slices_ptr, s_lo + run, r0, r1, h0, offs_m, BLOCK_N)
                ks = zero_col + ks_s
                ke = zero_col + ke_s
                d_lo = zero_col + d_lo_s
                d_hi = zero_col + d_hi_s
            n_blk, q_held, acc, m_i, l_i = _consume_tiles(
                smem, qh, it, n_blk, q_held, acc, m_i, l_i, offs_m, k_lo, n_tiles, n_full_lo, n_full_hi,
                run == n_runs - 1, row_ok, ks, ke, d_lo, d_hi, qk_scale, cap_in, cap_out, dtype, mma_s, mma_o,
                BLOCK_N, HAS_SOFTCAP, IS_SCALE_FOLDED, STAGES, IS_PINGPONG, IS_KV_SPLIT, POLY_QUARTERS, IS_ROW_INTERVAL,
                J)
            it += n_tiles
    else:
        it, n_blk, q_held, acc, m_i, l_i = _consume_slices(
            slices_ptr, smem, qh, s_lo, s_hi, r0, r1, h0, it, n_blk, q_held, acc, m_i, l_i, offs_m, qk_scale, cap_in,
            cap_out, dtype, mma_s, mma_o, BLOCK_N, HAS_SOFTCAP, IS_SCALE_FOLDED, STAGES, IS_PINGPONG, IS_KV_SPLIT,
            POLY_QUARTERS, IS_ROW_INTERVAL, J)
    if q_held == 1:
        _release_query(q_free, qh)

    covered = l_i != 0.0
    l_safe = gl.where(covered, l_i, 1.0)
    # One reciprocal per row, not one division per element (kernels/forward.py).
    out = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)
    lse = gl.where(covered, (m_i + gl.log2(l_safe)) * DEV_LN2, float("-inf"))
    # The output goes out in 16-byte runs through shared memory (sm90_common.store_rows) where the query
    # block and the rings leave room for it; at head dim 128 they take all of it.
    IS_O_STAGED: gl.constexpr = (BLOCK_M * (Q_BUFS * BLOCK_D + BLOCK_DV) + STAGES * BLOCK_N * (BLOCK_D + BLOCK_DV)) \
        * 2 <= 200 * 1024
    store_rows(out_ptr + pid_h.to(gl.int64) * stride_oh, out, h0, Tq, stride_ot, DV, IS_O_STAGED)
    mask_m = offs_m < Tq
    gl.store(lse_ptr + offs_m.to(gl.int64) * stride_lt + pid_h, lse, mask=mask_m)
    if HAS_MAX_LOGITS:
        gl.store(rowmax_ptr + offs_m.to(gl.int64) * stride_mt + pid_h, m_i * DEV_LN2, mask=mask_m)
    return it, n_blk


@gluon.jit
def _consume_item(
    ptrs, smem, scalars, work, w, wi, it, n_blk,
    D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr, STAGES: gl.constexpr, IS_PINGPONG: gl.constexpr, IS_MERGING: gl.constexpr,
    IS_KV_SPLIT: gl.constexpr, Q_BUFS: gl.constexpr, POLY_QUARTERS: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr,
    J: gl.constexpr,
):
    """This warpgroup's item number ``wi`` of its program, item ``w`` of the list (``work`` decoded), once its
    query half has landed; returns ``(it, n_blk)`` advanced (``_consume_work``)."""
    q_ready = smem[3]
    qh, phase = _query_half(wi, J, Q_BUFS)
    mbarrier.wait(q_ready.index(qh), phase)
    it, n_blk = _consume_work(ptrs, smem, scalars, work, qh, it, n_blk, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                              HAS_SOFTCAP, IS_SCALE_FOLDED, HAS_MAX_LOGITS, STAGES, IS_PINGPONG, IS_MERGING,
                              IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS, IS_ROW_INTERVAL, J)
    return it, n_blk


@gluon.jit
def _ws_consumer(
    ptrs, smem, scalars, sched,
    D: gl.constexpr, DV: gl.constexpr, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr, STAGES: gl.constexpr, IS_PINGPONG: gl.constexpr, IS_MERGING: gl.constexpr,
    IS_DYNAMIC: gl.constexpr, IS_KV_SPLIT: gl.constexpr, Q_BUFS: gl.constexpr, POLY_QUARTERS: gl.constexpr,
    IS_ROW_INTERVAL: gl.constexpr,
    J: gl.constexpr,
):
    """Half ``J`` of every work item of this program, on one warpgroup."""
    order_ptrs = ptrs[7]
    Hq, GROUP, Tq = scalars[0], scalars[1], scalars[2]
    n_work = gl.cdiv(Tq, BLOCK_M * SPLIT) * SPLIT * Hq
    it = 0
    # Matmul blocks issued so far (ping-pong turns; both warpgroups count the same blocks).
    n_blk = 0
    wi = 0
    if IS_DYNAMIC:
        w = read_ticket(sched, wi)
        while w < n_work:
            it, n_blk = _consume_item(ptrs, smem, scalars, read_work(sched), w, wi, it, n_blk, D, DV, BLOCK_M,
                                      BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, IS_SCALE_FOLDED, HAS_MAX_LOGITS,
                                      STAGES, IS_PINGPONG, IS_MERGING, IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS,
                                      IS_ROW_INTERVAL, J)
            wi += 1
            w = read_ticket(sched, wi)
    else:
        n_prog = gl.num_programs(0)
        for i in range(0, gl.cdiv(n_work, n_prog)):
            w = nth_work(i, n_prog)
            if w < n_work:
                pid_h, pid_kvh, r0, r1, s_lo, s_hi = _work(w, Hq, GROUP, Tq, order_ptrs, SPLIT, BLOCK_M)
                it, n_blk = _consume_item(ptrs, smem, scalars, (pid_h, r0, r1, s_lo, s_hi), w, wi, it, n_blk, D,
                                          DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, IS_SCALE_FOLDED,
                                          HAS_MAX_LOGITS, STAGES, IS_PINGPONG, IS_MERGING, IS_KV_SPLIT, Q_BUFS,
                                          POLY_QUARTERS, IS_ROW_INTERVAL, J)
                wi += 1


@gluon.jit
def _ws_consumer_1(
    ptrs, smem, scalars, sched,
    D: gl.constexpr, DV: gl.constexpr, SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr,
    HAS_MAX_LOGITS: gl.constexpr, STAGES: gl.constexpr, IS_PINGPONG: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr,
    IS_MERGING: gl.constexpr, IS_DYNAMIC: gl.constexpr, IS_ADAPTIVE: gl.constexpr, IS_KV_SPLIT: gl.constexpr,
    Q_BUFS: gl.constexpr, POLY_QUARTERS: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr,
):
    # Worker partitions share one signature: the second half's consumer, in the producer's.
    _ws_consumer(
        ptrs, smem, scalars, sched, D, DV, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, IS_SCALE_FOLDED,
        HAS_MAX_LOGITS, STAGES, IS_PINGPONG, IS_MERGING, IS_DYNAMIC, IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS,
        IS_ROW_INTERVAL, 1,
    )


# Sizes and the GQA ratio vary from call to call: not specialized on, as in the Triton kernel.
@gluon.jit(do_not_specialize=["Tq", "Tk", "GROUP"])
def range_attn_fwd_sm90_ws_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, rowmax_ptr,
    slices_ptr, block_lo_ptr, block_hi_ptr, block_order_ptr,
    Tq, Tk, Hq,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_mt,
    qk_scale, cap_in, cap_out, GROUP,
    D: gl.constexpr, DV: gl.constexpr, SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, IS_SCALE_FOLDED: gl.constexpr, IS_TMA: gl.constexpr,
    IS_WARP_SPECIALIZED: gl.constexpr, DOT_PRECISION: gl.constexpr, IS_BF16_EMULATED: gl.constexpr,
    IS_INT64: gl.constexpr, HAS_MAX_LOGITS: gl.constexpr, IS_ONE_SLICE: gl.constexpr, IS_MERGING: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, IS_PINGPONG: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr,
    IS_DYNAMIC: gl.constexpr, IS_ADAPTIVE: gl.constexpr, IS_KV_SPLIT: gl.constexpr, Q_BUFS: gl.constexpr,
    POLY_QUARTERS: gl.constexpr, IS_ROW_INTERVAL: gl.constexpr, ticket_ptr,
):
    """The Triton kernel's parameters, grid and program order, plus ``STAGES``, ``NUM_WARPS``,
    ``IS_PINGPONG`` (the consumers take turns issuing their matmuls), ``HAS_PACKED_HEADS`` (each row
    of q, k and v holds its heads side by side, ``D`` and ``DV`` wide: one descriptor per tensor and
    program, sm90_common), ``IS_DYNAMIC`` (items taken from the counter at ``ticket_ptr``; with ``IS_ADAPTIVE``
    only when the mask's heaviest slice is long, sm90_common.takes_tickets), ``IS_KV_SPLIT``
    (each ring slot's key and value tiles land and are released on barriers of their own) and ``Q_BUFS`` (query
    blocks used by turns: with two, the next item's queries load while this item's are in use).

    Launched with 4 warps (the first consumer; a 4-warp and a 1-warp worker are
    added) and a register cap that the partitions split. ``IS_TMA``,
    ``IS_WARP_SPECIALIZED``, ``DOT_PRECISION``, ``IS_BF16_EMULATED``, ``IS_INT64``
    and ``IS_ONE_SLICE`` are accepted and unused (TMA and 64-bit addressing always).
    """
    gl.static_assert(IS_PINGPONG or not IS_KV_SPLIT, "split key and value barriers need the ping-pong consumers")
    # The dynamic schedule posts an item once the previous item's query halves are free.
    gl.static_assert(Q_BUFS == 1 or not IS_DYNAMIC, "two query blocks need the fixed share")
    gl.static_assert(IS_DYNAMIC or not IS_ADAPTIVE, "the adaptive schedule is a dynamic one")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    HALF: gl.constexpr = BLOCK_M // 2
    q_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_D * 2, 128), element_bitwidth=16)
    v_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_DV * 2, 128), element_bitwidth=16)
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, HALF, BLOCK_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], q_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_DV], v_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2 * Q_BUFS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * Q_BUFS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    if IS_KV_SPLIT:
        # The key tiles' barriers are then ready / empty.
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=2)
    else:
        v_ready = ready
        v_empty = empty
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    # Runtime values only in the tuple variables: a constexpr stored in one reaches the
    # partitions as a tensor, so the constexprs are listed in each call.
    ptrs = (q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, rowmax_ptr, slices_ptr, (block_lo_ptr, block_hi_ptr, block_order_ptr))
    smem = (q_smem, k_smem, v_smem, q_ready, q_free, ready, empty, turn, v_ready, v_empty)
    scalars = (Hq, GROUP, Tq, Tk, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
               stride_oh, stride_lt, stride_mt, qk_scale, cap_in, cap_out)
    # A dynamic schedule's next item, posted by the producer for both consumers.
    item, posted = sched_buffers()
    sched = (ticket_ptr, item, posted)
    gl.warp_specialize([
        (_ws_consumer, (ptrs, smem, scalars, sched, D, DV, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP,
                        IS_SCALE_FOLDED, HAS_MAX_LOGITS, STAGES, IS_PINGPONG, IS_MERGING, IS_DYNAMIC, IS_KV_SPLIT,
                        Q_BUFS, POLY_QUARTERS, IS_ROW_INTERVAL, 0)),
        (_ws_consumer_1, (ptrs, smem, scalars, sched, D, DV, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                          HAS_SOFTCAP, IS_SCALE_FOLDED, HAS_MAX_LOGITS, STAGES, IS_PINGPONG, HAS_PACKED_HEADS,
                          IS_MERGING, IS_DYNAMIC, IS_ADAPTIVE, IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS, IS_ROW_INTERVAL)),
        (_ws_producer, (ptrs, smem, scalars, sched, D, DV, SPLIT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP,
                        IS_SCALE_FOLDED, HAS_MAX_LOGITS, STAGES, IS_PINGPONG, HAS_PACKED_HEADS, IS_MERGING,
                        IS_DYNAMIC, IS_ADAPTIVE, IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS, IS_ROW_INTERVAL)),
    ], [4, 1], [240, 24])
