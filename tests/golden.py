"""Dense float64 definitions the tests compare against (docs/design.md §10).

Nothing here imports flashrange: the goldens are written from the
definitions, so a bug shared by the library's own helpers (``RangeMask.coverage``,
``reference.coverage_counts``) cannot hide in them.

``dense_counts`` is the mask of docs/design.md §2 written cell by cell from the
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


# Mask-type codes of docs/design.md §2 (MagiAttention's attn_type_map), written out here on purpose.
FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3


def dense_counts(q_ranges, k_ranges, mask_types, Tq, Tk):
    """Int32 `(Tq, Tk)`: how many slices cover each cell, from the inequalities of docs/design.md §2.

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


def grad_inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse=True, device="cpu"):
    """``(q, k, v, dout, dlse)`` of a backward test: standard normal, drawn in that order from one generator
    seeded with ``seed`` on ``device``, then cast to ``dtype`` (``dlse`` stays float32, zeros without
    ``with_dlse``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(Tq, Hq, D, generator=g, device=device).to(dtype)
    k = torch.randn(Tk, Hkv, D, generator=g, device=device).to(dtype)
    v = torch.randn(Tk, Hkv, Dv, generator=g, device=device).to(dtype)
    dout = torch.randn(Tq, Hq, Dv, generator=g, device=device).to(dtype)
    dlse = torch.randn(Tq, Hq, generator=g, device=device) if with_dlse else torch.zeros(Tq, Hq, device=device)
    return q, k, v, dout, dlse


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


# Budgets of the three-way rule beyond "twice the reference's error", in units of the dtype's eps
# times the golden's own magnitude: per row, of the row (L2 over the head dim); per tensor, of the
# whole tensor (Frobenius) divided by sqrt(rows): the kernel's extra error comes from rounding P
# and dS to the input dtype, independent from row to row, so the slack of the comparison shrinks
# as it averages over more rows, while an error everywhere (a scale) does not.
# Measured on 570 gradient tensors of random masks (bf16 / fp16, CPU interpreter): a correct
# kernel used at most 0.43 of ROW_BUDGET = 1 and 0.41 of TENSOR_BUDGET = 0.75; dK scaled by
# 1.005 in bf16 passed the former rule (global max, floor eps * max|golden|) on every tensor and
# fails this one on most tensors of more than a few dozen rows (a 0.5% scale is below bf16's
# resolution, so only the average over many rows can see it).
ROW_BUDGET = 1.0
TENSOR_BUDGET = 0.75


def shuffled_and_padded(rows, rng, n_empty):
    """``(shuffled, padded)``: the slice rows in a random order, and that order with ``n_empty`` empty slices
    inserted at random places (an invariance the kernels must keep bit for bit)."""
    shuffled = rows[:]
    rng.shuffle(shuffled)
    padded = shuffled[:]
    for _ in range(n_empty):
        padded.insert(rng.randint(0, len(padded)), (0, 0, 0, 0, FULL))
    return shuffled, padded


def short_slice_rows(Tq, Tk, n, rng, *, max_len=40):
    """``n`` short slices ``(qs, qe, ks, ke, type)``: at most ``max_len`` rows and keys each, every end different.

    The shape that races a per-slice tensor descriptor against the loads of
    the slice before it (a kernel's tiles from many slices in quick succession,
    each slice bounded at its own end). Types are drawn from ``rng``.
    """
    rows = []
    for _ in range(n):
        qe = rng.randint(1, Tq)
        qs = qe - rng.randint(1, min(qe, max_len))
        ke = rng.randint(1, Tk)
        ks = ke - rng.randint(1, min(ke, max_len))
        rows.append((qs, qe, ks, ke, rng.randrange(4)))
    return rows


def three_way_errors(got, ref, golden):
    """Per-row and whole-tensor errors of ``got`` and ``ref`` against ``golden`` (float64).

    Rows are all leading dims (the last dim is the head dim). Returns a dict of
    float64 tensors ``row_got``, ``row_ref``, ``row_gold`` (L2 norms per row),
    scalars ``got``, ``ref`` (Frobenius errors) and the int ``rows`` (rows of golden not all
    zero, at least 1).
    """
    width = golden.shape[-1] if golden.dim() else 1
    g = golden.detach().double().reshape(-1, width)
    x = got.detach().double().reshape(-1, width)
    r = ref.detach().double().reshape(-1, width)
    return {
        "row_got": (x - g).norm(dim=1),
        "row_ref": (r - g).norm(dim=1),
        "row_gold": g.norm(dim=1),
        "got": (x - g).norm(),
        "ref": (r - g).norm(),
        "rows": max(1, int((g != 0).any(dim=1).sum())),
    }


def assert_three_way(name, got, ref, golden):
    """PyTorch's three-way rule, per row and per tensor (docs/design.md §10).

    ``golden``: float64 result; ``ref``: the reference run in the test dtype;
    ``got``: the candidate (same dtype as ``ref``). With ``eps`` of that dtype:

    - every row: ``|got - golden| <= 2 |ref - golden| + ROW_BUDGET * eps * |golden row|``
      (L2 over the head dim): a wrong row cannot hide behind larger rows;
    - the tensor: ``||got - golden|| <= 2 ||ref - golden|| + TENSOR_BUDGET * eps * ||golden|| / sqrt(rows)``
      (Frobenius; ``rows``: rows of golden not all zero): a small error everywhere
      (a scale of 1.005 in bf16) cannot hide behind the rounding of the output.

    Both also allow float32 noise (``eps32 * sqrt(head_dim)`` at the largest row, at
    least 1: unit-scale inputs), the remainder of results that cancel to about zero;
    tests that need exact zeros check them.
    """
    assert got.shape == golden.shape == ref.shape, f"{name}: shapes {tuple(got.shape)}, {tuple(golden.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype}, reference {ref.dtype}"
    if golden.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    eps = torch.finfo(got.dtype).eps
    e = three_way_errors(got, ref, golden)
    # Float32 noise of a head-dim-long accumulation at the tensor's largest row (unit-scale
    # inputs): what a result that cancels to ~0 keeps (dS = p (dp - delta) when p = 1).
    noise = torch.finfo(torch.float32).eps * golden.shape[-1] ** 0.5 * max(1.0, float(e["row_gold"].max()))
    budget = 2 * e["row_ref"] + ROW_BUDGET * eps * e["row_gold"] + noise
    over = e["row_got"] - budget
    worst = int(over.argmax())
    assert float(over[worst]) <= 0, (
        f"{name}: row {worst} error {float(e['row_got'][worst]):.3e} > 2 x reference "
        f"{float(e['row_ref'][worst]):.3e} + {ROW_BUDGET} eps x |row| {float(e['row_gold'][worst]):.3e} "
        f"({int((over > 0).sum())} of {over.numel()} rows over budget)"
    )
    gold_norm = float(e["row_gold"].norm())
    tensor_budget = 2 * e["ref"] + TENSOR_BUDGET * eps * gold_norm / e["rows"] ** 0.5 + noise * over.numel() ** 0.5
    assert e["got"] <= tensor_budget, (
        f"{name}: error {float(e['got']):.4e} > 2 x reference {float(e['ref']):.4e} + {TENSOR_BUDGET} eps x "
        f"|golden| {gold_norm:.3e} / sqrt({e['rows']} rows) (Frobenius; "
        f"{float(e['got']) / max(float(e['ref']), 1e-300):.2f} x the reference)"
    )


def assert_sink_three_way(got, ref, gold, dsink_atol):
    """Sink attention results ``(out, lse, (dq, dk, dv, dsink))``: the candidate ``got`` and the reference ``ref``
    (both in the test dtype) against float64 ``gold``.

    out, dq, dk, dv by :func:`assert_three_way`; lse within twice the reference's largest error + 1e-5;
    dsink, element by element, within twice the reference's error + ``eps |gold| + dsink_atol``.

    ``ref``'s out and lse come from the reference's forward; its gradients from the reference's backward
    (and the same sink merge) run on the *candidate's* forward outputs, not on its own. Every gradient
    depends on the forward's low-precision ``out``: through ``delta = rowsum(dO * O) - dlse`` (on a row
    with few keys dq gains ``scale * (dO . error of O) * sum_j p_j k_j``, whatever the row's size) and,
    for dsink, through the merge's ``sum_rows w (1 - w) dout . out``, a sum of every row's rounding. A
    flash-attention forward rounds P before ``P @ V``, so its ``out`` carries about twice the error of the
    reference's (float32 P, one rounding), which the rule for ``out`` allows; given its own ``out``, the
    reference's gradients would not carry that error and the rule would charge it to the candidate's
    backward (measured: dq rows at 5x the reference's error, dsink at 2.6x, with correct kernels).
    """
    (out, lse, grads), (ref_out, ref_lse, ref_grads), (gold_out, gold_lse, gold_grads) = got, ref, gold
    assert_three_way("out", out, ref_out, gold_out)
    err, err_ref = (lse.double() - gold_lse).abs().max(), (ref_lse.double() - gold_lse).abs().max()
    assert err <= 2 * err_ref + 1e-5, f"lse: {float(err):.3e} vs reference {float(err_ref):.3e}"
    for name, g, r, gd in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3], gold_grads[:3]):
        assert_three_way(name, g, r, gd)
    eps = torch.finfo(grads[0].dtype).eps
    err, err_ref = (grads[3].double() - gold_grads[3]).abs(), (ref_grads[3].double() - gold_grads[3]).abs()
    assert (err <= 2 * err_ref + eps * gold_grads[3].abs() + dsink_atol).all(), f"dsink {err} vs reference {err_ref}"


def packed_document_rows(kind, Tq, Tk, rng):
    """Slices ``(qs, qe, ks, ke, type)`` of packed documents, the masks whose query blocks hold several
    short slices side by side (docs/design.md, "Merged tiles"):

    - ``tiny``: causal documents of 1 to 40 tokens (queries and keys the same ranges);
    - ``mixed``: documents of 1 to 150 tokens, each of a random type;
    - ``cross``: as many query documents as key documents, lengths drawn apart (FULL or CAUSAL);
    - ``gapped``: tiny documents whose keys skip their first token now and then (keys no slice covers);
    - ``holes``: tiny documents, every fifth left out (rows and keys no slice covers).
    """

    def cuts(T, lo, hi):
        b = [0]
        while b[-1] < T:
            b.append(min(T, b[-1] + rng.randint(lo, hi)))
        return b

    rows = []
    if kind == "cross":
        n = max(2, Tq // 60)
        qb = sorted(rng.sample(range(1, Tq), n - 1))
        kb = sorted(rng.sample(range(1, Tk), n - 1))
        qb, kb = [0] + qb + [Tq], [0] + kb + [Tk]
        for i in range(n):
            rows.append((qb[i], qb[i + 1], kb[i], kb[i + 1], rng.choice([0, 1])))
        return rows
    b = cuts(min(Tq, Tk), 1, 150 if kind == "mixed" else 40)
    for i in range(len(b) - 1):
        qs, qe = b[i], b[i + 1]
        if kind == "holes" and i % 5 == 4:
            continue
        ks = qs + 1 if (kind == "gapped" and qe - qs > 1 and rng.random() < 0.3) else qs
        mtype = rng.randrange(4) if kind == "mixed" else 1
        rows.append((qs, qe, ks, qe, mtype))
    return rows


def heads_padded_view(t):
    """``t`` ``(T, H, X)``'s values in a view whose rows pad each head by 64 columns: the heads are no longer
    side by side in a row (the Hopper kernels then take per-head descriptors)."""
    wide = torch.zeros(t.shape[0], t.shape[1], t.shape[2] + 64, dtype=t.dtype, device=t.device)
    wide[..., : t.shape[2]] = t
    return wide[..., : t.shape[2]]


def heaviest_block_document(docs, T, key_major=False, block=128):
    """For a mask of causal documents ``docs`` (``(start, end)`` pairs tiling ``[0, T)``, queries and keys
    alike): the ``(start, end)`` of the document where the heaviest block of ``block`` rows (or keys, with
    ``key_major``) starts, blocks weighed by their covered cells from the causal rule (row ``i`` of
    ``[a, e)`` sees ``i - a + 1`` keys; key ``j`` is seen by ``e - j`` rows), the first of equals."""
    weight = torch.zeros(-(-T // block) * block, dtype=torch.int64)
    for a, e in docs:
        idx = torch.arange(a, e)
        weight[a:e] = (e - idx) if key_major else (idx - a + 1)
    # argmax returns the first of equal maxima
    start = int(torch.argmax(weight.view(-1, block).sum(1))) * block
    return next((a, e) for a, e in docs if a <= start < e)


def causal_documents(lengths):
    """``(q_ranges, k_ranges, mask_types)`` and the ``(start, end)`` list of causal documents of ``lengths``,
    side by side from token 0."""
    docs, a = [], 0
    for n in lengths:
        docs.append((a, a + n))
        a += n
    r = torch.tensor(docs, dtype=torch.int32).reshape(-1, 2)
    return (r, r.clone(), torch.full((len(docs),), CAUSAL, dtype=torch.int32)), docs
