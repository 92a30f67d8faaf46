"""Device code and launch helpers shared by every kernel: constants, slice geometry, head-dim padding.

A slice ``(qs, qe, ks, ke, type)`` covers cell ``(i, j)`` of its rectangle
when, with ``d = j - i``:

- CAUSAL (bottom-right aligned): ``d <= ke - qe``;
- INV_CAUSAL (top-left aligned): ``d >= ks - qs``;
- BI_CAUSAL: both; FULL: neither.

So every type is the rectangle cut by at most two diagonals, which makes
"which keys does this block of rows need" and "is this tile entirely inside"
a few integer comparisons.
"""

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

from ..constants import BI_CAUSAL, CAUSAL, INV_CAUSAL, MAX_TOKENS, PLAN_BLOCK

__all__ = [
    "LOG2E",
    "LN2",
    "NO_DIAGONAL",
    "DEV_LOG2E",
    "DEV_LN2",
    "DEV_NO_DIAGONAL",
    "DEV_CAUSAL",
    "DEV_INV_CAUSAL",
    "DEV_BI_CAUSAL",
    "slice_row",
    "slice_diagonals",
    "tanh_exp2",
    "cast_rounded",
    "load_head_rows",
    "store_head_rows",
    "key_block",
    "dkdv_probs",
    "row_cells",
    "dkdv_cells",
    "dkdv_accumulate",
    "key_span",
    "full_row_run",
    "plan_program",
    "query_span",
    "forward_walk",
    "merged_span",
    "merged_rows",
    "tma_scratch",
    "ensure_tma_allocator",
    "gluon_sm90_ready",
    "warn_gluon_fallback",
    "tma_aligned",
    "WS_MAXNREG",
    "full_tile_run",
    "interpreting",
    "launch",
    "jit_launch",
    "run_compiled",
    "fast_launch_enabled",
    "pad_dim",
    "packed_heads",
    "needs_int64",
    "plan_split",
    "sm_count",
]

# exp(x) = exp2(x * LOG2E): the kernels keep scores in base 2.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# A diagonal bound that no cell can miss (|key - row| <= MAX_TOKENS < 2**30).
NO_DIAGONAL = 1 << 30
if MAX_TOKENS >= NO_DIAGONAL:  # pragma: no cover - guards an edit of constants.py
    raise ImportError("NO_DIAGONAL must exceed MAX_TOKENS")

# Device-side copies: a @triton.jit function reads module globals only as constexprs.
DEV_LOG2E = tl.constexpr(LOG2E)
DEV_LN2 = tl.constexpr(LN2)
DEV_NO_DIAGONAL = tl.constexpr(NO_DIAGONAL)
DEV_CAUSAL = tl.constexpr(CAUSAL)
DEV_INV_CAUSAL = tl.constexpr(INV_CAUSAL)
DEV_BI_CAUSAL = tl.constexpr(BI_CAUSAL)
# Merged tiles (merged_span) mask every element: a longer run would mask tiles that walking
# the slices one by one skips the mask on (the long document a short one follows).
MERGE_MAX_TILES = 4
DEV_MERGE_MAX_TILES = tl.constexpr(MERGE_MAX_TILES)


# Per kernel: how each argument enters the cache key (see _key_plan).
_KEY_PLANS = {}
_INT32 = 2**31


def _key_plan(kernel):
    """Per parameter: 'c' constexpr (its value), 'n' int not specialized (its width), 'a' anything else."""
    plan = _KEY_PLANS.get(kernel)
    if plan is None:
        plan = tuple("c" if p.is_constexpr else ("n" if p.do_not_specialize else "a") for p in kernel.params)
        _KEY_PLANS[kernel] = plan
    return plan


def _cache_key(kernel, args):
    """What of ``args`` can change the kernel Triton builds (a superset of its own specialization)."""
    key = []
    append = key.append
    for kind, x in zip(_key_plan(kernel), args):
        if kind == "c":
            append(x)
        elif type(x) is torch.Tensor:
            append((x.dtype, x.data_ptr() & 15 == 0))
        elif type(x) is int:
            if kind == "n":
                append(-_INT32 <= x < _INT32)
            else:
                append((x == 1, x & 15 == 0, -_INT32 <= x < _INT32))
        elif type(x) is float:
            append(0.0)
        else:
            append(x if x is None or isinstance(x, (bool, str)) else (type(x), x))
    return tuple(key)


