"""Slice geometry shared by the forward and backward kernels.

A slice ``(qs, qe, ks, ke, type)`` covers cell ``(i, j)`` of its rectangle
when, with ``d = j - i``:

- CAUSAL (bottom-right aligned): ``d <= ke - qe``;
- INV_CAUSAL (top-left aligned): ``d >= ks - qs``;
- BI_CAUSAL: both; FULL: neither.

So every type is the rectangle cut by at most two diagonals, which makes
"which keys does this block of rows need" and "is this tile entirely inside"
a few integer comparisons.
"""

import triton
import triton.language as tl


@triton.jit
def slice_diagonals(qs, qe, ks, ke, mtype):
    """``(HAS_UPPER, d_max, HAS_LOWER, d_min)`` of a slice as runtime scalars."""
    has_upper = (mtype == 1) | (mtype == 3)
    has_lower = (mtype == 2) | (mtype == 3)
    return has_upper, ke - qe, has_lower, ks - qs


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
def tile_is_full(r0, r1, c0, c1, qs, qe, ks, ke, mtype):
    """Whether the slice covers every cell of rows ``[r0, r1)`` x keys ``[c0, c1)``."""
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    inside = (r0 >= qs) & (r1 <= qe) & (c0 >= ks) & (c1 <= ke)
    upper_ok = (~has_upper) | ((c1 - 1) - r0 <= d_max)
    lower_ok = (~has_lower) | (c0 - (r1 - 1) >= d_min)
    return inside & upper_ok & lower_ok


@triton.jit
def tile_mask(offs_i, offs_j, qs, qe, ks, ke, mtype):
    """Bool ``(len(offs_i), len(offs_j))``: cells of the tile the slice covers."""
    has_upper, d_max, has_lower, d_min = slice_diagonals(qs, qe, ks, ke, mtype)
    i = offs_i[:, None]
    j = offs_j[None, :]
    d = j - i
    mask = (i >= qs) & (i < qe) & (j >= ks) & (j < ke)
    mask = mask & ((~has_upper) | (d <= d_max))
    mask = mask & ((~has_lower) | (d >= d_min))
    return mask
