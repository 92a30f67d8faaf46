"""Dense float64 definitions the tests compare against (DESIGN §6).

Nothing here imports flashrange: the goldens are written from the
definitions, so a bug shared by the library's own helpers (``RangeMask.coverage``,
``reference.coverage_counts``) cannot hide in them.

``dense_counts`` is the mask of DESIGN §2 written cell by cell from the
per-type inequalities. ``dense_attention`` is softmax attention over a dense matrix of cover counts
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


# Mask-type codes of DESIGN §2 (MagiAttention's attn_type_map), written out here on purpose.
FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3


def dense_counts(q_ranges, k_ranges, mask_types, Tq, Tk):
    """Int32 `(Tq, Tk)`: how many slices cover each cell, from the inequalities of DESIGN §2.

    Slice ``[qs, qe) x [ks, ke)`` (ranges clamped to ``[0, Tq]`` / ``[0, Tk]``
    first, as the kernels do) with ``Lq = qe - qs``, ``Lk = ke - ks``,
    ``i' = i - qs``, ``j' = j - ks`` covers cell ``(i, j)`` of its rectangle when

    - FULL: always;
    - CAUSAL: ``j' <= i' + (Lk - Lq)`` (bottom-right aligned);
    - INV_CAUSAL: ``j' >= i'`` (top-left aligned);
    - BI_CAUSAL: both (nothing when ``Lq > Lk``).

    Empty slices and unknown types contribute nothing; a cell covered by two
    slices counts twice. Accepts tensors or nested lists.
    """
    as_list = lambda x: x.tolist() if isinstance(x, torch.Tensor) else list(x)  # noqa: E731
    qr, kr, mt = as_list(q_ranges), as_list(k_ranges), as_list(mask_types)
    counts = torch.zeros(Tq, Tk, dtype=torch.int32)
    i = torch.arange(Tq).unsqueeze(1)  # every cell's row ...
    j = torch.arange(Tk).unsqueeze(0)  # ... and column
    for (qs, qe), (ks, ke), t in zip(qr, kr, mt):
        qs, qe = min(max(int(qs), 0), Tq), min(max(int(qe), 0), Tq)
        ks, ke = min(max(int(ks), 0), Tk), min(max(int(ke), 0), Tk)
        if qe <= qs or ke <= ks or t not in (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL):
            continue
        Lq, Lk = qe - qs, ke - ks
        ip, jp = i - qs, j - ks
        cell = (i >= qs) & (i < qe) & (j >= ks) & (j < ke)
        if t in (CAUSAL, BI_CAUSAL):
            cell = cell & (jp <= ip + (Lk - Lq))
        if t in (INV_CAUSAL, BI_CAUSAL):
            cell = cell & (jp >= ip)
        counts += cell.to(torch.int32)
    return counts


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
    a, b = a.detach().double(), b.detach().double()
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