def _fast_path_available() -> bool:
    try:
        from triton import knobs  # noqa: F401
    except ImportError:
        return False
    return True


_FAST_PATH = None
_HANDLES = {}


def fast_launch_enabled() -> bool:
    """Whether launches may skip Triton's JIT dispatcher (a GPU run with ``triton.knobs``; never the interpreter).

    Decided once per process, like the interpreter switch it reads.
    """
    global _FAST_PATH
    if _FAST_PATH is None:
        _FAST_PATH = _fast_path_available() and not interpreting()
    return _FAST_PATH


def _raw_stream_getter():
    # The raw handle of the current stream without building a torch.cuda.Stream object
    # (what Inductor's generated code calls); the public route where it is missing.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


_current_raw_stream = _raw_stream_getter()


def jit_launch(kernel, grid, args, num_warps=4, num_stages=None, maxnreg=None):
    """``kernel[grid](*args)`` through Triton's JIT dispatcher; returns the compiled kernel it launched.

    ``maxnreg``: the per-thread register cap of the launch (a warp-specialized
    Gluon kernel splits that budget between its partitions).
    """
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return kernel[grid](*args, **options)


def run_compiled(handle, grid, args, device=None):
    """Launch a compiled kernel (from :func:`jit_launch`) on the current device's current stream.

    ``args`` as for the JIT launch (every parameter, constexprs included). The
    caller guarantees the handle is the one Triton would pick for these
    arguments (see :func:`launch`) and that the current device is the one it
    was compiled on.
    """
    from triton import knobs

    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = _current_raw_stream(torch.cuda.current_device() if device is None else device)
    # Launch hooks (profilers) get the same metadata as through the JIT dispatcher.
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    meta = handle.launch_metadata(grid, stream, *args) if enter is not None else None
    handle.run(grid[0], g1, g2, stream, handle.function, handle.packed_metadata, meta, enter, leave, *args)


def launch(kernel, grid, args, num_warps=4, num_stages=None, maxnreg=None):
    """Launch ``kernel[grid](*args)``; repeated launches go straight to the compiled handle.

    ``args`` lists every parameter of the kernel in order, constexprs included.
    The first launch for a specialization goes through Triton's JIT dispatcher
    (which compiles or finds the kernel); later ones skip its per-call work
    (binding, specialization, cache key) and call the compiled kernel's
    launcher directly, as Inductor's generated code does. The cache key holds
    everything that can change the kernel Triton picks (dtypes, 16-byte
    alignment of pointers, integer properties, constexpr values), so a reused
    handle is always the one Triton would have picked. Under the interpreter,
    or on a Triton without ``triton.knobs``, every launch takes the JIT path.
    """
    if not fast_launch_enabled():
        jit_launch(kernel, grid, args, num_warps, num_stages, maxnreg)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, num_warps, num_stages, maxnreg, _cache_key(kernel, args))
    handle = _HANDLES.get(key)
    if handle is None:
        _HANDLES[key] = jit_launch(kernel, grid, args, num_warps, num_stages, maxnreg)
        return
    run_compiled(handle, grid, args, device)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device: the grid of a persistent kernel (one program per SM)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pad_dim(d: int) -> int:
    """Head dim padded to the power of two a tile holds (at least 16, the smallest dot)."""
    return max(16, triton.next_power_of_2(d))


def packed_heads(*tensors: torch.Tensor) -> bool:
    """Whether each row of every ``(T, H, X)`` tensor holds its heads side by side, ``X`` wide, with ``X``
    a tile width (``pad_dim(X) == X``): a Hopper kernel then reads any head through one descriptor over
    ``(T, H * X)`` (``sm90_common``)."""
    return all(t.stride(2) == 1 and t.stride(1) == t.shape[2] == pad_dim(t.shape[2]) for t in tensors)


