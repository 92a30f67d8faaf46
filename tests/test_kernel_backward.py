"""The Triton backward (dQ, dK, dV) against the reference, on the CPU interpreter.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when there is no GPU, so
these run in CI. Accuracy follows the three-way rule (DESIGN §6): the golden
gradients are the reference's on float64 inputs; the reference run in the
test dtype sets the error budget; the kernel's max error may be at most twice
the reference's plus a floor of one epsilon of the dtype at the gradient's
scale, ``eps * max(1, max|golden|)``.

Why that floor: like every flash attention (FlashAttention-2/3, cuDNN,
FlexAttention), the kernel rounds P and dS to the input dtype before the
tensor-core products (float32 accumulation), while the reference computes in
float32 and rounds once at the end. That rounding can push a gradient across
a rounding boundary the reference does not cross; over 600 seeded random
masks (an emulation of those numerics in plain torch) it cost at most 0.33 of
the floor, bfloat16 and float16 alike. Exact zeros are checked separately.

Small odd shapes: T = 1, 17, 63, 130; head dims 16, 64 and 40 (padded
inside the kernel); GQA ratios 1, 2, 4; every mask type, softcap, overlapping
q and k ranges, empty slices, uncovered rows, a non-zero ``dlse``, garbage
ranges, and bitwise invariance under reruns, permutation and padding.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashrange import reference
from golden import random_slice_rows
from flashrange.kernels.backward import BwdConfig, default_config, range_attention_backward_triton

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = reference.FULL, reference.CAUSAL, reference.INV_CAUSAL, reference.BI_CAUSAL



def _ranges(rows):
    """``(q_ranges, k_ranges, mask_types)`` from ``[(qs, qe, ks, ke, type), ...]``."""
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _random_rows(Tq, Tk, n, seed, *, n_empty=0, uncovered=0):
    return random_slice_rows(Tq, Tk, n, random.Random(seed), n_empty=n_empty, uncovered=uncovered)


def _inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, Hq, D, generator=g).to(dtype)
    k = torch.randn(Tk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(Tk, Hkv, Dv, generator=g).to(dtype)
    do = torch.randn(Tq, Hq, Dv, generator=g).to(dtype)
    dlse = torch.randn(Tq, Hq, generator=g) if with_dlse else torch.zeros(Tq, Hq)
    return q, k, v, do, dlse


def _check_grads(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, *, softcap=0.0, scale=None, with_dlse=False, seed=0,
                 config=None):
    """Three-way check of the kernel's gradients; returns them."""
    q, k, v, do, dlse = _inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse)
    qr, kr, mt = _ranges(rows)
    f64 = [t.double() for t in (q, k, v)]
    out64, lse64 = reference.range_attention_forward(*f64, qr, kr, mt, scale, softcap)
    golden = reference.range_attention_backward(do.double(), *f64, out64, lse64, qr, kr, mt, scale, softcap, dlse)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, scale, softcap)
    ref = reference.range_attention_backward(do, q, k, v, out, lse, qr, kr, mt, scale, softcap, dlse)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, scale, softcap, dlse, config=config)
    for name, g, r, x in zip(("dq", "dk", "dv"), golden, ref, got):
        assert x.dtype == r.dtype and x.shape == r.shape, name
        assert torch.isfinite(x).all(), f"{name} has non-finite values"
        ref_err = (r.double() - g).abs().max().item() if g.numel() else 0.0
        err = (x.double() - g).abs().max().item() if g.numel() else 0.0
        floor = torch.finfo(dtype).eps * max(1.0, g.abs().max().item() if g.numel() else 0.0)
        assert err <= 2 * ref_err + floor, (
            f"{name}: kernel error {err:.3e} > 2 x reference error {ref_err:.3e} + {floor:.2e}"
        )
    return got, (q, k, v, do, out, lse, dlse)


def _doc_causal(T, lengths, mtype=CAUSAL):
    rows, s = [], 0
    for n in lengths:
        rows.append((s, s + n, s, s + n, mtype))
        s += n
    assert s == T
    return rows


