"""Dense float64 definitions the tests compare against (DESIGN §6).

``dense_attention`` is softmax attention over a dense matrix of cover counts
(a cell covered ``c`` times weighs ``c``, as a key that appears ``c`` times),
written the plain way in float64 and differentiable with ``torch.autograd``.
Rows with no covered cell get ``out = 0`` and ``lse = -inf`` and take no part
in the graph, so their gradients are exactly zero.
"""

from __future__ import annotations

import math

import torch


def dense_attention(q, k, v, counts, softmax_scale=None, softcap=0.0):
    """`q` `(Tq, Hq, D)`, `k` `(Tk, Hkv, D)`, `v` `(Tk, Hkv, Dv)`, `counts` `(Tq, Tk)` -> `(out, lse)` float64."""
    q, k, v = q.double(), k.double(), v.double()
    Tq, Hq, D = q.shape
    G = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    kk = k.repeat_interleave(G, dim=1)
    vv = v.repeat_interleave(G, dim=1)
    rows = (counts > 0).any(dim=1).nonzero().squeeze(1)
    s = torch.einsum("rhd,jhd->hrj", q[rows], kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    logits = s + torch.log(counts[rows].double()).unsqueeze(0)
    lse_r = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse_r.unsqueeze(-1))
    out_r = torch.einsum("hrj,jhd->rhd", p, vv)
    out = torch.zeros(Tq, Hq, v.shape[2], dtype=torch.float64).index_copy(0, rows, out_r)
    lse = torch.full((Tq, Hq), float("-inf"), dtype=torch.float64).index_copy(0, rows, lse_r.transpose(0, 1))
    return out, lse


def fa3_window_counts(Lq, Lk, causal=False, window_size=(-1, -1)):
    """Int32 `(Lq, Lk)` mask of FlashAttention-3 for one sequence, from its inequality.

    Query ``i`` attends key ``j`` when ``j <= i + Lk - Lq + right`` and
    ``j >= i + Lk - Lq - left`` (a side of ``-1`` is unbounded; ``causal``
    means ``right = 0``).
    """
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(Lq).unsqueeze(1)
    j = torch.arange(Lk).unsqueeze(0)
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if right >= 0:
        ok &= j <= i + (Lk - Lq) + right
    if left >= 0:
        ok &= j >= i + (Lk - Lq) - left
    return ok.to(torch.int32)


def max_err(a, b):
    """Largest absolute difference, treating equal infinities as equal."""
    a, b = a.double(), b.double()
    same_inf = torch.isinf(a) & (a == b)
    d = torch.where(same_inf, torch.zeros_like(a), (a - b).abs())
    return float(d.max()) if d.numel() else 0.0


def random_slice_rows(Tq, Tk, n, rng, *, n_empty=0, uncovered=0, random_types=False, mixed_empties=True):
    """Random slices ``(qs, qe, ks, ke, type)``: overlaps, length-1 slices, tensor edges, then empty ones.

    The last ``uncovered`` query rows are left to no slice. Types cycle
    through the four, or are drawn from ``rng`` with ``random_types``. Empty
    slices are ``[0, 0)`` padding, or with ``mixed_empties`` also empty q or
    k ranges at random offsets. ``rng`` is a ``random.Random``.
    """
    top = Tq - uncovered
    rows = []
    for s in range(n):
        kind = rng.random()
        if kind < 0.15:  # length-1 slice
            qs = rng.randrange(top)
            qe = qs + 1
        elif kind < 0.3:  # touching the edges
            qs, qe = 0, top
        else:
            qs = rng.randrange(top)
            qe = rng.randint(qs + 1, top)
        ks = rng.randrange(Tk)
        ke = rng.randint(ks + 1, Tk) if rng.random() < 0.8 else Tk
        rows.append((qs, qe, ks, ke, rng.randrange(4) if random_types else s % 4))
    for _ in range(n_empty):
        if mixed_empties:
            e = rng.randrange(Tq + 1)
            at = rng.randint(0, len(rows))
            rows.insert(at, rng.choice([(0, 0, 0, 0, 0), (e, e, 0, Tk, 1), (0, Tq, e % Tk, e % Tk, 2)]))
        else:
            rows.insert(rng.randint(0, len(rows)), (0, 0, 0, 0, 0))
    return rows
