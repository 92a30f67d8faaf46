"""Masks from other libraries: ``from_dense`` and ``from_mask_mod`` (flashrange/convert.py).

Every conversion is checked for the contract: ``to_dense`` of the result is
the input mask cell for cell, no two slices overlap, no slice is empty, the
tensors are int32. Inputs: random masks drawn as random non-overlapping
slices of all four types, hand-drawn masks, masks with several runs per row
and random noise. The slice counts of the common masks are pinned (causal is
one slice, a sliding window at most three, one per document...), the greedy
cut is checked against a brute-force minimum, and ``from_mask_mod`` is
checked against ``from_dense`` of the dense evaluation, for FlexAttention
style mask_mods, chunk sizes and ``BlockMask`` inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashrange import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, RangeMask

from_dense = RangeMask.from_dense
from_mask_mod = RangeMask.from_mask_mod


def _check(result, dense):
    """``result`` covers exactly the cells of bool ``dense``, once each, with no empty slice."""
    Tq, Tk = dense.shape
    for t in result.tensors():
        assert t.dtype == torch.int32
    cov = result.coverage(Tq, Tk)
    assert torch.equal(cov > 0, dense), f"{result}\ncovered:\n{cov}\nexpected:\n{dense.int()}"
    assert cov.numel() == 0 or int(cov.max()) <= 1, f"{result} covers a cell twice"
    assert result.overlaps() is None
    result.validate(Tq, Tk, strict=True)
    qr, kr, _ = result.tensors()
    assert bool(((qr[:, 1] > qr[:, 0]) & (kr[:, 1] > kr[:, 0])).all()), "no empty slice in a conversion"


def _round_trip(dense, **kw):
    result = from_dense(dense, **kw)
    _check(result, dense)
    return result


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def _picture(text):
    """Bool mask from rows of ``#`` (attend) and ``.`` (masked); spaces ignored."""
    rows = [r.replace(" ", "") for r in text.strip().splitlines()]
    return torch.tensor([[c == "#" for c in r] for r in rows], dtype=torch.bool).reshape(len(rows), -1)


def _grid(Tq, Tk):
    return torch.arange(Tq).unsqueeze(1), torch.arange(Tk).unsqueeze(0)


# --------------------------------------------------------------- random masks


def _random_slices(Tq, Tk, n, rng):
    """Up to ``n`` random non-overlapping non-empty slices of all four types, as a RangeMask."""
    kept = []
    for _ in range(8 * n):
        if len(kept) == n:
            break
        qs, ks = rng.randrange(Tq), rng.randrange(Tk)
        qe, ke = rng.randint(qs + 1, Tq), rng.randint(ks + 1, Tk)
        t = rng.choice((FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL))
        trial = RangeMask([r[0] for r in kept] + [[qs, qe]], [r[1] for r in kept] + [[ks, ke]],
                          [r[2] for r in kept] + [t])
        cov = trial.coverage(Tq, Tk)
        if int(cov.max()) <= 1 and int((cov > 0).sum()) > int(RangeMask(*_rows(kept)).coverage(Tq, Tk).sum()):
            kept.append(([qs, qe], [ks, ke], t))
    return RangeMask(*_rows(kept))


def _rows(kept):
    return ([r[0] for r in kept] or torch.zeros(0, 2, dtype=torch.int32),
            [r[1] for r in kept] or torch.zeros(0, 2, dtype=torch.int32),
            [r[2] for r in kept] or torch.zeros(0, dtype=torch.int32))


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(6)])
@pytest.mark.parametrize("Tq, Tk", [pytest.param(17, 17, id="17x17"), pytest.param(13, 31, id="13x31"),
                                    pytest.param(31, 9, id="31x9"), pytest.param(1, 7, id="1x7")])
def test_round_trip_random_slices(Tq, Tk, seed):
    rng = random.Random(seed * 1000 + Tq * 37 + Tk)
    for n in (1, 2, 5, 12):
        source = _random_slices(Tq, Tk, n, rng)
        _round_trip(source.to_dense(Tq, Tk))


@pytest.mark.parametrize("density", [pytest.param(0.1, id="sparse"), pytest.param(0.5, id="half"),
                                     pytest.param(0.9, id="dense")])
def test_round_trip_noise(density):
    g = torch.Generator().manual_seed(int(density * 100))
    for Tq, Tk in ((1, 1), (5, 23), (23, 5), (37, 41)):
        _round_trip(torch.rand(Tq, Tk, generator=g) < density)


