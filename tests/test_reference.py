"""The reference against a dense float64 softmax built from the mask's cover counts.

The reference (``flashrange.reference``) is the oracle for every kernel test,
so it is checked here against the plain definition of docs/design.md §2
(``tests/golden.py``): in float64 to ~1e-10, forward and backward (against
``torch.autograd`` on the dense formula), and in float32 / bfloat16 by the
three-way rule (its error at most twice that of the dense formula run in the
same precision). Masks cover overlapping q ranges, cells covered twice,
empty slices, slices of length 1, ranges at the edges, rows no slice covers,
GQA/MQA, softcap, ``Dv != D`` and a gradient through ``lse``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from flashrange import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, RangeMask
from flashrange.reference import range_attention_backward, range_attention_forward
from golden import dense_attention, dense_counts, max_err

F64_TOL = 1e-10


def _random_mask(Tq, Tk, n_slices, seed, uncovered_rows=0):
    """All four types, random (overlapping) rectangles, plus edge, length-1 and empty slices.

    The last ``uncovered_rows`` query rows are left uncovered.
    """
    rng = random.Random(seed)
    tq = Tq - uncovered_rows
    rows = []
    for s in range(n_slices):
        qs = rng.randrange(0, tq)
        qe = rng.randint(qs + 1, tq)
        ks = rng.randrange(0, Tk)
        ke = rng.randint(ks + 1, Tk)
        rows.append(((qs, qe), (ks, ke), (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL)[s % 4]))
    rows.append(((tq - 1, tq), (Tk - 1, Tk), FULL))  # length 1, bottom-right edge
    rows.append(((0, 1), (0, Tk), INV_CAUSAL))  # first row, whole key range
    rows.append(((0, tq), (Tk - 1, Tk), CAUSAL))  # last key column
    rows.append(((0, 0), (0, 0), FULL))  # padding
    rows.append(((tq, tq), (0, Tk), CAUSAL))  # empty: no rows
    rng.shuffle(rows)
    return RangeMask([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


# (Tq, Tk, Hq, Hkv, D, Dv, n_slices, uncovered_rows, softcap)
CASES = [
    pytest.param(1, 1, 1, 1, 8, 8, 1, 0, 0.0, id="T1"),
    pytest.param(17, 17, 2, 2, 16, 16, 5, 0, 0.0, id="T17-mha"),
    pytest.param(17, 29, 4, 2, 16, 8, 6, 3, 0.0, id="Tq17-Tk29-gqa2-Dv8-uncovered3"),
    pytest.param(31, 13, 4, 1, 8, 24, 7, 0, 5.0, id="Tq31-Tk13-mqa-Dv24-softcap"),
    pytest.param(23, 37, 8, 2, 16, 16, 9, 5, 2.0, id="Tq23-Tk37-gqa4-softcap-uncovered5"),
    pytest.param(63, 45, 3, 1, 32, 16, 12, 1, 0.0, id="Tq63-Tk45-mqa3-uncovered1"),
]


def _inputs(Tq, Tk, Hq, Hkv, D, Dv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, Hq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(Tk, Hkv, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(Tk, Hkv, Dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


@pytest.mark.parametrize("Tq, Tk, Hq, Hkv, D, Dv, n_slices, uncovered, softcap", CASES)
def test_forward_float64_matches_dense(Tq, Tk, Hq, Hkv, D, Dv, n_slices, uncovered, softcap):
    mask = _random_mask(Tq, Tk, n_slices, seed=Tq * 131 + Tk, uncovered_rows=uncovered)
    q, k, v = _inputs(Tq, Tk, Hq, Hkv, D, Dv, seed=1)
    out, lse = range_attention_forward(q, k, v, *mask.tensors(), softcap=softcap)
    gold_out, gold_lse = dense_attention(q, k, v, dense_counts(*mask.tensors(), Tq, Tk), softcap=softcap)
    assert out.dtype == lse.dtype == torch.float64 and lse.shape == (Tq, Hq)  # README: float64 in, float64 lse
    assert max_err(out, gold_out) < F64_TOL
    assert max_err(lse, gold_lse) < F64_TOL
    assert torch.equal(torch.isinf(lse), torch.isinf(gold_lse))


@pytest.mark.parametrize("Tq, Tk, Hq, Hkv, D, Dv, n_slices, uncovered, softcap", CASES)
def test_backward_float64_matches_autograd(Tq, Tk, Hq, Hkv, D, Dv, n_slices, uncovered, softcap):
    mask = _random_mask(Tq, Tk, n_slices, seed=Tq * 131 + Tk, uncovered_rows=uncovered)
    q, k, v = _inputs(Tq, Tk, Hq, Hkv, D, Dv, seed=2)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(Tq, Hq, Dv, generator=g, dtype=torch.float64)
    dlse = torch.randn(Tq, Hq, generator=g, dtype=torch.float64)
    out, lse = range_attention_forward(q, k, v, *mask.tensors(), softcap=softcap)
    dq, dk, dv = range_attention_backward(dout, q, k, v, out, lse, *mask.tensors(), softcap=softcap, dlse=dlse)

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    gold_out, gold_lse = dense_attention(qg, kg, vg, dense_counts(*mask.tensors(), Tq, Tk), softcap=softcap)
    covered = torch.isfinite(gold_lse)
    loss = (gold_out * dout).sum() + (torch.where(covered, gold_lse, 0.0) * dlse).sum()
    gq, gk, gv = torch.autograd.grad(loss, (qg, kg, vg))
    assert max_err(dq, gq) < F64_TOL
    assert max_err(dk, gk) < F64_TOL
    assert max_err(dv, gv) < F64_TOL


def _three_way(candidate, baseline, golden, dtype):
    """Candidate error <= 2x the baseline's (plus a floor of a few ulps for exact cases)."""
    floor = 4 * torch.finfo(dtype).eps
    err_c, err_b = max_err(candidate, golden), max_err(baseline, golden)
    assert err_c <= 2 * err_b + floor, f"error {err_c:.3g} vs same-precision dense formula {err_b:.3g}"


