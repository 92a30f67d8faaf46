"""Device-side geometry of FlashAttention windows, shared by the mask builders and the FA3 front-ends.

:func:`window_slices` turns a per-document window into at most three slices
with elementwise tensor ops (static shapes, no host sync), so the FA3
front-ends and the transformers backend build their ranges on the device
under ``torch.compile`` and CUDA-graph capture.
"""

from __future__ import annotations

import torch

from .constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL

__all__ = ["window_slices", "UNBOUNDED"]

# Stands for an unbounded window side in int64 arithmetic: larger than any
# sequence (tokens are < 2**30) and far from overflow.
UNBOUNDED = 1 << 40


def window_slices(qs, qe, ks, ke, left: int, right: int):
    """Slices covering a FlashAttention window inside each of ``B`` documents.

    Document ``b`` is queries ``[qs[b], qe[b])`` by keys ``[ks[b], ke[b])``
    (integer tensors of shape ``(B,)``, on any device). With
    ``off = Lk - Lq``, local query ``i`` attends local key ``j`` when
    ``i + off - left <= j <= i + off + right`` (FA3's bottom-right window;
    ``-1`` = unbounded side; causal is ``right = 0``). Integer tensors of
    any width are accepted (computed in int64).

    The band clipped to the document is at most three slices, whatever the
    window and length: rows whose band is cut by key 0 (a CAUSAL slice),
    rows whose band fits (one BI_CAUSAL band) or spans every key (FULL), and
    rows whose band is cut by the last key (an INV_CAUSAL slice)::

        C C . . . . . .      window_size=(2, 1) on an 8 x 8 document:
        C C C . . . . .      rows 0-1 CAUSAL (cut by key 0),
        B B B B . . . .      rows 2-6 one BI_CAUSAL band,
        . B B B B . . .      row 7 INV_CAUSAL (cut by the last key).
        . . B B B B . .      A window wider than the document turns
        . . . B B B B .      the band into FULL rows instead.
        . . . . B B B B
        . . . . . I I I

    Elementwise tensor ops only: static shapes, no host sync, so it traces
    under ``torch.compile`` and runs under CUDA-graph capture. Returns
    ``q_ranges (P*B, 2)``, ``k_ranges (P*B, 2)``, ``mask_types (P*B,)`` int32,
    slices of one document consecutive, where ``P`` depends on the window
    only: 1 when unbounded or causal without a left bound, 2 with one side
    unbounded, 3 otherwise. Empty slices are exactly ``[0, 0) x [0, 0)`` FULL.
    """
    left, right = int(left), int(right)
    # int64: the unbounded sentinel would overflow int32 arithmetic.
    qs, qe, ks, ke = (x.to(torch.int64) for x in (qs, qe, ks, ke))
    lq, lk = qe - qs, ke - ks
    if left < 0 and right < 0:
        q0, q1, k0, k1 = qs.unsqueeze(1), qe.unsqueeze(1), ks.unsqueeze(1), ke.unsqueeze(1)
        types = torch.full_like(q0, FULL)
    else:
        lo_w = UNBOUNDED if left < 0 else left
        hi_w = UNBOUNDED if right < 0 else right
        off = lk - lq
        zero = torch.zeros_like(lq)
        a = lo_w - off  # first row whose band starts at key >= 0
        b = lk - off - hi_w  # first row whose band reaches past the last key
        e_top = torch.clamp(-(off + hi_w), min=0)  # first row reaching key 0
        e_bot = lk - off + lo_w  # first row starting after the last key
        ab_lo, ab_hi = torch.minimum(a, b), torch.maximum(a, b)
        # CAUSAL: j <= i + off + right, keys from 0.
        t0 = e_top
        t1 = torch.maximum(torch.minimum(ab_lo, lq), t0)
        top = (t0, t1, zero, off + hi_w + t1)
        # BI_CAUSAL band where it fits, FULL where it spans all keys.
        m0 = torch.clamp(ab_lo, min=0)
        m1 = torch.minimum(ab_hi, lq)
        band = a <= b
        mid = (
            m0,
            m1,
            torch.where(band, m0 + off - lo_w, zero),
            torch.where(band, m1 + off + hi_w, lk),
        )
        # INV_CAUSAL: j >= i + off - left, keys up to the end.
        b0 = torch.clamp(ab_hi, min=0)
        b1 = torch.minimum(lq, e_bot)
        bot = (b0, b1, b0 + off - lo_w, lk)
        mid_type = torch.where(band, torch.full_like(lq, BI_CAUSAL), torch.full_like(lq, FULL))
        pieces = [(top, torch.full_like(lq, CAUSAL)), (mid, mid_type), (bot, torch.full_like(lq, INV_CAUSAL))]
        # Pieces that are empty for every document, known from the window alone:
        # no top cut without a right bound, no bottom cut without a left bound,
        # and a causal window unbounded on the left is its top piece only.
        if left < 0 and right == 0:
            pieces = pieces[:1]
        else:
            pieces = pieces[(1 if right < 0 else 0):(2 if left < 0 else 3)]
        q0, q1, k0, k1 = (torch.stack([p[0][c] for p in pieces], dim=1) for c in range(4))
        types = torch.stack([p[1] for p in pieces], dim=1)
        q0, q1 = q0 + qs.unsqueeze(1), q1 + qs.unsqueeze(1)
        k0, k1 = k0 + ks.unsqueeze(1), k1 + ks.unsqueeze(1)
    empty = (q1 <= q0) | (k1 <= k0)
    q0, q1, k0, k1, types = (torch.where(empty, torch.zeros_like(x), x) for x in (q0, q1, k0, k1, types))
    q_ranges = torch.stack([q0, q1], dim=-1).reshape(-1, 2).to(torch.int32)
    k_ranges = torch.stack([k0, k1], dim=-1).reshape(-1, 2).to(torch.int32)
    return q_ranges, k_ranges, types.reshape(-1).to(torch.int32)