# ---------------------------------------------------------------- hand-drawn

HAND_DRAWN = [
    pytest.param("""
        # # # . . . .
        # # # # . . .
        # # # # # . .
        """, [((0, 3), (0, 5), CAUSAL)], id="causal-wide"),
    pytest.param("""
        . . .
        . . .
        # . .
        # # .
        # # #
        """, [((2, 5), (0, 3), CAUSAL)], id="causal-tall-top-rows-empty"),
    pytest.param("""
        # # # # .
        . # # # .
        . . # # .
        """, [((0, 3), (0, 4), INV_CAUSAL)], id="inv-causal"),
    pytest.param("""
        . # # . . . .
        . . # # . . .
        . . . # # . .
        . . . . # # .
        """, [((0, 4), (1, 6), BI_CAUSAL)], id="band-width-2"),
    pytest.param("""
        # # # # #
        # # # # #
        """, [((0, 2), (0, 5), FULL)], id="full"),
    pytest.param("""
        . . . .
        . . . .
        . . . .
        """, [], id="empty"),
    pytest.param("""
        . . . . .
        . # # . .
        . . . . .
        . # # # .
        . . . . .
        """, [((1, 2), (1, 3), FULL), ((3, 4), (1, 4), FULL)], id="empty-rows-between"),
    pytest.param("""
        # . . . . .
        # # . . . .
        # # # . . .
        . . . # . .
        . . . # # .
        . . . . . #
        """, [((0, 3), (0, 3), CAUSAL), ((3, 5), (3, 5), CAUSAL), ((5, 6), (5, 6), FULL)], id="documents"),
    pytest.param("""
        # # . # # .
        # # . # # .
        . . # . . #
        """, [((0, 2), (0, 2), FULL), ((0, 2), (3, 5), FULL), ((2, 3), (2, 3), FULL), ((2, 3), (5, 6), FULL)],
        id="two-runs-per-row"),
]


@pytest.mark.parametrize("text, expected", HAND_DRAWN)
def test_hand_drawn(text, expected):
    dense = _picture(text)
    result = _round_trip(dense)
    got = [(tuple(q), tuple(k), t) for q, k, t in zip(*(x.tolist() for x in result.tensors()))]
    assert got == expected


def test_single_cells_and_edges():
    for Tq, Tk in ((1, 1), (1, 9), (9, 1)):
        _round_trip(torch.ones(Tq, Tk, dtype=torch.bool))
        _round_trip(torch.zeros(Tq, Tk, dtype=torch.bool))
    dense = torch.zeros(7, 9, dtype=torch.bool)
    dense[0, 0] = dense[6, 8] = dense[3, 0] = dense[3, 8] = True
    _round_trip(dense)


@pytest.mark.parametrize("Tq, Tk", [pytest.param(0, 5, id="no-rows"), pytest.param(5, 0, id="no-keys"),
                                    pytest.param(0, 0, id="nothing")])
def test_zero_sizes(Tq, Tk):
    result = _round_trip(torch.zeros(Tq, Tk, dtype=torch.bool))
    assert result.num_slices == 0


def test_non_contiguous_input():
    i, j = _grid(19, 11)
    dense = (j <= i) | (j % 3 == 0)
    _round_trip(dense.t())
    _round_trip(dense[::2, 1:])


# --------------------------------------------------------- several runs per row


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in
                                  ("two-bands", "strided", "block-sparse", "checker", "causal-plus-sink")])