def needs_int64(*tensors) -> bool:
    """Whether some element offset of these tensors (strides included) passes int32.

    A view into a fused buffer (e.g. q inside a packed qkv) has row strides far
    larger than its own row length, so ``numel()`` says nothing about offsets.
    """
    for t in tensors:
        if t.numel() == 0:
            continue
        shape, stride = t.shape, t.stride()
        last = 0
        for i in range(t.dim()):
            last += (shape[i] - 1) * abs(stride[i])
        if last >= 2**31 - 1:
            return True
    return False


def plan_split(block: int) -> int:
    """Kernel tiles per plan block along the major axis; ``block`` must divide the plan's block."""
    if block > PLAN_BLOCK or PLAN_BLOCK % block:
        raise ValueError(f"a kernel tile of {block} rows does not divide the plan's {PLAN_BLOCK}-row blocks")
    return PLAN_BLOCK // block


@triton.jit
def tanh_exp2(x):
    """``tanh(x)`` from one ``exp2``: portable across Triton versions (no libdevice), saturates to +-1 cleanly."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * DEV_LOG2E)) + 1.0)


@triton.jit
def cast_rounded(x, dtype: tl.constexpr, IS_BF16_EMULATED: tl.constexpr):
    """``x.to(dtype)``; with ``IS_BF16_EMULATED``, float32 rounded to bfloat16 values instead.

    The Triton interpreter cannot multiply bfloat16 and truncates when it
    converts to it; emulating keeps the GPU's numerics (operands rounded to
    nearest even, float32 accumulation) in CPU tests.
    """
    if IS_BF16_EMULATED:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def load_head_rows(ptr, head, rows, mask_rows, offs_c, width, stride_t, stride_h):
    """Rows ``rows`` of head ``head`` of a ``(T, H, X)`` tensor at columns ``offs_c``: zeros outside
    ``mask_rows`` and past column ``width``."""
    return tl.load(ptr + head * stride_h + rows[:, None] * stride_t + offs_c[None, :],
                   mask=mask_rows[:, None] & (offs_c[None, :] < width), other=0.0)


@triton.jit
def store_head_rows(ptr, x, head, rows, mask_rows, offs_c, width, stride_t, stride_h):
    """``x`` into rows ``rows`` of head ``head`` of a ``(T, H, X)`` tensor, where ``mask_rows`` and below
    column ``width``."""
    tl.store(ptr + head * stride_h + rows[:, None] * stride_t + offs_c[None, :], x,
             mask=mask_rows[:, None] & (offs_c[None, :] < width))


@triton.jit
def key_block(k_ptr, v_ptr, pid_hk, c0, Tk, D, DV, stride_kt, stride_kh, stride_vt, stride_vh, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, IS_BF16_EMULATED: tl.constexpr):
    """A Triton dK/dV program's keys ``[c0, c0 + BLOCK_N)`` of key/value head ``pid_hk``: ``(offs_n, offs_d,
    offs_dv, mask_n, cols, hk, k, v, dk, dv)``, ``cols`` and ``hk`` the keys and head as int64, ``k`` and ``v``
    zero past ``Tk`` (float32 with ``IS_BF16_EMULATED``) and ``dk``, ``dv`` zeroed accumulators."""
    offs_n = c0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_n = offs_n < Tk
    cols = offs_n.to(tl.int64)
    hk = pid_hk.to(tl.int64)
    k = load_head_rows(k_ptr, hk, cols, mask_n, offs_d, D, stride_kt, stride_kh)
    v = load_head_rows(v_ptr, hk, cols, mask_n, offs_dv, DV, stride_vt, stride_vh)
    if IS_BF16_EMULATED:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    return offs_n, offs_d, offs_dv, mask_n, cols, hk, k, v, dk, dv


@triton.jit
def dkdv_probs(k, q, lse2, qk_scale2, scale, softcap, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``(P^T, th)`` of one query tile of a key block (keys by rows, before the element mask): ``th`` is the
    tanh of the capped scores with ``HAS_SOFTCAP`` (else unused). Shared by the Triton dK/dV kernels."""
    qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        th = tanh_exp2(qkT * (scale / softcap))
        pT = tl.exp2(th * (softcap * DEV_LOG2E) - lse2[None, :])
    else:
        th = qkT
        pT = tl.exp2(qkT * qk_scale2 - lse2[None, :])
    return pT, th