def _dense_low_precision(q, k, v, counts, softcap):
    """The dense formula evaluated in the inputs' own precision (the baseline of the three-way rule)."""
    Tq, Hq, D = q.shape
    G = Hq // k.shape[1]
    s = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(G, 1)) * (1.0 / math.sqrt(D))
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    logits = s + torch.log(counts.to(q.dtype))
    m = logits.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    p = torch.exp(logits - m)
    l = p.sum(-1, keepdim=True)
    out = torch.einsum("hij,jhd->ihd", p / torch.where(l > 0, l, torch.ones_like(l)), v.repeat_interleave(G, 1))
    return out


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("Tq, Tk, Hq, Hkv, D, Dv, n_slices, uncovered, softcap", CASES[1:4])
def test_low_precision_three_way(dtype, Tq, Tk, Hq, Hkv, D, Dv, n_slices, uncovered, softcap):
    mask = _random_mask(Tq, Tk, n_slices, seed=Tq * 7 + Tk, uncovered_rows=uncovered)
    q, k, v = _inputs(Tq, Tk, Hq, Hkv, D, Dv, seed=4, dtype=dtype)
    counts = dense_counts(*mask.tensors(), Tq, Tk)
    out, lse = range_attention_forward(q, k, v, *mask.tensors(), softcap=softcap)
    assert out.dtype == dtype and lse.dtype == torch.float32
    gold_out, gold_lse = dense_attention(q, k, v, counts, softcap=softcap)
    _three_way(out, _dense_low_precision(q, k, v, counts, softcap), gold_out, dtype)
    # lse is float32 whatever the input: compare with the float32 dense lse.
    base_lse = dense_attention(q.float(), k.float(), v.float(), counts, softcap=softcap)[1].float()
    _three_way(lse, base_lse, gold_lse, torch.float32)


def test_uncovered_rows_zero_out_minus_inf_lse_zero_grad():
    Tq, Tk = 11, 9
    # Rows 0-2 and 8-10 are covered by nothing; row 5 sees only a CAUSAL slice's empty top.
    mask = RangeMask([[3, 8], [5, 8]], [[0, 9], [0, 2]], [FULL, CAUSAL])
    q, k, v = _inputs(Tq, Tk, 4, 2, 16, 8, seed=5)
    out, lse = range_attention_forward(q, k, v, *mask.tensors())
    dout = torch.ones(Tq, 4, 8, dtype=torch.float64)
    dlse = torch.ones(Tq, 4, dtype=torch.float64)
    dq, dk, dv = range_attention_backward(dout, q, k, v, out, lse, *mask.tensors(), dlse=dlse)
    for t in (out, dq, dk, dv):
        assert not torch.isnan(t).any()
    assert not torch.isnan(lse).any()
    uncovered = torch.tensor([0, 1, 2, 8, 9, 10])
    assert torch.equal(out[uncovered], torch.zeros_like(out[uncovered]))
    assert bool((lse[uncovered] == float("-inf")).all())
    assert torch.equal(dq[uncovered], torch.zeros_like(dq[uncovered]))
    assert bool(torch.isfinite(lse[3:8]).all())


def test_no_slice_at_all():
    q, k, v = _inputs(5, 7, 2, 1, 8, 8, seed=6)
    mask = RangeMask([[0, 0]], [[0, 0]], [FULL])
    out, lse = range_attention_forward(q, k, v, *mask.tensors())
    dq, dk, dv = range_attention_backward(torch.ones_like(out), q, k, v, out, lse, *mask.tensors())
    assert torch.equal(out, torch.zeros_like(out))
    assert bool((lse == float("-inf")).all())
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert torch.equal(g, torch.zeros_like(t))


