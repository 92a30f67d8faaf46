"""``RangeMask``: every builder against a hand-written dense definition, and the mask tools.

Each builder is checked at odd sizes for: the exact set of cells (against
the definition written as index inequalities), no cell covered twice (dense
and with the dense-free ``overlaps``), ``area()`` equal to the dense count,
no empty slice left in the list, int32 tensors. Then padding / bucketing,
``area`` at 128k tokens (closed form against arithmetic), the dense-free
overlap finder against brute force, pictures, and the device-side window
decomposition (static slice count, runs on ``meta`` tensors, i.e. never
reads values on the host).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from flashrange import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, RangeMask, bucket_capacity
from flashrange.picture import mask_image
from flashrange.window import window_slices
from golden import dense_counts, fa3_window_counts


def _grid(Tq, Tk):
    return torch.arange(Tq).unsqueeze(1), torch.arange(Tk).unsqueeze(0)


def _check_builder(mask, expected):
    """``mask`` covers exactly the cells of bool ``expected``, once each, with no empty slice."""
    Tq, Tk = expected.shape
    for t in mask.tensors():
        assert t.dtype == torch.int32
    cov = dense_counts(*mask.tensors(), Tq, Tk)
    assert torch.equal(cov > 0, expected), f"{mask}\ncovered:\n{cov}\nexpected:\n{expected.int()}"
    assert cov.numel() == 0 or int(cov.max()) <= 1, f"{mask} covers a cell twice"
    assert mask.overlaps() is None
    mask.validate(Tq, Tk, strict=True)
    assert mask.area() == int(expected.sum())
    qr, kr, _ = mask.tensors()
    assert bool(((qr[:, 1] > qr[:, 0]) & (kr[:, 1] > kr[:, 0])).all()), "builders drop empty slices"


@pytest.mark.parametrize("Tq, Tk", [pytest.param(1, 1, id="1x1"), pytest.param(7, 13, id="7x13"),
                                    pytest.param(13, 7, id="13x7"), pytest.param(0, 5, id="0x5")])
def test_full(Tq, Tk):
    _check_builder(RangeMask.full(Tq, Tk), torch.ones(Tq, Tk, dtype=torch.bool))


@pytest.mark.parametrize("Tq, Tk", [pytest.param(1, 1, id="1x1"), pytest.param(9, 9, id="9x9"),
                                    pytest.param(7, 13, id="7x13"), pytest.param(13, 7, id="13x7-top-rows-empty")])
def test_causal_bottom_right(Tq, Tk):
    i, j = _grid(Tq, Tk)
    _check_builder(RangeMask.causal(Tq, Tk), j <= i + Tk - Tq)


def _varlen_dense(cu_q, cu_k, causal, window_size):
    m = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        m[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = fa3_window_counts(lq, lk, causal, window_size) > 0
    return m


WINDOWS = [
    pytest.param(False, (-1, -1), id="full"),
    pytest.param(True, (-1, -1), id="causal"),
    pytest.param(True, (3, -1), id="causal-left3"),
    pytest.param(False, (2, 1), id="left2-right1"),
    pytest.param(False, (0, 0), id="diagonal"),
    pytest.param(False, (-1, 2), id="right2-only"),
    pytest.param(False, (4, -1), id="left4-only"),
    pytest.param(False, (50, 50), id="wider-than-docs"),
]


@pytest.mark.parametrize("causal, window_size", WINDOWS)
@pytest.mark.parametrize(
    "cu_q, cu_k",
    [
        pytest.param([0, 5, 12, 13], None, id="self-3docs"),
        pytest.param([0, 5, 12, 13], [0, 9, 11, 20], id="Lq!=Lk"),
        pytest.param([0, 0, 7, 7, 10], [0, 3, 3, 8, 15], id="empty-docs"),
    ],
)
def test_varlen_matches_fa3_definition(cu_q, cu_k, causal, window_size):
    mask = RangeMask.varlen(cu_q, cu_k, causal=causal, window_size=window_size)
    _check_builder(mask, _varlen_dense(cu_q, cu_q if cu_k is None else cu_k, causal, window_size))


def test_varlen_random_windows_match_fa3_definition():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 4)
        cu_q = [0] + list(itertools.accumulate(rng.randint(0, 11) for _ in range(n)))
        cu_k = [0] + list(itertools.accumulate(rng.randint(0, 11) for _ in range(n)))
        causal = rng.random() < 0.3
        ws = (rng.choice([-1, 0, 1, 2, 5, 30]), rng.choice([-1, 0, 1, 3, 30]))
        mask = RangeMask.varlen(torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k), causal=causal, window_size=ws)
        assert mask.num_slices <= 3 * n
        _check_builder(mask, _varlen_dense(cu_q, cu_k, causal, ws))


@pytest.mark.parametrize("T, window", [pytest.param(1, 1, id="T1-w1"), pytest.param(17, 5, id="T17-w5"),
                                       pytest.param(13, 1, id="T13-w1"), pytest.param(9, 40, id="T9-w40")])
@pytest.mark.parametrize("causal", [pytest.param(True, id="causal"), pytest.param(False, id="symmetric")])
def test_sliding_window(T, window, causal):
    i, j = _grid(T, T)
    expected = (j > i - window) & (j <= i) if causal else (j > i - window) & (j < i + window)
    mask = RangeMask.sliding_window(T, window, causal=causal)
    _check_builder(mask, expected)
    assert mask.num_slices <= 3
    # The same as FA3's window_size=(window - 1, 0) / (window - 1, window - 1).
    ws = (window - 1, 0) if causal else (window - 1, window - 1)
    assert torch.equal(expected, fa3_window_counts(T, T, False, ws) > 0)


@pytest.mark.parametrize("T, p", [pytest.param(11, 4, id="T11-p4"), pytest.param(7, 0, id="T7-p0"),
                                  pytest.param(7, 7, id="T7-p7"), pytest.param(1, 1, id="T1-p1")])
def test_prefix_lm(T, p):
    i, j = _grid(T, T)
    _check_builder(RangeMask.prefix_lm(T, p), (j < p) | (j <= i))


@pytest.mark.parametrize("T, bs", [pytest.param(13, 4, id="T13-b4"), pytest.param(9, 1, id="T9-b1"),
                                   pytest.param(5, 8, id="T5-b8")])
def test_block_causal(T, bs):
    i, j = _grid(T, T)
    _check_builder(RangeMask.block_causal(T, bs), j // bs <= i // bs)


@pytest.mark.parametrize("T, cs", [pytest.param(13, 4, id="T13-c4"), pytest.param(9, 1, id="T9-c1"),
                                   pytest.param(5, 8, id="T5-c8")])
def test_chunked_causal(T, cs):
    i, j = _grid(T, T)
    _check_builder(RangeMask.chunked_causal(T, cs), (j // cs == i // cs) & (j <= i))


@pytest.mark.parametrize("qlen, lens", [pytest.param(5, [3, 1, 4], id="q5-a3-1-4"), pytest.param(1, [1], id="q1-a1"),
                                        pytest.param(4, [], id="no-answer"), pytest.param(3, [0, 2], id="empty-answer")])
@pytest.mark.parametrize("causal", [pytest.param(True, id="causal"), pytest.param(False, id="bidirectional")])
def test_shared_question(qlen, lens, causal):
    seg = torch.tensor([-1] * qlen + [a for a, n in enumerate(lens) for _ in range(n)])
    T = seg.numel()
    i, j = _grid(T, T)
    si, sj = seg.unsqueeze(1), seg.unsqueeze(0)
    order = (j <= i) if causal else torch.ones(T, T, dtype=torch.bool)
    expected = ((sj == -1) & (si != -1)) | ((si == sj) & order)
    _check_builder(RangeMask.shared_question(qlen, lens, causal=causal), expected)


@pytest.mark.parametrize(
    "blocks, bs, Tq, Tk",
    [
        pytest.param([(0, 0), (1, 0), (1, 1), (2, 2)], 3, 8, 8, id="lower-blocks-ragged-edge"),
        pytest.param([(0, 1), (0, 2), (1, 1), (1, 2), (3, 0), (0, 1)], 2, 7, 5, id="merge-and-duplicate"),
        pytest.param([], 4, 5, 5, id="empty"),
        pytest.param([(2, 0)], 5, 11, 3, id="Tq11-Tk3"),
    ],
)
def test_block_sparse(blocks, bs, Tq, Tk):
    expected = torch.zeros(Tq, Tk, dtype=torch.bool)
    for b, c in blocks:
        expected[b * bs:(b + 1) * bs, c * bs:(c + 1) * bs] = True
    _check_builder(RangeMask.block_sparse(blocks, bs, Tq, Tk), expected)


def test_block_sparse_merges_adjacent_blocks():
    every = [(b, c) for b in range(5) for c in range(4)]
    assert RangeMask.block_sparse(every, 3, 14, 11).num_slices == 1
    band = [(b, c) for b in range(6) for c in (1, 2)] + [(b, 4) for b in range(6)]
    assert RangeMask.block_sparse(band, 2, 12, 10).num_slices == 2


def test_constructor_converts_lists_and_keeps_tensors():
    m = RangeMask([[0, 3], [3, 5]], [[0, 3], [0, 5]], [CAUSAL, FULL])
    assert all(t.dtype == torch.int32 for t in m.tensors())
    assert m.num_slices == len(m) == 2
    qr = torch.tensor([[1, 4]], dtype=torch.int32)
    kr = torch.tensor([[0, 2]], dtype=torch.int32)
    m2 = RangeMask(qr, kr)
    assert m2.q_ranges is qr and m2.k_ranges is kr  # no copy: in-place updates stay visible
    assert m2.mask_types.tolist() == [FULL]
    empty = RangeMask([], [], [])
    assert empty.num_slices == 0 and empty.area() == 0 and empty.q_ranges.shape == (0, 2)
    assert "CAUSAL" in repr(m) and "2 slices" in repr(m)
    assert RangeMask.causal(3, device="meta").device.type == "meta"
    assert m.to("cpu") is m
    moved = m.to("meta")
    assert moved.device.type == "meta" and moved.num_slices == 2


def test_pad_to_and_bucketed():
    m = RangeMask.varlen([0, 3, 8, 9], causal=True)
    n = m.num_slices
    padded = m.pad_to(n + 4)
    assert padded.num_slices == n + 4
    assert padded.q_ranges[n:].tolist() == [[0, 0]] * 4 and padded.k_ranges[n:].tolist() == [[0, 0]] * 4
    assert padded.mask_types[n:].tolist() == [FULL] * 4
    assert torch.equal(dense_counts(*padded.tensors(), 9, 9), dense_counts(*m.tensors(), 9, 9)) and padded.area() == m.area()
    assert m.pad_to(n) is m
    assert m.bucketed().num_slices == bucket_capacity(n) == 4
    assert m.bucketed(min_capacity=9).num_slices == 16
    assert RangeMask.full(4).bucketed().num_slices == 1


@pytest.mark.parametrize("n, cap", [pytest.param(0, 1, id="0"), pytest.param(1, 1, id="1"), pytest.param(2, 2, id="2"),
                                    pytest.param(3, 4, id="3"), pytest.param(17, 32, id="17"),
                                    pytest.param(1024, 1024, id="1024"), pytest.param(1025, 2048, id="1025")])
def test_bucket_capacity(n, cap):
    assert bucket_capacity(n) == cap


def test_area_at_128k_tokens_closed_form():
    T = 131072
    assert RangeMask.causal(T).area() == T * (T + 1) // 2
    w, t = 2048, T - 1
    assert RangeMask.sliding_window(t, w).area() == w * (w + 1) // 2 + (t - w) * w
    lens = [1000 + 7 * d for d in range(128)]
    cu = [0] + list(itertools.accumulate(lens))
    assert RangeMask.varlen(cu, causal=True).area() == sum(n * (n + 1) // 2 for n in lens)
    # A cell covered twice counts twice; unknown types count nothing, like the kernels.
    assert RangeMask([[0, T], [0, T]], [[0, T], [0, 5]], [FULL, FULL]).area() == T * T + 5 * T
    assert RangeMask([[0, T]], [[0, T]], [7]).area() == 0


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(3)])
def test_area_and_overlaps_against_dense_on_random_masks(seed):
    rng = random.Random(seed)
    for _ in range(80):
        Tq, Tk = rng.randint(1, 13), rng.randint(1, 13)
        rows = []
        for _ in range(rng.randint(0, 4)):
            a, c = rng.randint(0, Tq), rng.randint(0, Tk)
            rows.append(([a, rng.randint(a, Tq)], [c, rng.randint(c, Tk)], rng.randint(0, 3)))
        m = RangeMask([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        cov = dense_counts(*m.tensors(), Tq, Tk)
        assert m.area() == int(cov.sum())
        single = [dense_counts([r[0]], [r[1]], [r[2]], Tq, Tk) > 0 for r in rows]
        brute = next(((s, t) for s, t in itertools.combinations(range(len(rows)), 2)
                      if bool((single[s] & single[t]).any())), None)
        found = m.overlaps()
        assert (found is None) == (brute is None)
        if found is not None:
            s, t, (i, j) = found
            assert (s, t) == brute and bool(single[s][i, j]) and bool(single[t][i, j])


def test_overlaps_found_without_dense_matrix_at_128k():
    T = 131072
    m = RangeMask([[0, T], [T - 10, T]], [[0, T], [T - 3, T]], [CAUSAL, FULL])
    s, t, (i, j) = m.overlaps()
    assert (s, t) == (0, 1) and T - 3 <= j <= i < T
    # INV_CAUSAL there keeps to j >= i + 7, strictly above the causal triangle.
    assert RangeMask([[0, T], [T - 10, T]], [[0, T], [T - 3, T]], [CAUSAL, INV_CAUSAL]).overlaps() is None
    # Touching diagonals of a window decomposition do not overlap.
    assert RangeMask.varlen([0, T - 5, T], window_size=(100, 7)).overlaps() is None


def test_to_dense_and_coverage_default_sizes():
    m = RangeMask([[2, 4]], [[1, 6]], [BI_CAUSAL])
    assert m.to_dense().shape == (4, 6)
    assert m.coverage(5, 7).shape == (5, 7)
    assert m.to_dense(5, 7).dtype == torch.bool


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_small_and_large(tmp_path):
    pytest.importorskip("matplotlib")
    small = RangeMask.shared_question(7, [5, 3, 9])
    p = small.plot(tmp_path / "small.png")
    assert _is_png(p)
    overlapping = RangeMask([[0, 9], [3, 9]], [[0, 9], [0, 4]], [CAUSAL, FULL])
    assert _is_png(overlapping.plot(tmp_path / "overlap.png", 9, 9, title="twice"))
    big = RangeMask.varlen([0, 40000, 100000, 131072], causal=True, window_size=(4096, 0))
    assert _is_png(big.plot(tmp_path / "big.png"))
    img, exact = mask_image(big, 131072, 131072)
    assert not exact and img.shape == (512, 512)
    assert float(img.min()) >= 0.0 and float(img.max()) <= 1.0 + 1e-6


def test_plot_picture_density_matches_dense_average():
    """The averaged picture of a mask too big to draw cell by cell equals the dense block mean."""
    T = 1200
    m = RangeMask.varlen([0, 500, 1200], causal=True, window_size=(150, 0))
    img, exact = mask_image(m, T, T)
    assert not exact
    dense = (dense_counts(*m.tensors(), T, T) > 0).double()
    rows = img.shape[0]
    sample = ((torch.arange(rows, dtype=torch.float64) + 0.5) * T / rows).long()
    edges = torch.round(torch.arange(img.shape[1] + 1, dtype=torch.float64) * T / img.shape[1]).long()
    expect = torch.stack([dense[sample, a:b].mean(dim=1) for a, b in zip(edges[:-1], edges[1:])], dim=1)
    assert float((img.double() - expect).abs().max()) < 1e-6


@pytest.mark.parametrize(
    "left, right, pieces",
    [
        pytest.param(-1, -1, 1, id="unbounded-1"),
        pytest.param(-1, 0, 1, id="causal-1"),
        pytest.param(-1, 2, 2, id="right-only-2"),
        pytest.param(4, -1, 2, id="left-only-2"),
        pytest.param(5, 2, 3, id="window-3"),
    ],
)
def test_window_slices_static_count_and_no_host_read(left, right, pieces):
    """Shape depends only on B and the window; ``meta`` tensors have no values, so nothing is read."""
    B = 5
    cu = torch.empty(B + 1, dtype=torch.int64, device="meta")
    qr, kr, mt = window_slices(cu[:-1], cu[1:], cu[:-1], cu[1:], left, right)
    assert qr.shape == (pieces * B, 2) and kr.shape == (pieces * B, 2) and mt.shape == (pieces * B,)
    assert qr.dtype == kr.dtype == mt.dtype == torch.int32
    # Same cells as the host builder on real values (which also drops the empties).
    cu = torch.tensor([0, 4, 4, 13, 14, 20], dtype=torch.int32)  # int32 in: no overflow of the sentinel
    qr, kr, mt = window_slices(cu[:-1], cu[1:], cu[:-1], cu[1:], left, right)
    assert qr.shape[0] == pieces * B
    empty = (qr[:, 1] <= qr[:, 0]) | (kr[:, 1] <= kr[:, 0])
    assert int(qr[empty].abs().sum() + kr[empty].abs().sum() + mt[empty].abs().sum()) == 0, "empties are [0, 0) FULL"
    dense = dense_counts(qr, kr, mt, 20, 20)
    host = dense_counts(*RangeMask.varlen(cu, window_size=(left, right)).tensors(), 20, 20)
    assert torch.equal(dense, host)