@triton.jit
def row_cells(offs_m, offs_n, row_ok, ks, ke, d_lo, d_hi):
    """The slice's cells among rows ``offs_m`` by keys ``offs_n``: in row ``r`` the keys
    ``[max(ks, r + d_lo), min(ke, r + d_hi + 1))``, none where ``row_ok`` is false: the four inequalities of
    docs/design.md §2 folded into one interval per row, so a cell costs one unsigned compare of its key's offset
    from the row's first key (docs/design.md, "Edge tiles")."""
    r = offs_m[:, None]
    # r + max(d_lo, ks - r) rather than max(ks, r + d_lo): no sum leaves int32 (|d_lo|, |d_hi| <= 2^30).
    lo = r + tl.maximum(d_lo, ks - r)
    hi = r + tl.minimum(d_hi + 1, ke - r)
    width = tl.where(row_ok[:, None], tl.maximum(hi - lo, 0), 0)
    # A key left of the interval wraps to a large unsigned offset.
    return (offs_n[None, :] - lo).to(tl.uint32, bitcast=True) < width.to(tl.uint32, bitcast=True)


@triton.jit
def dkdv_cells(offs_n, offs_m, ks, ke, d_lo, d_hi):
    """The slice's cells among keys ``offs_n`` by rows ``offs_m``, rows unchecked: for a key ``n`` in ``[ks, ke)``
    the rows ``[n - d_hi, n - d_lo + 1)`` (diagonal bounds of key - row), one unsigned compare per cell
    (``row_cells``, by keys)."""
    n = offs_n[:, None]
    # Clamped to rows [0, 2^31 - 1), so that no sum leaves int32 (rows are never negative).
    lo = n - tl.minimum(d_hi, n)
    hi = n + tl.minimum(1 - d_lo, 2147483647 - n)
    width = tl.where(((offs_n >= ks) & (offs_n < ke))[:, None], tl.maximum(hi - lo, 0), 0)
    return (offs_m[None, :] - lo).to(tl.uint32, bitcast=True) < width.to(tl.uint32, bitcast=True)


@triton.jit
def dkdv_accumulate(dk, dv, v, q, do, delta, pT, th, cell, IS_MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, IS_BF16_EMULATED: tl.constexpr):
    """One query tile's ``dV += P^T dO`` and ``dK += dS^T Q``: ``(dk, dv, dS^T)``, ``dS^T`` rounded to q's dtype
    (masked at ``cell`` with ``IS_MASKED``: a key these rows do not read may hold NaN in v, and 0 * NaN must
    reach no gradient)."""
    dv += tl.dot(cast_rounded(pT, do.dtype, IS_BF16_EMULATED), do, input_precision=DOT_PRECISION)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    dsT = pT * (dpT - delta[None, :])
    if HAS_SOFTCAP:
        dsT = dsT * (1.0 - th * th)
    if IS_MASKED:
        dsT = tl.where(cell, dsT, 0.0)
    dsT = cast_rounded(dsT, q.dtype, IS_BF16_EMULATED)
    dk += tl.dot(dsT, q, input_precision=DOT_PRECISION)
    return dk, dv, dsT


@triton.jit
def slice_row(slices_ptr, s):
    """Slice ``s`` of a plan's slice table: ``(qs, qe, ks, ke, type)`` (the Triton kernels' scalar loads)."""
    qs = tl.load(slices_ptr + s * 5)
    qe = tl.load(slices_ptr + s * 5 + 1)
    ks = tl.load(slices_ptr + s * 5 + 2)
    ke = tl.load(slices_ptr + s * 5 + 3)
    mtype = tl.load(slices_ptr + s * 5 + 4)
    return qs, qe, ks, ke, mtype


