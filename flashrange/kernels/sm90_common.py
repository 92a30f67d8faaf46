"""Device code shared by the Hopper (sm_90) Gluon kernels (docs/design.md §6).

The producers of these kernels build a tensor descriptor per slice that ends at
the slice's last row or key, so a tile that runs past it reads zeros. Triton
writes a device-side descriptor into one global-scratch slot per call site, and
a TMA load reads its descriptor asynchronously, after the instruction issues:
rewriting the slot while an earlier load through it is in flight can make that
load use the next slice's bounds. So the producers keep two call sites used by
turns (every other slice) and, before rewriting one, wait until every tile
loaded through it has landed (:func:`wait_tiles_landed`); with a slice between
the two uses that wait is almost always already satisfied. :func:`issue_bounded`
is one slice's step (wait, descriptors, loads); a producer calls it from two
places, and Triton inlines each call with its own scratch slot.

Writing a descriptor costs the producer a global store and a proxy fence, and
the rewrite waits for loads in flight. When each row of a tensor holds its heads
side by side, ``D`` wide (``HAS_PACKED_HEADS``), a producer instead builds one
descriptor per tensor over ``(T, H * D)`` once per program and picks the head by
column; only a slice whose last tile runs past its end still takes a bounded
descriptor. The other slices' tiles read the same values through either, so the
results are the same bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

__all__ = ["bounded_desc", "cta_barrier", "issue_bounded", "issue_run", "issue_tiles", "key_cells", "load_slice",
           "next_item", "nth_work", "packed_qkv", "post_item", "read_ticket", "read_work", "row_cells",
           "sched_buffers", "store_rows", "take_item", "takes_tickets", "tma_load", "wait_halves_free",
           "wait_tiles_landed"]

# Gluon's TMA load was renamed (``async_copy_global_to_shared`` up to Triton 3.6, ``async_load`` later).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# And its barrier of the threads of a program (``thread_barrier`` up to Triton 3.6, ``barrier`` later); inside a
# warp-specialized partition it synchronizes that partition's warps.
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.jit
def wait_tiles_landed(ready, last, it, STAGES: gl.constexpr):
    """Wait until every ring tile up to ``last`` (a count of tiles issued; ``-1`` for none) has landed.

    ``it`` is the next tile the producer will issue. Only the last ``STAGES``
    tiles issued can still be in flight, each in its own slot (an older tile
    landed before its slot was refilled: the producer waited for the consumers
    to release it), so at most ``STAGES`` waits, none on a slot's later use.
    Tiles issued after ``last`` (the other descriptor's) are not waited on.
    """
    for i in gl.static_range(STAGES):
        c = last - i
        if (c >= 0) & (it - c <= STAGES):
            mbarrier.wait(ready.index(c % STAGES), (c // STAGES) & 1)


@gluon.jit
def wait_halves_free(free, wi):
    """A producer's wait until both consumers are done with the tiles of its item ``wi - 1`` that it loads
    once per item (the query or key block's halves; a fresh barrier passes phase 1). Those loads landed
    before they were used, so their descriptors and buffers can be rewritten."""
    for j in gl.static_range(2):
        mbarrier.wait(free.index(j), (wi & 1) ^ 1)


@gluon.jit
def issue_tiles(a_desc, b_desc, a_smem, b_smem, ready, empty, it, n_tiles, start, a_col, b_col, BLOCK: gl.constexpr,
                TILE_BYTES: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of one slice's ``n_tiles`` tiles of two tensors (K and V, or q and dO) from row ``start``
    (columns from ``a_col`` / ``b_col``), into ring tiles ``it, it + 1, ...``."""
    for t in range(n_tiles):
        cur = it + t
        slot = cur % STAGES
        # Both consumers released this slot's previous tile (a fresh barrier passes phase 1).
        mbarrier.wait(empty.index(slot), ((cur // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, TILE_BYTES)
        r = start + t * BLOCK
        tma_load(a_desc, [r, a_col], bar, a_smem.index(slot))
        tma_load(b_desc, [r, b_col], bar, b_smem.index(slot))


@gluon.jit
def bounded_desc(base, end, cols, stride, BLOCK: gl.constexpr, BLOCK_C: gl.constexpr):
    """A TMA descriptor of ``BLOCK x BLOCK_C`` tiles over the rows of ``base`` below ``end`` (2-byte
    elements, ``cols`` of them per row): tiles running past ``end`` read zeros there."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_C * 2, 128), element_bitwidth=16)
    return tma.make_tensor_descriptor(base, shape=[gl.maximum(end, 1), cols], strides=[stride, 1],
                                      block_shape=[BLOCK, BLOCK_C], layout=layout)


@gluon.jit
def packed_qkv(q_ptr, k_ptr, v_ptr, Tq, Tk, Hq, Hkv, stride_qt, stride_kt, stride_vt, Q_ROWS: gl.constexpr,
               KV_ROWS: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr):
    """With packed heads, a program's one descriptor per tensor: q, k and v over ``(T, H * D)``, tiles of
    ``Q_ROWS`` (q) and ``KV_ROWS`` (k, v) rows of one head, picked by column ``head * D``."""
    return (bounded_desc(q_ptr, Tq, Hq * BLOCK_D, stride_qt, Q_ROWS, BLOCK_D),
            bounded_desc(k_ptr, Tk, Hkv * BLOCK_D, stride_kt, KV_ROWS, BLOCK_D),
            bounded_desc(v_ptr, Tk, Hkv * BLOCK_DV, stride_vt, KV_ROWS, BLOCK_DV))


@gluon.jit
def issue_bounded(a_base, b_base, end, a_cols, b_cols, a_stride, b_stride, a_smem, b_smem, ready, empty, it, n_tiles,
                  start, last, BLOCK: gl.constexpr, BLOCK_A: gl.constexpr, BLOCK_B: gl.constexpr,
                  STAGES: gl.constexpr):
    """One slice's loads through one call site's descriptors: once every tile loaded through them may
    have landed (``last``), descriptors of two tensors bounded at row ``end``, then ``n_tiles`` tiles from
    row ``start`` into ring tiles from ``it``. Returns the last tile through this call site.

    Each call is its own call site (its own descriptor scratch): a producer calls this from two places
    by turns, so that one site is rewritten while the other's loads are in flight.
    """
    wait_tiles_landed(ready, last, it, STAGES)
    a_desc = bounded_desc(a_base, end, a_cols, a_stride, BLOCK, BLOCK_A)
    b_desc = bounded_desc(b_base, end, b_cols, b_stride, BLOCK, BLOCK_B)
    issue_tiles(a_desc, b_desc, a_smem, b_smem, ready, empty, it, n_tiles, start, 0, 0, BLOCK,
                BLOCK * (BLOCK_A + BLOCK_B) * 2, STAGES)
    return gl.where(n_tiles > 0, it + n_tiles - 1, last)


@gluon.jit
def issue_run(a_all, b_all, a_col, b_col, a_base, b_base, end, a_cols, b_cols, a_stride, b_stride, a_smem, b_smem,
              ready, empty, it, n_tiles, start, n_sl, last_a, last_b, BLOCK: gl.constexpr, BLOCK_A: gl.constexpr,
              BLOCK_B: gl.constexpr, STAGES: gl.constexpr, HAS_PACKED_HEADS: gl.constexpr):
    """One slice's ``n_tiles`` tiles of two tensors from row ``start``, rows past ``end`` read as zeros: through
    the program's descriptors ``a_all`` / ``b_all`` (the head at columns ``a_col`` / ``b_col``) when heads are
    packed and the tiles end by ``end``, else through the two bounded call sites by turns (``n_sl`` counts the
    slices that took them). Returns ``(n_sl, last_a, last_b)``."""
    if HAS_PACKED_HEADS and (start + n_tiles * BLOCK <= end):
        issue_tiles(a_all, b_all, a_smem, b_smem, ready, empty, it, n_tiles, start, a_col, b_col, BLOCK,
                    BLOCK * (BLOCK_A + BLOCK_B) * 2, STAGES)
    else:
        if n_sl % 2 == 0:
            last_a = issue_bounded(a_base, b_base, end, a_cols, b_cols, a_stride, b_stride, a_smem, b_smem, ready,
                                   empty, it, n_tiles, start, last_a, BLOCK, BLOCK_A, BLOCK_B, STAGES)
        else:
            last_b = issue_bounded(a_base, b_base, end, a_cols, b_cols, a_stride, b_stride, a_smem, b_smem, ready,
                                   empty, it, n_tiles, start, last_b, BLOCK, BLOCK_A, BLOCK_B, STAGES)
        n_sl += 1
    return n_sl, last_a, last_b


@gluon.jit
def load_slice(slices_ptr, s):
    """Slice ``s`` of a plan's slice table: ``(qs, qe, ks, ke, type)``."""
    row = slices_ptr + s * 5
    return gl.load(row + 0), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4)


@gluon.jit
def store_rows(base_ptr, tile, row0, row_end, stride_row, n_cols, IS_STAGED: gl.constexpr):
    """Store ``tile`` (``R x C``, any layout) as rows ``row0 ..`` below ``row_end`` and its first ``n_cols``
    columns at ``base_ptr + row * stride_row + col``, in ``base_ptr``'s element type.

    A matmul accumulator gives each thread two adjacent columns of a row, so a direct store of a 2-byte
    type is 4 bytes wide and each warp instruction writes 16 bytes into each of 8 rows. With ``IS_STAGED``
    such a tile is converted first (through shared memory, which the caller must have room for) to a
    layout where each thread holds 16 contiguous bytes of a row: a warp writes whole 128-byte lines, with
    a quarter of the instructions. A 4-byte type (float32 partial sums) is always stored directly: its tile
    would need twice the shared memory, which the dK/dV kernel does not have."""
    dtype: gl.constexpr = base_ptr.dtype.element_ty
    ROWS: gl.constexpr = tile.shape[0]
    COLS: gl.constexpr = tile.shape[1]
    if IS_STAGED and dtype.primitive_bitwidth == 16:
        VEC: gl.constexpr = 8
        TPW_C: gl.constexpr = min(COLS // VEC, 32)
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TPW_C, TPW_C], [gl.num_warps(), 1], [1, 0])
        t = gl.convert_layout(tile.to(dtype), layout)
    else:
        layout: gl.constexpr = tile.type.layout
        t = tile.to(dtype)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    mask = gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < n_cols, 0)
    gl.store(base_ptr + gl.expand_dims(rows.to(gl.int64) * stride_row, 1) + gl.expand_dims(cols, 0), t, mask=mask)


@gluon.jit
def nth_work(i, n_prog):
    """This program's ``i``-th work item under a persistent grid of ``n_prog`` programs: rounds of
    ``n_prog`` items walked forward and backward by turns, so that along a heavy-first list every
    program's items add up to about the same work (a plain stride gives the first programs the
    heaviest item of every round). One round when each program has its own item."""
    pid = gl.program_id(0)
    return i * n_prog + gl.where(i % 2 == 0, pid, n_prog - 1 - pid)


# A dynamic schedule (``IS_DYNAMIC``): the persistent programs take the items of the same list, in the same
# order, from a counter shared by the launch, each as it finishes the one before, instead of a fixed share
# (nth_work). Items differ in cost (a document's blocks), so a fixed share leaves some programs
# working while others are done; which program computes an item never changes its bits. The producer
# warp takes each ticket, decodes it (the plan's entries) and posts the item in shared memory for the
# consumers (``sched``: the counter, a ``[6, 1]`` int32 buffer and its mbarrier, one arrival per item).


@gluon.jit
def take_item(ticket_ptr):
    """The next work item: the counter's value before this program's add (the launch zeroes it). Past
    the list once every item is taken; each program stops at one such ticket."""
    return gl.atomic_add(ticket_ptr, 1, sem="relaxed")


@gluon.jit
def takes_tickets(slices_ptr, order_ptrs, T, IS_KEY_MAJOR: gl.constexpr, IS_ADAPTIVE: gl.constexpr,
                  MIN_LEN: gl.constexpr, MAX_LEN: gl.constexpr):
    """Whether a dynamic schedule's producers take their items from the counter (:func:`take_item`), or with
    ``IS_ADAPTIVE`` only when the slice where the mask's work is, the first of the heaviest block's window
    (the plan's first block; ``order_ptrs``: ``block_lo``, ``block_hi``, ``block_order``), is ``MIN_LEN`` to
    ``MAX_LEN`` long along the major axis (rows, or keys with ``IS_KEY_MAJOR``; ``T`` of them), else the fixed
    share's (:func:`next_item`). Every program reads the same plan, so all choose alike (a mix would run some
    items twice and skip others). A few dependent loads, once per program."""
    if IS_ADAPTIVE:
        block_lo_ptr, block_hi_ptr, block_order_ptr = order_ptrs
        has_blocks = T > 0
        b = gl.load(block_order_ptr, mask=has_blocks, other=0)
        s_lo = gl.load(block_lo_ptr + b, mask=has_blocks, other=0)
        s_hi = gl.load(block_hi_ptr + b, mask=has_blocks, other=0)
        has_slice = has_blocks & (s_lo < s_hi)
        # A slice row is (qs, qe, ks, ke, type).
        if IS_KEY_MAJOR:
            start_ptr = slices_ptr + s_lo.to(gl.int64) * 5 + 2
        else:
            start_ptr = slices_ptr + s_lo.to(gl.int64) * 5
        n = gl.load(start_ptr + 1, mask=has_slice, other=0) - gl.load(start_ptr, mask=has_slice, other=0)
        return has_slice & (n >= MIN_LEN) & (n <= MAX_LEN)
    else:
        return T >= 0  # not read: without IS_ADAPTIVE next_item always takes a ticket


@gluon.jit
def next_item(ticket_ptr, wi, is_ticketed, IS_ADAPTIVE: gl.constexpr):
    """A producer's item number ``wi`` of its program: the counter's next ticket (:func:`take_item`), or with
    ``IS_ADAPTIVE`` and not ``is_ticketed`` (:func:`takes_tickets`) the fixed share's (:func:`nth_work`).
    Either runs past the list at its end."""
    if IS_ADAPTIVE:
        if is_ticketed:
            w = take_item(ticket_ptr)
        else:
            w = nth_work(wi, gl.num_programs(0))
    else:
        w = take_item(ticket_ptr)
    return w


@gluon.jit
def post_item(sched, free, wi, w, work):
    """Post ticket ``w`` and its decoded ``work`` (five ints) as the producer's item number ``wi``, once both
    consumers are done with item ``wi - 1`` (``free``, as :func:`wait_halves_free`); from the producer's one
    warp. The barrier's arrival (release semantics) orders the stores before the consumers' reads."""
    wait_halves_free(free, wi)
    item, posted = sched[1], sched[2]
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    item.index(0).store(gl.full([1], w, gl.int32, layout=layout))
    for k in gl.static_range(5):
        item.index(k + 1).store(gl.full([1], work[k], gl.int32, layout=layout))
    mbarrier.arrive(posted, count=1)


@gluon.jit
def _posted(item, k: gl.constexpr):
    return gl.max(item.index(k).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), 0)


@gluon.jit
def read_ticket(sched, wi):
    """A consumer's item number ``wi`` of its program, once posted (:func:`post_item`): its ticket."""
    mbarrier.wait(sched[2], wi & 1)
    return _posted(sched[1], 0)


@gluon.jit
def read_work(sched):
    """The posted item's decoded work, after :func:`read_ticket` and until the consumer frees that item's
    halves (only then may the producer post the next one). Read where it is used: carried through the
    item loop, the five values would take registers the tile loops need."""
    item = sched[1]
    return _posted(item, 1), _posted(item, 2), _posted(item, 3), _posted(item, 4), _posted(item, 5)


@gluon.jit
def sched_buffers():
    """The shared memory of a dynamic schedule: the posted item and its barrier (``sched[1:]``)."""
    item = gl.allocate_shared_memory(gl.int32, [6, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    posted = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(posted, count=1)
    return item, posted


@gluon.jit
def row_cells(offs_m, cols, k0, row_ok, ks, ke, d_lo, d_hi):
    """The slice's cells of a (rows x keys) tile whose keys are ``k0 + cols``: in row ``r`` the keys
    ``[max(ks, r + d_lo), min(ke, r + d_hi + 1))``, none where ``row_ok`` is false, one unsigned compare per cell
    (docs/design.md, "Edge tiles"; the Triton kernels' ``common.row_cells``). ``ks``, ``ke``, ``d_lo``, ``d_hi``:
    scalars, or ``[rows, 1]`` columns. ``k0`` taken off each row's bound (not added to each cell's key) saves an
    add per cell."""
    r = gl.expand_dims(offs_m, 1)
    # r + max(d_lo, ks - r) rather than max(ks, r + d_lo): no sum leaves int32 (|d_lo|, |d_hi| <= 2^30).
    lo = r + gl.maximum(d_lo, ks - r) - k0
    hi = r + gl.minimum(d_hi + 1, ke - r) - k0
    width = gl.where(gl.expand_dims(row_ok, 1), gl.maximum(hi - lo, 0), 0)
    # A key left of the interval wraps to a large unsigned offset.
    return (gl.expand_dims(cols, 0) - lo).to(gl.uint32, bitcast=True) < width.to(gl.uint32, bitcast=True)


@gluon.jit
def key_cells(offs_n, offs_m, ks, ke, d_lo, d_hi):
    """The slice's cells of a (keys x rows) tile, rows unchecked: for key ``n`` in ``[ks, ke)`` the rows
    ``[n - d_hi, n - d_lo + 1)``, one unsigned compare per cell (the Triton kernels' ``common.dkdv_cells``)."""
    n = gl.expand_dims(offs_n, 1)
    # Clamped to rows [0, 2^31 - 1), so that no sum leaves int32 (rows are never negative).
    lo = n - gl.minimum(d_hi, n)
    hi = n + gl.minimum(1 - d_lo, 2147483647 - n)
    width = gl.where(gl.expand_dims((offs_n >= ks) & (offs_n < ke), 1), gl.maximum(hi - lo, 0), 0)
    return (gl.expand_dims(offs_m, 0) - lo).to(gl.uint32, bitcast=True) < width.to(gl.uint32, bitcast=True)