# (Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, softcap, dlse)
SHAPES = [
    pytest.param(1, 1, 2, 1, 16, 16, [(0, 1, 0, 1, FULL)], torch.bfloat16, 0.0, False, id="T1-full-gqa2-bf16"),
    pytest.param(17, 17, 3, 3, 16, 16, [(0, 17, 0, 17, CAUSAL)], torch.bfloat16, 0.0, False, id="T17-causal-mha-bf16"),
    pytest.param(17, 29, 4, 2, 64, 64, [(0, 17, 0, 29, CAUSAL)], torch.float16, 0.0, True,
                 id="Tq17-Tk29-causal-gqa2-fp16-dlse"),
    pytest.param(63, 63, 4, 1, 16, 16, [(0, 63, 0, 63, INV_CAUSAL)], torch.bfloat16, 0.0, False,
                 id="T63-invcausal-mqa4-bf16"),
    pytest.param(63, 63, 2, 1, 64, 64, [(0, 63, 0, 63, BI_CAUSAL), (0, 40, 0, 63, BI_CAUSAL)], torch.float16, 0.0,
                 False, id="T63-bicausal-gqa2-fp16"),
    pytest.param(130, 130, 2, 2, 16, 16, _doc_causal(130, [1, 40, 17, 72]), torch.bfloat16, 0.0, False,
                 id="T130-doccausal-bf16"),
    pytest.param(130, 130, 4, 1, 40, 24, [(0, 130, 0, 130, FULL)], torch.bfloat16, 0.0, False,
                 id="T130-full-mqa4-D40-Dv24-bf16"),
    pytest.param(63, 130, 4, 4, 64, 64, [(0, 63, 0, 130, CAUSAL), (10, 50, 0, 20, FULL)], torch.float16, 5.0, True,
                 id="Tq63-Tk130-overlap-softcap-dlse-fp16"),
    pytest.param(130, 63, 2, 1, 16, 16, [(0, 130, 0, 63, CAUSAL)], torch.bfloat16, 0.0, True,
                 id="Tq130-Tk63-causal-uncoveredtop-dlse-bf16"),
    pytest.param(130, 130, 4, 2, 16, 16,
                 [(0, 130, 0, 130, CAUSAL), (0, 130, 0, 130, CAUSAL), (20, 90, 0, 130, INV_CAUSAL)],
                 torch.bfloat16, 0.0, False, id="T130-duplicated-overlapping-bf16"),
]


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D,Dv,rows,dtype,softcap,with_dlse", SHAPES)
def test_against_reference(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, softcap, with_dlse):
    _check_grads(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, softcap=softcap, with_dlse=with_dlse)


@pytest.mark.parametrize(
    "seed,Tq,Tk,Hq,Hkv,n,n_empty,uncovered,softcap,dtype",
    [
        pytest.param(1, 63, 63, 2, 1, 5, 2, 0, 0.0, torch.bfloat16, id="s1-T63-gqa2-pad2"),
        pytest.param(2, 130, 63, 4, 1, 7, 3, 9, 0.0, torch.float16, id="s2-Tq130-Tk63-mqa4-uncovered9"),
        pytest.param(3, 17, 130, 4, 2, 6, 1, 2, 3.0, torch.bfloat16, id="s3-Tq17-Tk130-softcap-uncovered2"),
        pytest.param(4, 130, 130, 2, 2, 9, 4, 0, 0.0, torch.bfloat16, id="s4-T130-9slices-pad4"),
    ],
)
def test_random_overlapping_slices(seed, Tq, Tk, Hq, Hkv, n, n_empty, uncovered, softcap, dtype):
    rows = _random_rows(Tq, Tk, n, seed, n_empty=n_empty, uncovered=uncovered)
    (dq, dk, dv), _ = _check_grads(Tq, Tk, Hq, Hkv, 16, 16, rows, dtype, softcap=softcap, with_dlse=True, seed=seed)
    if uncovered:
        # Rows no slice covers get exactly zero gradient, even with dlse != 0 there.
        assert torch.count_nonzero(dq[Tq - uncovered:]) == 0