@triton.jit
def slice_diagonals(qs, qe, ks, ke, mtype):
    """``(HAS_UPPER, d_max, HAS_LOWER, d_min)`` of a slice as runtime scalars."""
    has_upper = (mtype == DEV_CAUSAL) | (mtype == DEV_BI_CAUSAL)
    has_lower = (mtype == DEV_INV_CAUSAL) | (mtype == DEV_BI_CAUSAL)
    return has_upper, ke - qe, has_lower, ks - qs


@triton.jit
def plan_program(pid, n_heads, T, block_order_ptr, block_lo_ptr, block_hi_ptr, SPLIT: tl.constexpr,
                 BLOCK: tl.constexpr):
    """What program ``pid`` of a plan's grid owns: ``(head, start, end, s_lo, s_hi)``.

    Programs walk the plan's blocks heaviest first (``block_order``), all heads
    of one block side by side; a block is ``SPLIT`` tiles of ``BLOCK`` rows (or
    keys), and the program owns tile ``[start, end)`` of it, clipped at ``T``,
    and reads the block's window of slices ``[s_lo, s_hi)``. Every kernel, Triton
    or Gluon, forward or backward, maps its grid this way.
    """
    head = pid % n_heads
    rank = pid // n_heads
    block = tl.load(block_order_ptr + rank // SPLIT)
    start = (block * SPLIT + rank % SPLIT) * BLOCK
    return head, start, tl.minimum(start + BLOCK, T), tl.load(block_lo_ptr + block), tl.load(block_hi_ptr + block)


@triton.jit
def full_row_run(c0, c1, qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, m_lo, m_hi):
    """The rows ``[f_lo, f_hi)`` of a slice's reach ``[m_lo, m_hi)`` that read every key of ``[c0, c1)``: the
    dK/dV kernels' query tiles that need no element mask. Empty when the keys are not all inside the slice."""
    f_lo = tl.where(has_upper, tl.maximum(qs, c1 - 1 - d_max), qs)
    f_hi = tl.where(has_lower, tl.minimum(qe, c0 - d_min + 1), qe)
    f_lo = tl.minimum(tl.maximum(f_lo, m_lo), m_hi)
    f_hi = tl.minimum(tl.maximum(f_hi, f_lo), m_hi)
    keys_inside = (c0 >= ks) & (c1 <= ke)
    return tl.where(keys_inside, f_lo, m_hi), tl.where(keys_inside, f_hi, m_hi)


@triton.jit
def key_span(r0, r1, qs, qe, ks, ke, mtype):
    """Keys ``[k_lo, k_hi)`` that rows ``[r0, r1)`` of the slice can reach (may be empty)."""
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    a = tl.maximum(r0, qs)
    b = tl.minimum(r1, qe)
    k_lo = tl.where(has_lower, tl.maximum(ks, a + d_min), ks)
    k_hi = tl.where(has_upper, tl.minimum(ke, b + d_max), ke)
    k_hi = tl.where(b > a, k_hi, k_lo)
    return k_lo, k_hi


@triton.jit
def query_span(c0, c1, qs, qe, ks, ke, mtype):
    """Rows ``[q_lo, q_hi)`` of the slice that read any of keys ``[c0, c1)`` (may be empty)."""
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    a = tl.maximum(c0, ks)
    b = tl.minimum(c1, ke)
    q_lo = tl.where(has_upper, tl.maximum(qs, a - d_max), qs)
    q_hi = tl.where(has_lower, tl.minimum(qe, b - d_min), qe)
    q_hi = tl.where(b > a, q_hi, q_lo)
    return q_lo, q_hi


@triton.jit
def forward_walk(r0, r1, qs, qe, ks, ke, mtype, BLOCK_N: tl.constexpr):
    """How the forward walks a slice for rows ``[r0, r1)``: its diagonals, then the key tiles from ``k_lo``.

    Returns ``(has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles)``: those rows reach
    keys ``[k_lo, k_hi)``, which ``n_tiles`` tiles of ``BLOCK_N`` keys cover (none for an empty
    slice or a type code outside 0..3: the plan sorts those last, the check keeps a
    stray one harmless). Shared by the Triton and the Gluon forward.
    """
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    k_lo, k_hi = key_span(r0, r1, qs, qe, ks, ke, mtype)
    k_hi = tl.where((mtype >= 0) & (mtype <= 3), k_hi, k_lo)
    n_tiles = tl.cdiv(tl.maximum(k_hi - k_lo, 0), BLOCK_N)
    return has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles


@triton.jit
def full_tile_run(h0, h1, qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, k_lo, n_tiles,
                  BLOCK_N: tl.constexpr):
    """Tiles ``[n_full_lo, n_full_hi)`` of a :func:`forward_walk` inside the slice for every row of ``[h0, h1)``.

    Those tiles skip the element mask: the rows all lie in ``[qs, qe)`` and every key
    column passes both diagonals (found in closed form). Empty when the rows leave the slice.
    """
    rows_in = (h0 >= qs) & (h1 <= qe)
    c_lo = tl.where(has_lower, tl.maximum(ks, h1 - 1 + d_min), ks)
    c_hi = tl.where(has_upper, tl.minimum(ke, h0 + d_max + 1), ke)
    n_full_lo = tl.minimum(tl.cdiv(tl.maximum(c_lo - k_lo, 0), BLOCK_N), n_tiles)
    n_full_hi = tl.maximum(tl.minimum((c_hi - k_lo) // BLOCK_N, n_tiles), n_full_lo)
    full_ok = rows_in & (c_hi - k_lo >= 0)
    n_full_lo = tl.where(full_ok, n_full_lo, n_tiles)
    n_full_hi = tl.where(full_ok, n_full_hi, n_tiles)
    return n_full_lo, n_full_hi


@triton.jit
def _walk_slice(slices_ptr, s, r0, r1, BLOCK_N: tl.constexpr):
    """Slice ``s`` of a plan's slice table and the forward's walk of it for rows ``[r0, r1)``:
    ``(qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles)``."""
    row = slices_ptr + s * 5
    qs = tl.load(row + 0)
    qe = tl.load(row + 1)
    ks = tl.load(row + 2)
    ke = tl.load(row + 3)
    has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles = forward_walk(r0, r1, qs, qe, ks, ke, tl.load(row + 4),
                                                                            BLOCK_N)
    return qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, k_lo, k_hi, n_tiles


@triton.jit
def merged_span(slices_ptr, s_lo, s_hi, r0, r1, BLOCK_N: tl.constexpr):
    """Whether rows ``[r0, r1)`` walk their window as one run of key tiles, each row masked by its own slice
    (docs/design.md, "Merged tiles"): ``(is_merged, k_lo, n_tiles, k_end)``, the run's tiles from ``k_lo``
    and the end of its slices' keys (keys from there must read as zeros).

    Merged when the slices that meet the rows split them (no row in two), their keys form one interval
    with no gap (every key a tile loads is covered by some slice), and one run over their reach takes
    fewer tiles than walking them one by one, and at most ``MERGE_MAX_TILES``. A function of the plan's
    canonical slices only, so reruns, slice permutations and empty slices keep the decision and the bits.
    """
    n_sep = 0
    n_meet = 0
    n_misfit = 0
    k_lo = r0 * 0 + DEV_NO_DIAGONAL
    k_hi = r0 * 0
    k_end = r0 * 0
    first_ks = r0 * 0
    row_end = r0
    for s in range(s_lo, s_hi):
        qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, lo, hi, n_t = _walk_slice(slices_ptr, s, r0, r1,
                                                                                    BLOCK_N)
        meets = n_t > 0
        # The canonical order sorts by (qs, ks): the rows split iff each slice starts at or after the
        # rows of the one before; the keys have no gap iff each slice starts inside their union so far.
        fits = (tl.maximum(qs, r0) >= row_end) & ((n_meet == 0) | ((ks >= first_ks) & (ks <= k_end)))
        n_misfit += (meets & (fits == 0)).to(tl.int32)
        first_ks = tl.where(meets & (n_meet == 0), ks, first_ks)
        row_end = tl.where(meets, tl.minimum(qe, r1), row_end)
        k_end = tl.where(meets, tl.maximum(k_end, ke), k_end)
        k_lo = tl.where(meets, tl.minimum(k_lo, lo), k_lo)
        k_hi = tl.where(meets, tl.maximum(k_hi, hi), k_hi)
        n_sep += n_t
        n_meet += meets.to(tl.int32)
    n_tiles = tl.cdiv(tl.maximum(k_hi - k_lo, 0), BLOCK_N)
    is_merged = (n_misfit == 0) & (n_meet > 1) & (n_tiles < n_sep) & (n_tiles <= DEV_MERGE_MAX_TILES)
    return is_merged, k_lo, n_tiles, k_end


@triton.jit
def merged_rows(slices_ptr, s_lo, s_hi, r0, r1, offs_m, BLOCK_N: tl.constexpr):
    """For merged tiles, each row of ``offs_m``'s own slice: ``(row_ok, ks, ke, d_lo, d_hi)``, the last four
    as ``[rows, 1]`` columns (a row no slice covers has an empty key range)."""
    row_ks = offs_m * 0
    row_ke = offs_m * 0
    row_dlo = offs_m * 0
    row_dhi = offs_m * 0
    for s in range(s_lo, s_hi):
        qs, qe, ks, ke, has_upper, d_max, has_lower, d_min, lo, hi, n_t = _walk_slice(slices_ptr, s, r0, r1,
                                                                                    BLOCK_N)
        mine = (offs_m >= qs) & (offs_m < qe) & (n_t > 0)
        row_ks = tl.where(mine, ks, row_ks)
        row_ke = tl.where(mine, ke, row_ke)
        row_dhi = tl.where(mine, tl.where(has_upper, d_max, DEV_NO_DIAGONAL), row_dhi)
        row_dlo = tl.where(mine, tl.where(has_lower, d_min, -DEV_NO_DIAGONAL), row_dlo)
    return row_ke > row_ks, row_ks[:, None], row_ke[:, None], row_dlo[:, None], row_dhi[:, None]


def tma_scratch(size: int, alignment: int, stream):
    # Called at launch, under the launcher's device guard.
    return torch.empty(size, dtype=torch.int8, device=torch.cuda.current_device())


# The warp-specialized Hopper (Gluon) kernels' register cap per thread at launch: over their
# 12 warps (two consumer warpgroups, one producer warpgroup) the whole register file, which
# the partitions then split as 240 / 240 / 24.
WS_MAXNREG = 168


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t``: its base and every stride but the last are 16-byte multiples."""
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all(st * es % 16 == 0 for st in t.stride()[:-1])


def gluon_sm90_ready(device_index) -> bool:
    """Whether the Hopper (Gluon) kernels can run on CUDA device ``device_index`` (``None``: the current
    one): a compute-capability-9 GPU, no interpreter, and a Triton whose Gluon has the Hopper ops they use."""
    if interpreting() or not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index)[0] != 9:
        return False
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
            mbarrier,
            tma,
            warpgroup_mma,
            warpgroup_mma_wait,
        )
    except ImportError:
        return False
    return True


def warn_gluon_fallback(what: str, error: Exception, stacklevel: int) -> None:
    """One warning that a Hopper (Gluon) kernel did not build and the Triton kernel runs instead."""
    warnings.warn(
        f"flashrange: the Hopper {what} kernel (Gluon) did not build with Triton {triton.__version__} "
        f"({type(error).__name__}: {str(error)[:500]}); the Triton kernel runs instead, slower on this GPU. "
        "Please report this with your Triton version.",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )


def ensure_tma_allocator():
    """Device-side tensor descriptors need global scratch; take it from PyTorch's allocator.

    Triton keeps its allocator in a context variable, so every thread has its own:
    the autograd engine's worker thread (where activation checkpointing runs the
    forward again) and a user's threads start without one. Setting it is one
    ``ContextVar.set``, so it is done on every launch that needs it, never
    remembered in a flag.
    """
    triton.set_allocator(tma_scratch)