def test_cell_covered_twice_counts_twice():
    """The same FULL slice twice is softmax over every key duplicated: same out, lse + log 2."""
    Tq, Tk = 13, 7
    q, k, v = _inputs(Tq, Tk, 2, 2, 16, 16, seed=7)
    once = RangeMask([[0, Tq]], [[0, Tk]], [FULL])
    twice = RangeMask([[0, Tq], [0, Tq]], [[0, Tk], [0, Tk]], [FULL, FULL])
    out1, lse1 = range_attention_forward(q, k, v, *once.tensors())
    out2, lse2 = range_attention_forward(q, k, v, *twice.tensors())
    assert max_err(out1, out2) < F64_TOL
    assert max_err(lse1 + math.log(2.0), lse2) < F64_TOL
    # Half-overlap: keys [0, 4) covered twice weigh double, against the dense golden.
    half = RangeMask([[0, Tq], [0, Tq]], [[0, 4], [0, Tk]], [FULL, FULL])
    assert int(dense_counts(*half.tensors(), Tq, Tk).max()) == 2
    out3, _ = range_attention_forward(q, k, v, *half.tensors())
    gold, _ = dense_attention(q, k, v, dense_counts(*half.tensors(), Tq, Tk))
    assert max_err(out3, gold) < F64_TOL


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
def test_empty_slices_and_permutation_change_no_bit(dtype):
    Tq, Tk = 29, 19
    base = _random_mask(Tq, Tk, 6, seed=11, uncovered_rows=2)
    q, k, v = _inputs(Tq, Tk, 4, 2, 16, 8, seed=8, dtype=dtype)
    g = torch.Generator().manual_seed(9)
    dout = torch.randn(Tq, 4, 8, generator=g).to(dtype)
    qr, kr, mt = base.tensors()
    perm = torch.randperm(qr.shape[0], generator=g)
    empties = torch.tensor([[0, 0], [7, 7], [Tq, Tq]], dtype=torch.int32)
    variants = [
        RangeMask(qr[perm], kr[perm], mt[perm]),
        base.pad_to(base.num_slices + 5),
        RangeMask(torch.cat([empties, qr]), torch.cat([torch.tensor([[0, 0], [0, Tk], [3, 9]], dtype=torch.int32), kr]),
                  torch.cat([torch.tensor([FULL, CAUSAL, BI_CAUSAL], dtype=torch.int32), mt])),
    ]

    def run(mask):
        out, lse = range_attention_forward(q, k, v, *mask.tensors())
        return (out, lse) + range_attention_backward(dout, q, k, v, out, lse, *mask.tensors())

    ref = run(base)
    for mask in variants:
        for a, b in zip(ref, run(mask)):
            assert torch.equal(a, b)


def test_softcap_and_scale_change_result_as_defined():
    Tq, Tk = 9, 11
    mask = RangeMask.causal(Tq, Tk)
    q, k, v = _inputs(Tq, Tk, 2, 1, 8, 8, seed=10)
    q = q * 4  # large scores, so the cap matters
    for scale, cap in ((None, 3.0), (0.37, 0.0), (0.37, 1.5)):
        out, lse = range_attention_forward(q, k, v, *mask.tensors(), softmax_scale=scale, softcap=cap)
        gold_out, gold_lse = dense_attention(q, k, v, dense_counts(*mask.tensors(), Tq, Tk), softmax_scale=scale, softcap=cap)
        assert max_err(out, gold_out) < F64_TOL and max_err(lse, gold_lse) < F64_TOL
    capped, _ = range_attention_forward(q, k, v, *mask.tensors(), softcap=1.0)
    plain, _ = range_attention_forward(q, k, v, *mask.tensors())
    assert max_err(capped, plain) > 1e-3


# ----------------------------------------------------------------------------- the golden mask itself


def _m(rows):
    return torch.tensor(rows, dtype=torch.int32)


# One slice each, placed away from the tensor edges: (q_range, k_range, type, Tq, Tk, expected cells of the
# rectangle written out by hand from docs/design.md §2).
PICTURES = [
    pytest.param((1, 4), (2, 4), BI_CAUSAL, 5, 6, _m([[0, 0], [0, 0], [0, 0]]), id="bi_causal-Lq3>Lk2-empty"),
    pytest.param((1, 3), (1, 5), BI_CAUSAL, 4, 6, _m([[1, 1, 1, 0], [0, 1, 1, 1]]), id="bi_causal-Lq2<Lk4-band"),
    pytest.param((2, 4), (1, 5), INV_CAUSAL, 5, 6, _m([[1, 1, 1, 1], [0, 1, 1, 1]]), id="inv_causal-Lq2<Lk4"),
    pytest.param((0, 4), (3, 5), INV_CAUSAL, 4, 5, _m([[1, 1], [0, 1], [0, 0], [0, 0]]), id="inv_causal-Lq4>Lk2"),
    pytest.param((1, 5), (0, 2), CAUSAL, 6, 3, _m([[0, 0], [0, 0], [1, 0], [1, 1]]), id="causal-Lq4>Lk2-top-empty"),
    pytest.param((0, 2), (1, 5), CAUSAL, 3, 6, _m([[1, 1, 1, 0], [1, 1, 1, 1]]), id="causal-Lq2<Lk4"),
    pytest.param((0, 3), (0, 2), FULL, 3, 2, _m([[1, 1], [1, 1], [1, 1]]), id="full"),
]