def test_several_runs_per_row(name):
    i, j = _grid(29, 33)
    dense = {
        "two-bands": ((i - j).abs() <= 1) | ((i + 10 - j).abs() <= 2),
        "strided": (j <= i) & ((i - j) % 4 == 0),
        "block-sparse": RangeMask.block_sparse([(0, 0), (0, 2), (1, 1), (2, 0), (2, 2), (2, 4), (3, 3)], 8, 29, 33)
        .to_dense(29, 33),
        "checker": (i // 3 + j // 5) % 2 == 0,
        "causal-plus-sink": (j < 2) | ((j <= i) & (i - j < 5)),
    }[name]
    runs_per_row = (dense[:, 1:] & ~dense[:, :-1]).sum(1) + dense[:, 0]
    assert int(runs_per_row.max()) >= 2
    _round_trip(dense)


def test_block_sparse_merges_like_the_builder():
    blocks = [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (3, 3), (4, 3)]
    built = RangeMask.block_sparse(blocks, 4, 19, 17)
    result = _round_trip(built.to_dense(19, 17))
    assert result.num_slices <= built.num_slices


# ------------------------------------------------------------ common masks


def _doc_bounds(T, n_docs, seed, min_len=2):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T // min_len), n_docs - 1))
    return [0] + [c * min_len for c in cuts] + [T]


# Each mask of _common and the most slices its conversion may take.
COMMON_SLICES = {
    "causal": 1, "causal-wide": 1, "causal-tall": 1, "full": 1, "sliding-window": 3, "sliding-window-bidir": 3,
    "prefix-lm": 2, "documents-causal": 7, "documents-full": 7, "chunked-causal": 5, "block-causal": 5,
    "shared-question": 5,
}
_COMMON_IDS = {
    "causal-wide": "causal-Tq<Tk", "causal-tall": "causal-Tq>Tk", "sliding-window-bidir": "sliding-window-bidirectional",
}
COMMON = [pytest.param(name, n, id=_COMMON_IDS.get(name, name)) for name, n in COMMON_SLICES.items()]


def _common(name):
    T = 97
    cu = _doc_bounds(T, 7, seed=3)
    return {
        "causal": (RangeMask.causal(T), T, T),
        "causal-wide": (RangeMask.causal(41, T), 41, T),
        "causal-tall": (RangeMask.causal(T, 41), T, 41),
        "full": (RangeMask.full(41, T), 41, T),
        "sliding-window": (RangeMask.sliding_window(T, 9), T, T),
        "sliding-window-bidir": (RangeMask.sliding_window(T, 9, causal=False), T, T),
        "prefix-lm": (RangeMask.prefix_lm(T, 23), T, T),
        "documents-causal": (RangeMask.varlen(cu, causal=True), T, T),
        "documents-full": (RangeMask.varlen(cu), T, T),
        "chunked-causal": (RangeMask.chunked_causal(T, 21), T, T),
        "block-causal": (RangeMask.block_causal(T, 21), T, T),
        "shared-question": (RangeMask.shared_question(11, [13, 7, 29]), 60, 60),
    }[name]


@pytest.mark.parametrize("name, most", COMMON)
def test_common_masks_give_few_slices(name, most):
    built, Tq, Tk = _common(name)
    result = _round_trip(built.to_dense(Tq, Tk))
    assert result.num_slices <= most, result
    assert result.num_slices <= built.num_slices, (result, built)


def test_documents_one_slice_each():
    T = 131
    cu = _doc_bounds(T, 16, seed=5)
    doc = torch.repeat_interleave(torch.arange(16), torch.tensor(cu).diff())
    i, j = _grid(T, T)
    result = _round_trip((doc[i] == doc[j]) & (j <= i))
    assert result.num_slices == 16
    assert result.q_ranges.tolist() == [[a, b] for a, b in zip(cu[:-1], cu[1:])]
    assert set(result.mask_types.tolist()) == {CAUSAL}


def _fewest_slices(lo, hi):
    """Brute-force minimum of run-preserving slices for one run per row (``lo < hi``, or empty when equal)."""
    n = len(lo)
    best = [0] + [None] * n  # best[r]: fewest slices for rows [0, r)
    for r in range(1, n + 1):
        if lo[r - 1] == hi[r - 1]:
            best[r] = best[r - 1]
            continue
        cands = []
        for s in range(r - 1, -1, -1):  # slice over rows [s, r)
            if lo[s] == hi[s]:
                break
            moves = {(lo[t + 1] - lo[t], hi[t + 1] - hi[t]) for t in range(s, r - 1)}
            if len(moves) > 1 or not moves <= {(0, 0), (0, 1), (1, 0), (1, 1)}:
                break
            cands.append(best[s] + 1)
        best[r] = min(cands)
    return best[n]


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in range(8)])
def test_greedy_cut_is_fewest(seed):
    # One run per row, moving by random steps with many short stretches
    # (the case where a greedy cut can go wrong): the count must equal the
    # brute-force minimum over cuts that keep runs whole.
    rng = random.Random(seed)
    Tk = 61
    for _ in range(20):
        lo, hi, rows = [], [], rng.randint(1, 23)
        a, b = rng.randrange(Tk // 2), rng.randrange(Tk // 2, Tk) + 1
        for _ in range(rows):
            if rng.random() < 0.08:
                lo.append(0), hi.append(0)  # an empty row
                continue
            da, db = rng.choice([(0, 0), (0, 1), (1, 0), (1, 1), (1, 1), (2, 0), (0, -1)])
            a = min(a + da, Tk - 1)
            b = min(max(b + db, a + 1), Tk)
            lo.append(a), hi.append(b)
        dense = torch.zeros(rows, Tk, dtype=torch.bool)
        for r in range(rows):
            dense[r, lo[r]:hi[r]] = True
        result = _round_trip(dense)
        assert result.num_slices == _fewest_slices(lo, hi), (lo, hi, result)


# ----------------------------------------------------------------- mask_mod


def _mask_mods(T, seed=0):
    """FlexAttention-style mask_mods (closures over index tensors) of length ``T``."""
    cu = _doc_bounds(T, 5, seed)
    document_id = torch.repeat_interleave(torch.arange(5), torch.tensor(cu).diff())
    window, prefix = 7, 11

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def document(b, h, q_idx, kv_idx):
        return document_id[q_idx] == document_id[kv_idx]

    def document_causal(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return {"causal": causal, "sliding-window": sliding_window, "document": document,
            "document-causal": document_causal, "prefix-lm": prefix_lm}


def _evaluate(mask_mod, Tq, Tk):
    """Dense reference: the mask_mod cell by cell on scalar index tensors."""
    z = torch.tensor(0)
    return torch.tensor([[bool(mask_mod(z, z, torch.tensor(i), torch.tensor(j))) for j in range(Tk)]
                         for i in range(Tq)], dtype=torch.bool).reshape(Tq, Tk)


MASK_MODS = [pytest.param(n, id=n) for n in ("causal", "sliding-window", "document", "document-causal", "prefix-lm")]


@pytest.mark.parametrize("name", MASK_MODS)
def test_mask_mod_equals_from_dense(name):
    T = 53
    mask_mod = _mask_mods(T)[name]
    dense = _evaluate(mask_mod, T, T)
    result = from_mask_mod(mask_mod, T)
    _check(result, dense)
    assert _same(result, from_dense(dense))


@pytest.mark.parametrize("name", MASK_MODS)
@pytest.mark.parametrize("chunk_rows", [pytest.param(1, id="rows1"), pytest.param(3, id="rows3"),
                                        pytest.param(50, id="rows50")])
def test_chunking_gives_identical_slices(name, chunk_rows):
    T = 53
    mask_mod = _mask_mods(T, seed=1)[name]
    whole = from_mask_mod(mask_mod, T)
    assert _same(from_mask_mod(mask_mod, T, chunk_rows=chunk_rows), whole)
    dense = whole.to_dense(T, T)
    assert _same(from_dense(dense, chunk_rows=chunk_rows), whole)


def test_mask_mod_rectangular():
    def causal(b, h, q_idx, kv_idx):  # bottom-right, as FA3 and flashrange's CAUSAL
        return kv_idx <= q_idx + (Tk - Tq)

    for Tq, Tk in ((13, 29), (29, 13)):
        result = from_mask_mod(causal, Tq, Tk, chunk_rows=4)
        _check(result, _evaluate(causal, Tq, Tk))
        assert result.num_slices == 1


def test_mask_mod_batch_and_head_are_zero():
    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (h == 0) & (b == 0)

    result = from_mask_mod(per_head, 9)
    assert _same(result, RangeMask.causal(9))


def test_mask_mod_needing_vmap():
    # Chained indexing does not broadcast (the first index takes whole rows),
    # so this mask_mod only works one cell at a time: the vmap fallback.
    g = torch.Generator().manual_seed(0)
    table = torch.rand(13, 11, generator=g) < 0.5

    def lookup(b, h, q_idx, kv_idx):
        return table[q_idx][kv_idx]

    result = from_mask_mod(lookup, 13, 11, chunk_rows=4)
    _check(result, table)
    assert _same(result, from_dense(table))


def test_mask_mod_scalar_result_broadcasts():
    result = from_mask_mod(lambda b, h, q_idx, kv_idx: q_idx < 3, 7, 5)
    assert _same(result, from_dense(torch.arange(7).unsqueeze(1).expand(7, 5) < 3))


def test_classmethods_delegate():
    T = 37
    mask_mod = _mask_mods(T)["document-causal"]
    dense = _evaluate(mask_mod, T, T)
    assert _same(RangeMask.from_dense(dense), from_dense(dense))
    assert _same(RangeMask.from_mask_mod(mask_mod, T, chunk_rows=5), from_dense(dense))


def test_device_argument():
    dense = RangeMask.causal(7).to_dense(7, 7)
    assert from_dense(dense, device="meta").device.type == "meta"
    assert from_mask_mod(lambda b, h, q, kv: kv <= q, 7, device="cpu").device.type == "cpu"


# ---------------------------------------------------------------- BlockMask


@pytest.mark.parametrize("name", MASK_MODS)
def test_block_mask_input(name):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    T = 301  # not a multiple of the block size: the last block is partial
    mask_mod = _mask_mods(T, seed=2)[name]
    block_mask = flex.create_block_mask(mask_mod, None, None, T, T, device="cpu", BLOCK_SIZE=64)
    result = from_mask_mod(block_mask, chunk_rows=37)
    assert _same(result, from_mask_mod(mask_mod, T))
    _check(result, result.to_dense(T, T))


def test_block_mask_rectangular_and_sizes():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 70

    block_mask = flex.create_block_mask(causal, 1, 1, 131, 201, device="cpu", BLOCK_SIZE=(32, 64))
    assert _same(from_mask_mod(block_mask), from_mask_mod(causal, 131, 201))
    assert _same(from_mask_mod(block_mask, 131, 201), from_mask_mod(causal, 131, 201))
    with pytest.raises(ValueError, match="contradict the BlockMask's seq_lengths"):
        from_mask_mod(block_mask, 130)


def test_block_mask_from_kv_blocks_is_block_level():
    # A BlockMask built from block lists with no mask_mod attends every cell
    # of its listed blocks (partial and full) and nothing else.
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    kv_num = torch.tensor([[[1, 2, 1]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0, 0], [0, 2, 0], [1, 0, 0]]]], dtype=torch.int32)
    full_num = torch.tensor([[[1, 0, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[2, 0, 0], [0, 0, 0], [0, 0, 0]]]], dtype=torch.int32)
    block_mask = flex.BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=4,
                                               seq_lengths=(11, 10))
    blocks = [(0, 0), (0, 2), (1, 0), (1, 2), (2, 1)]
    expected = RangeMask.block_sparse(blocks, 4, 11, 10).to_dense(11, 10)
    result = from_mask_mod(block_mask)
    _check(result, expected)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("bad, message", [
    pytest.param(torch.ones(3, 4), "must be a bool tensor .*mask == 0", id="float"),
    pytest.param(torch.ones(3, 4, dtype=torch.int64), "must be a bool tensor .*mask != 0", id="int"),
    pytest.param(torch.ones(3, dtype=torch.bool), r"shape \(Tq, Tk\), got \(3,\)", id="1-D"),
    pytest.param(torch.ones(1, 2, 3, 4, dtype=torch.bool), r"got \(1, 2, 3, 4\).*mask\[0, 0\]", id="4-D"),
    pytest.param([[True, False]], "must be a torch.Tensor", id="list"),
])
def test_from_dense_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        from_dense(bad)


def test_from_mask_mod_errors():
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    with pytest.raises(ValueError, match="Tq .* is required"):
        from_mask_mod(causal)
    with pytest.raises(ValueError, match="must be a function"):
        from_mask_mod(torch.ones(3, 3, dtype=torch.bool), 3)
    with pytest.raises(ValueError, match="Tq must be in"):
        from_mask_mod(causal, -1)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        from_mask_mod(causal, 5, chunk_rows=0)
    with pytest.raises(ValueError, match="chunk_rows must be a positive int"):
        from_dense(torch.ones(2, 2, dtype=torch.bool), chunk_rows=1.5)
    with pytest.raises(ValueError, match="must return a bool tensor"):
        from_mask_mod(lambda b, h, q_idx, kv_idx: kv_idx - q_idx, 5)

    def branchy(b, h, q_idx, kv_idx):
        return torch.tensor(True) if q_idx >= kv_idx else torch.tensor(False)

    with pytest.raises(ValueError, match="could not evaluate mask_mod.*vmap"):
        from_mask_mod(branchy, 5)