def test_uncovered_keys_and_rows_are_zero():
    """Keys no slice reads get dK = dV = 0 exactly; rows no slice covers get dQ = 0 (lse = -inf)."""
    rows = [(5, 40, 10, 30, FULL), (50, 60, 50, 63, CAUSAL)]
    (dq, dk, dv), (_, _, _, _, _, lse, _) = _check_grads(63, 63, 2, 1, 16, 16, rows, torch.bfloat16, with_dlse=True)
    assert torch.isneginf(lse[:5]).all()
    assert torch.count_nonzero(dq[:5]) == 0 and torch.count_nonzero(dq[40:50]) == 0
    assert torch.count_nonzero(dk[:10]) == 0 and torch.count_nonzero(dv[30:50]) == 0
    assert torch.count_nonzero(dk[10:30]) > 0


def test_all_empty_slices_give_zeros():
    rows = [(0, 0, 0, 0, FULL), (7, 7, 0, 17, CAUSAL), (0, 17, 9, 9, FULL), (3, 9, 2, 8, 7)]
    (dq, dk, dv), _ = _check_grads(17, 17, 2, 2, 16, 16, rows, torch.bfloat16, with_dlse=True)
    for x in (dq, dk, dv):
        assert torch.count_nonzero(x) == 0


def test_garbage_ranges_are_clamped():
    """Ranges past the tensors, negative, reversed, or of unknown type: clamped or dropped like the reference."""
    rows = [(-5, 10, -3, 200, CAUSAL), (50, 99, 40, 70, FULL), (12, 4, 0, 17, FULL), (0, 63, 0, 63, 9),
            (20, 1000, 60, 63, INV_CAUSAL), (-10, -2, 0, 5, FULL)]
    _check_grads(63, 63, 2, 1, 16, 16, rows, torch.bfloat16, with_dlse=True)


def test_non_default_scale_and_tile_shapes():
    """Other tile shapes walk the slices in other splits (masked edges, full runs) and still agree."""
    rows = _random_rows(71, 71, 5, seed=11, n_empty=1)
    for cfg in (BwdConfig(16, 16, 4, 1, 16, 16, 4, 1), BwdConfig(64, 16, 4, 1, 16, 64, 4, 1)):
        _check_grads(71, 71, 2, 1, 16, 16, rows, torch.bfloat16, scale=0.3, with_dlse=True, seed=5, config=cfg)


def test_bitwise_rerun_permutation_padding():
    """A permuted slice list, and empty slices anywhere in it, change no bit."""
    Tq, Tk = 97, 83
    rows = _random_rows(Tq, Tk, 5, seed=21)
    (dq, dk, dv), (q, k, v, do, out, lse, dlse) = _check_grads(Tq, Tk, 2, 1, 16, 16, rows, torch.bfloat16,
                                                              with_dlse=True, seed=3)
    rng = random.Random(0)
    shuffled = rows[:]
    rng.shuffle(shuffled)
    padded = shuffled[:]
    for _ in range(5):
        padded.insert(rng.randint(0, len(padded)), (0, 0, 0, 0, FULL))
    for variant in (shuffled, padded):
        qr, kr, mt = _ranges(variant)
        got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse)
        for a, b in zip((dq, dk, dv), got):
            assert torch.equal(a, b)


def test_default_config_is_mask_independent():
    cfg = default_config(128, 128, torch.bfloat16, torch.device("cuda"))
    assert cfg.kv_block_n >= 16 and cfg.q_block_m >= 16
    with pytest.raises(ValueError, match="power of two"):
        BwdConfig(16, 24, 4, 1, 16, 16, 4, 1).check()


def test_bad_shapes_raise():
    q = torch.randn(5, 2, 16)
    k = torch.randn(5, 1, 16)
    v = torch.randn(5, 1, 16)
    qr, kr, mt = _ranges([(0, 5, 0, 5, FULL)])
    lse = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="dout and out"):
        range_attention_backward_triton(torch.randn(5, 2, 8), q, k, v, q, lse, qr, kr, mt)
    with pytest.raises(ValueError, match="multiple"):
        range_attention_backward_triton(q, q, torch.randn(5, 3, 16), torch.randn(5, 3, 16), q, lse, qr, kr, mt)
    big = torch.randn(5, 2, 320)
    with pytest.raises(ValueError, match="up to 256"):
        range_attention_backward_triton(big, big, torch.randn(5, 1, 320), torch.randn(5, 1, 320), big, lse,
                                        qr, kr, mt)