@pytest.mark.parametrize("q_range, k_range, mtype, Tq, Tk, cells", PICTURES)
def test_dense_counts_pictures(q_range, k_range, mtype, Tq, Tk, cells):
    """The golden mask on hand-drawn pictures: every type with Lq != Lk both ways, offset rectangles."""
    counts = dense_counts([q_range], [k_range], [mtype], Tq, Tk)
    want = torch.zeros(Tq, Tk, dtype=torch.int32)
    want[q_range[0]:q_range[1], k_range[0]:k_range[1]] = cells
    assert torch.equal(counts, want), f"\n{counts}\n!=\n{want}"


def test_dense_counts_clamps_drops_and_counts_twice():
    Tq, Tk = 4, 5
    rows = [((-3, 2), (0, 9), CAUSAL), ((0, 0), (0, 5), FULL), ((3, 1), (0, 5), FULL), ((0, 4), (0, 5), 7),
            ((2, 4), (1, 3), FULL), ((2, 4), (1, 3), FULL)]
    counts = dense_counts([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], Tq, Tk)
    want = torch.zeros(Tq, Tk, dtype=torch.int32)
    # (-3, 2) x (0, 9) clamps to [0, 2) x [0, 5): Lq = 2, Lk = 5, j' <= i' + 3.
    want[0, 0:4] = 1
    want[1, 0:5] = 1
    want[2:4, 1:3] = 2  # the same FULL slice twice; empty, reversed and unknown-type slices add nothing
    assert torch.equal(counts, want), f"\n{counts}"


@pytest.mark.parametrize("q_range, k_range, mtype, Tq, Tk, cells", PICTURES)
def test_reference_on_every_geometry(q_range, k_range, mtype, Tq, Tk, cells):
    """The reference against the golden on the pictures above, with a second slice overlapping, fp64, fwd + bwd."""
    mask = RangeMask([q_range, (0, Tq)], [k_range, (0, 1)], [mtype, FULL])
    q, k, v = _inputs(Tq, Tk, 2, 1, 8, 4, seed=Tq + Tk + mtype)
    out, lse = range_attention_forward(q, k, v, *mask.tensors())
    counts = dense_counts(*mask.tensors(), Tq, Tk)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    gold_out, gold_lse = dense_attention(qg, kg, vg, counts)
    assert max_err(out, gold_out) < F64_TOL and max_err(lse, gold_lse) < F64_TOL
    dout = torch.randn(Tq, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = range_attention_backward(dout, q, k, v, out, lse, *mask.tensors())
    gold = torch.autograd.grad((gold_out * dout).sum(), (qg, kg, vg))
    for g, e in zip(grads, gold):
        assert max_err(g, e) < F64_TOL


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(3)])
def test_library_dense_helpers_match_the_golden(seed):
    """``RangeMask.coverage`` / ``to_dense`` and ``reference.coverage_counts`` against the independent golden,
    on garbage masks (out of range, reversed, empty, unknown types, overlaps)."""
    from flashrange.reference import coverage_counts

    rng = random.Random(seed)
    for _ in range(40):
        Tq, Tk = rng.randint(1, 12), rng.randint(1, 12)
        n = rng.randint(0, 6)
        qr = [[rng.randint(-3, Tq + 3), rng.randint(-3, Tq + 3)] for _ in range(n)]
        kr = [[rng.randint(-3, Tk + 3), rng.randint(-3, Tk + 3)] for _ in range(n)]
        mt = [rng.randint(-1, 4) for _ in range(n)]
        want = dense_counts(qr, kr, mt, Tq, Tk)
        m = RangeMask(_m(qr).reshape(-1, 2), _m(kr).reshape(-1, 2), _m(mt).reshape(-1))
        assert torch.equal(coverage_counts(*m.tensors(), Tq, Tk), want), (qr, kr, mt)
        assert torch.equal(m.coverage(Tq, Tk).to(torch.int32), want), (qr, kr, mt)
        assert torch.equal(m.to_dense(Tq, Tk), want > 0), (qr, kr, mt)
