"""The Triton backward (dQ, dK, dV) against the reference, on the CPU interpreter.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` when there is no GPU, so
these run in CI. Accuracy follows the three-way rule (docs/design.md §10,
``golden.assert_three_way``): the golden gradients are the reference's on
float64 inputs; the reference run in the test dtype sets the error budget;
the kernel's error may be at most twice the reference's, **per row** (plus
one eps of the row's own golden magnitude) and **over the tensor** (plus
1.25 eps of the golden's RMS element), never as one global maximum (a
0.5% error everywhere passes a global maximum with an eps floor;
``test_comparison_rejects_small_errors`` keeps the rule honest).

Why the eps terms: like every flash attention (FlashAttention-2/3, cuDNN,
FlexAttention), the kernel rounds P and dS to the input dtype before the
tensor-core products (float32 accumulation), while the reference computes in
float32 and rounds once at the end; over 330 random gradient tensors a
correct kernel used at most 0.43 of the row term and 0.82 of the tensor term.
Exact zeros are checked separately.

Small odd shapes: T = 1, 17, 63, 130 and shapes of 200-260 where whole
tiles fall inside a slice for every mask type (the unmasked fast path);
head dims 16, 64 and 40 (padded inside the kernel), ``Dv != D``; GQA ratios
1, 2, 4; float32, float16, bfloat16; every mask type, softcap, overlapping q
and k ranges, empty slices, uncovered rows, a non-zero ``dlse``, garbage
ranges, zero-length inputs, strided views (q inside a fused qkv buffer, also
with element offsets past 2**31), and bitwise invariance under reruns,
permutation and padding.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from flashrange import reference
from golden import assert_three_way, dense_counts, grad_inputs, random_slice_rows, shuffled_and_padded, three_way_errors
from flashrange.kernels.backward import BwdConfig, default_config, kv_head_chunks_for, range_attention_backward_triton

from flashrange.constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL  # noqa: E402



def _ranges(rows):
    """``(q_ranges, k_ranges, mask_types)`` from ``[(qs, qe, ks, ke, type), ...]``."""
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _random_rows(Tq, Tk, n, seed, *, n_empty=0, uncovered=0):
    return random_slice_rows(Tq, Tk, n, random.Random(seed), n_empty=n_empty, uncovered=uncovered)


def _grads(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, *, softcap=0.0, scale=None, with_dlse=False, seed=0, config=None):
    """``(golden, reference, kernel)`` gradients and the inputs."""
    q, k, v, do, dlse = grad_inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse)
    qr, kr, mt = _ranges(rows)
    f64 = [t.double() for t in (q, k, v)]
    out64, lse64 = reference.range_attention_forward(*f64, qr, kr, mt, scale, softcap)
    golden = reference.range_attention_backward(do.double(), *f64, out64, lse64, qr, kr, mt, scale, softcap, dlse)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, scale, softcap)
    ref = reference.range_attention_backward(do, q, k, v, out, lse, qr, kr, mt, scale, softcap, dlse)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, scale, softcap, dlse, config=config)
    return golden, ref, got, (q, k, v, do, out, lse, dlse)


def _check_grads(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, **kw):
    """Three-way check of the kernel's gradients (per row and per tensor); returns them and the inputs."""
    golden, ref, got, inputs = _grads(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, **kw)
    for name, g, r, x in zip(("dq", "dk", "dv"), golden, ref, got):
        assert_three_way(name, x, r, g)
    return got, inputs


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
    pytest.param(63, 71, 2, 1, 24, 40, [(0, 63, 0, 71, CAUSAL), (5, 50, 30, 71, INV_CAUSAL)], torch.float32, 3.0, True,
                 id="Tq63-Tk71-D24-Dv40-softcap-dlse-fp32"),
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
    shuffled, padded = shuffled_and_padded(rows, random.Random(0), 5)
    for variant in (rows, shuffled, padded):  # a rerun, then the permuted and padded lists
        qr, kr, mt = _ranges(variant)
        got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse)
        for a, b in zip((dq, dk, dv), got):
            assert torch.equal(a, b)


def test_default_configs_and_config_checks():
    """Every default divides the plan's block; malformed configs are refused when built."""
    from flashrange.constants import PLAN_BLOCK

    for dev in (torch.device("cuda"), torch.device("cpu")):
        for D in (16, 64, 128, 256):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                cfg = default_config(D, D, dtype, dev)
                assert PLAN_BLOCK % cfg.kv_block_n == 0 and PLAN_BLOCK % cfg.q_block_m == 0
                assert min(cfg.kv_block_m, cfg.kv_block_n, cfg.q_block_m, cfg.q_block_n) >= 16
    with pytest.raises(ValueError, match="power of two"):
        BwdConfig(16, 24, 4, 1, 16, 16, 4, 1)
    with pytest.raises(ValueError, match="positive int"):
        BwdConfig(16, 16, 0, 1, 16, 16, 4, 1)
    with pytest.raises(ValueError, match="does not divide"):
        BwdConfig(16, 256, 4, 1, 16, 16, 4, 1)
    with pytest.raises(ValueError, match="gluon_dkdv needs kv_block_n=128"):
        BwdConfig(32, 64, 4, 1, 128, 64, 4, 1, gluon_dkdv=True)
    with pytest.raises(ValueError, match="gluon_dq needs q_block_m=128"):
        BwdConfig(32, 128, 4, 1, 64, 64, 4, 1, gluon_dq=True)
    with pytest.raises(ValueError, match="must be a bool"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=1)
    with pytest.raises(ValueError, match="must be a bool"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, persistent=1)
    with pytest.raises(ValueError, match="persistent applies to the Gluon kernels only"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, persistent=True)
    assert BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, persistent=True).persistent
    with pytest.raises(ValueError, match="must be a bool"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, persistent=True, dynamic="yes")
    with pytest.raises(ValueError, match="dynamic schedules a persistent grid"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, dynamic=True)
    with pytest.raises(ValueError, match="row_intervals applies to the Gluon kernels"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, row_intervals=True)
    with pytest.raises(ValueError, match="must be a bool"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dkdv=True, row_intervals=1)
    assert BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dkdv=True, row_intervals=True).row_intervals
    assert BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, persistent=True, dynamic=True).dynamic
    with pytest.raises(ValueError, match="must be a bool"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, persistent=True, dynamic=True, adaptive=1)
    with pytest.raises(ValueError, match="adaptive chooses per launch"):
        BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, persistent=True, adaptive=True)
    assert BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dq=True, persistent=True, dynamic=True,
                     adaptive=True).adaptive


def test_hopper_backward_refused_off_hopper():
    """The Gluon backward kernels are never the default here, and a config asking for them says what it needs."""
    for dev in (torch.device("cuda"), torch.device("cpu")):
        for D in (64, 96, 128):
            cfg = default_config(D, D, torch.bfloat16, dev)
            assert not (cfg.gluon_dkdv or cfg.gluon_dq)
    q = torch.randn(40, 2, 64).bfloat16()
    k = v = torch.randn(40, 1, 64).bfloat16()
    qr, kr, mt = _ranges([(0, 40, 0, 40, CAUSAL)])
    forced = BwdConfig(32, 128, 4, 1, 128, 64, 4, 1, gluon_dkdv=True, gluon_dq=True)
    with pytest.raises(ValueError, match="compute-capability-9 GPU"):
        range_attention_backward_triton(q, q, k, v, q, torch.zeros(40, 2), qr, kr, mt, config=forced)


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


def _former_rule(got, ref, golden):
    """The rule these tests used before (one global maximum, floor eps * max|golden|): accepts or not."""
    err = (got.double() - golden).abs().max().item()
    ref_err = (ref.double() - golden).abs().max().item()
    return err <= 2 * ref_err + torch.finfo(got.dtype).eps * max(1.0, golden.abs().max().item())


def test_comparison_rejects_small_errors():
    """Mutation test of the comparison itself, in bfloat16: the kernel's gradients pass; dK scaled by 1.005
    everywhere, and one small row of dQ off by 5%, are both rejected (the former global-maximum rule took both)."""
    rows = _doc_causal(130, [1, 40, 17, 72]) + [(0, 130, 0, 130, INV_CAUSAL)]
    golden, ref, got, _ = _grads(130, 130, 2, 2, 16, 16, rows, torch.bfloat16, with_dlse=True, seed=7)
    for name, g, r, x in zip(("dq", "dk", "dv"), golden, ref, got):
        assert_three_way(name, x, r, g)

    scaled_dk = (got[1].double() * 1.005).to(torch.bfloat16)
    assert _former_rule(scaled_dk, ref[1], golden[1])
    with pytest.raises(AssertionError, match="Frobenius"):
        assert_three_way("dk", scaled_dk, ref[1], golden[1])

    norms = three_way_errors(golden[0], golden[0], golden[0])["row_gold"]
    small = torch.where(norms >= 0.01 * norms.max(), norms, torch.full_like(norms, float("inf"))).argmin()
    bad_dq = got[0].clone()
    bad_dq.view(-1, 16)[small] = (bad_dq.view(-1, 16)[small].double() * 1.05).to(torch.bfloat16)
    assert _former_rule(bad_dq, ref[0], golden[0])
    with pytest.raises(AssertionError, match=rf"dq: row {int(small)} error"):
        assert_three_way("dq", bad_dq, ref[0], golden[0])



# ---------------------------------------------------------------------------------------------
# The unmasked fast path, zero-length inputs, strided views and 64-bit offsets

from test_kernel_forward import fast_path_params, longest_full_run  # noqa: E402


@pytest.mark.parametrize("q_range, k_range, mtype, Tq, Tk", fast_path_params("backward"))
def test_fast_path_every_type(q_range, k_range, mtype, Tq, Tk):
    """Default interpreter tiles with whole tiles inside the slice along both walks (dK/dV: query tiles of a
    key block, dQ: key tiles of a query block), plus an overlapping slice; D != Dv, dlse != 0."""
    cfg = default_config(16, 24, torch.bfloat16, torch.device("cpu"))
    assert longest_full_run(q_range, k_range, mtype, Tq, Tk, cfg.kv_block_n, by_keys=True) >= 2 * cfg.kv_block_m - 1
    assert longest_full_run(q_range, k_range, mtype, Tq, Tk, cfg.q_block_m) >= 2 * cfg.q_block_n - 1
    rows = [(*q_range, *k_range, mtype), (7, 30, 0, 9, FULL)]
    _check_grads(Tq, Tk, 2, 1, 16, 24, rows, torch.bfloat16, with_dlse=True, seed=mtype)


@pytest.mark.parametrize(
    "Tq, Tk, S",
    [pytest.param(0, 5, 2, id="Tq0"), pytest.param(5, 0, 2, id="Tk0"), pytest.param(0, 0, 2, id="Tq0-Tk0"),
     pytest.param(5, 7, 0, id="S0")],
)
def test_zero_length_inputs(Tq, Tk, S):
    rows = [(0, Tq, 0, Tk, CAUSAL), (0, 3, 1, 2, FULL)][:S]
    q, k, v, do, dlse = grad_inputs(Tq, Tk, 2, 1, 16, 8, torch.bfloat16, 0, True)
    qr, kr, mt = _ranges(rows) if S else (torch.zeros(0, 2, dtype=torch.int32),) * 2 + (torch.zeros(0, dtype=torch.int32),)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt)
    dq, dk, dv = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and torch.count_nonzero(g) == 0


def _fused_views(buf, Hq, Hkv, D, Dv, col0=0):
    """q, k, v as views into the rows of one fused buffer ``(T, ...)``, from column ``col0``."""
    T = buf.shape[0]
    q = buf[:, col0:col0 + Hq * D].view(T, Hq, D)
    k = buf[:, col0 + Hq * D:col0 + (Hq + Hkv) * D].view(T, Hkv, D)
    v = buf[:, col0 + (Hq + Hkv) * D:col0 + (Hq + Hkv) * D + Hkv * Dv].view(T, Hkv, Dv)
    return q, k, v


def test_strided_views_fused_qkv():
    """q, k, v as views into one fused qkv projection (row stride > row length, odd offset): the same bits as
    contiguous copies, and three-way accurate."""
    T, Hq, Hkv, D, Dv = 71, 2, 1, 16, 24
    g = torch.Generator().manual_seed(81)
    buf = torch.randn(T, 1 + Hq * D + Hkv * (D + Dv) + 3, generator=g).to(torch.bfloat16)
    q, k, v = _fused_views(buf, Hq, Hkv, D, Dv, col0=1)
    assert q.stride(0) == buf.shape[1] and not q.is_contiguous()
    do = torch.randn(T, Hq, Dv, generator=g).to(torch.bfloat16)
    qr, kr, mt = _ranges(_random_rows(T, T, 5, seed=82, n_empty=1))
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt)
    want = range_attention_backward_triton(do, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, qr, kr, mt)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    golden = reference.range_attention_backward(do.double(), q.double(), k.double(), v.double(),
                                                *reference.range_attention_forward(q.double(), k.double(),
                                                                                   v.double(), qr, kr, mt),
                                                qr, kr, mt)
    ref = reference.range_attention_backward(do, q, k, v, out, lse, qr, kr, mt)
    for name, g_, r, x in zip(("dq", "dk", "dv"), golden, ref, got):
        assert_three_way(name, x, r, g_)


def test_needs_int64_reads_strides():
    """The 64-bit decision comes from the largest element offset, strides included, not from numel()."""
    from flashrange.kernels.common import needs_int64

    def meta(shape, stride):
        return torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta")

    small = meta((1000, 8, 64), (512, 64, 1))
    assert not needs_int64(small)
    # q inside a fused buffer: 70 rows of 16 elements, rows 2**25 elements apart.
    fused = meta((70, 1, 16), (2**25, 16, 1))
    assert fused.numel() == 1120 and needs_int64(fused)
    assert needs_int64(small, fused) and needs_int64(fused, small)
    # A large contiguous tensor, and the last offset just inside / past int32.
    assert needs_int64(meta((2**21, 16, 64), (1024, 64, 1)))
    assert not needs_int64(meta((2, 2**30 - 1), (2**30 - 1, 1)))  # last offset 2**31 - 3
    assert needs_int64(meta((2, 2**30 + 1), (2**30 + 1, 1)))
    # Empty tensors have no offsets, whatever their strides; head strides count too.
    assert not needs_int64(meta((0, 4, 64), (2**40, 64, 1)))
    assert needs_int64(meta((3, 2, 16), (16, 2**31, 1)))


def _huge_row_stride_buffer(T, width):
    """``(T, width)`` bf16 rows 2**25 elements apart: element offsets past 2**31 from row 64 on.

    4+ GiB of address space; the OS maps only the pages written, so the test touches a few MiB.
    """
    try:
        buf = torch.empty(T, 2**25, dtype=torch.bfloat16)
    except RuntimeError as e:  # not a result of the code under test: no address space for the buffer
        pytest.skip(f"cannot reserve {T * 2**26 / 2**30:.1f} GiB of address space: {e}")
    g = torch.Generator().manual_seed(91)
    buf[:, :width] = torch.randn(T, width, generator=g).to(torch.bfloat16)
    return buf


def test_offsets_past_int32_in_a_strided_view():
    """A backward (and forward) on views whose element offsets pass 2**31 while numel() is tiny: the kernels
    must use 64-bit row offsets (``needs_int64`` from strides) and agree with contiguous copies."""
    from flashrange.kernels.common import needs_int64
    from flashrange.kernels.forward import range_attention_forward_triton

    T, Hq, Hkv, D, Dv = 70, 2, 1, 16, 16
    buf = _huge_row_stride_buffer(T, Hq * D + Hkv * (D + Dv))
    q, k, v = _fused_views(buf[:, :Hq * D + Hkv * (D + Dv)], Hq, Hkv, D, Dv)
    assert (T - 1) * q.stride(0) >= 2**31 and q.numel() < 2**12 and needs_int64(q)
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    rows = [(0, T, 0, T, CAUSAL), (40, 70, 0, 66, FULL), (60, 70, 64, 70, BI_CAUSAL)]
    qr, kr, mt = _ranges(rows)
    g = torch.Generator().manual_seed(92)
    do = torch.randn(T, Hq, Dv, generator=g).to(torch.bfloat16)
    dlse = torch.randn(T, Hq, generator=g)
    out, lse = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.25)
    want_out, want_lse = range_attention_forward_triton(qc, kc, vc, qr, kr, mt, 0.25)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, 0.25, 0.0, dlse)
    want = range_attention_backward_triton(do, qc, kc, vc, out, lse, qr, kr, mt, 0.25, 0.0, dlse)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ref = reference.range_attention_backward(do, qc, kc, vc, out, lse, qr, kr, mt, 0.25, 0.0, dlse)
    f64 = [t.double() for t in (qc, kc, vc)]
    o64, l64 = reference.range_attention_forward(*f64, qr, kr, mt, 0.25)
    golden = reference.range_attention_backward(do.double(), *f64, o64, l64, qr, kr, mt, 0.25, 0.0, dlse)
    for name, g_, r, x in zip(("dq", "dk", "dv"), golden, ref, got):
        assert_three_way(name, x, r, g_)


# ---------------------------------------------------------------------------------------------
# Two launches: the dQ kernel computes delta and the scaled lse for the dK/dV kernel

def _uncovered_case(seed=41):
    """GQA; rows 0-4, 40-59 and 140-299 uncovered: inside tiles that slices visit, in whole tiles of a visited
    plan block, and in the last plan block (partial, its window empty)."""
    from flashrange.constants import PLAN_BLOCK

    Tq, Tk, Hq, Hkv, D, Dv = 300, 90, 4, 2, 16, 24
    rows = [(5, 40, 10, 30, FULL), (50, 140, 20, 90, CAUSAL), (60, 100, 0, 50, INV_CAUSAL)]
    assert 140 < 2 * PLAN_BLOCK < Tq < 3 * PLAN_BLOCK and Tq % 32
    uncovered = torch.zeros(Tq, dtype=torch.bool)
    uncovered[:5] = uncovered[40:60] = uncovered[140:] = True  # rows 50-59 read no key of either slice
    q, k, v, do, dlse = grad_inputs(Tq, Tk, Hq, Hkv, D, Dv, torch.bfloat16, seed, True)
    qr, kr, mt = _ranges(rows)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt)
    assert torch.isneginf(lse[uncovered]).all() and torch.isfinite(lse[~uncovered]).all()
    return (q, k, v, do, out, lse, dlse), (qr, kr, mt), uncovered


def test_two_launches_dq_first(monkeypatch):
    """The backward is two kernel launches, dQ first (it writes delta and lse * log2(e)), then dK/dV."""
    from flashrange.kernels import backward

    (q, k, v, do, out, lse, dlse), mask, _ = _uncovered_case()
    plan = backward.build_plan(*mask, q.shape[0], k.shape[0])
    launched = []
    real_launch = backward.launch

    def counting_launch(kernel, grid, args, **kw):
        launched.append(kernel)
        return real_launch(kernel, grid, args, **kw)

    monkeypatch.setattr(backward, "launch", counting_launch)
    got = range_attention_backward_triton(do, q, k, v, out, lse, *mask, None, 0.0, dlse, plan=plan)
    assert launched == [backward._bwd_dq_kernel, backward._bwd_dkdv_kernel]
    monkeypatch.undo()
    want = range_attention_backward_triton(do, q, k, v, out, lse, *mask, None, 0.0, dlse)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_dq_kernel_writes_every_workspace_entry(monkeypatch):
    """The dK/dV kernel reads delta and the scaled lse that the dQ programs wrote: a NaN-filled workspace must
    come back written for every row of every head (blocks with an empty window and rows past the last full
    tile included), with lse * log2(e) = +inf and delta = 0 exactly on rows no slice covers, and the
    gradients must not depend on what the workspace held before."""
    from flashrange.constants import PLAN_BLOCK
    from flashrange.kernels import backward
    from flashrange.kernels.common import LOG2E

    (q, k, v, do, out, lse, dlse), mask, uncovered = _uncovered_case()
    Tq, Hq = lse.shape
    seen = []

    def nan_workspace(Hq_, Tq_, device):
        seen.append(torch.full((2, Hq_, Tq_), float("nan"), dtype=torch.float32, device=device))
        return seen[-1]

    monkeypatch.setattr(backward, "_workspace", nan_workspace)
    for cfg in (None, BwdConfig(16, 16, 4, 1, 16, 16, 4, 1), BwdConfig(32, 32, 4, 1, PLAN_BLOCK, 16, 4, 1)):
        got = range_attention_backward_triton(do, q, k, v, out, lse, *mask, None, 0.0, dlse, config=cfg)
        ws = seen[-1]
        assert ws.shape == (2, Hq, Tq) and not torch.isnan(ws).any()
        delta, lse2 = ws[0].T, ws[1].T  # (Tq, Hq)
        assert torch.isposinf(lse2[uncovered]).all() and torch.count_nonzero(delta[uncovered]) == 0
        cov = ~uncovered
        torch.testing.assert_close(lse2[cov], lse[cov] * LOG2E, rtol=1e-6, atol=0)
        want_delta = (do.float() * out.float()).sum(-1) - dlse
        torch.testing.assert_close(delta[cov], want_delta[cov], rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(backward, "_workspace", lambda Hq_, Tq_, device: torch.zeros(2, Hq_, Tq_, device=device))
        clean = range_attention_backward_triton(do, q, k, v, out, lse, *mask, None, 0.0, dlse, config=cfg)
        monkeypatch.setattr(backward, "_workspace", nan_workspace)
        for a, b in zip(got, clean):
            assert torch.equal(a, b)


def test_uncovered_rows_with_nan_inputs():
    """Rows no slice covers hold NaN in q, dO, O and dlse: their dQ is exactly 0 and nothing else changes
    (dK, dV and the covered rows' dQ bitwise as with finite values there), also in blocks that slices visit."""
    (q, k, v, do, out, lse, dlse), mask, uncovered = _uncovered_case()
    want = range_attention_backward_triton(do, q, k, v, out, lse, *mask, None, 0.0, dlse)
    assert torch.isfinite(want[0]).all() and torch.count_nonzero(want[0][uncovered]) == 0
    bad = [t.clone() for t in (q, do, out, dlse)]
    for t in bad:
        t[uncovered] = float("nan")
    q_bad, do_bad, out_bad, dlse_bad = bad
    got = range_attention_backward_triton(do_bad, q_bad, k, v, out_bad, lse, *mask, None, 0.0, dlse_bad)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"{name}: {int(torch.isnan(a).sum())} NaN"


# ---------------------------------------------------------------------------------------------
# The query heads of a group split into chunks for the dK/dV kernel (BwdConfig.kv_head_chunks)

CHUNKED = [
    # (Hq, Hkv, chunks, D, Dv, dtype, softcap, with_dlse)
    pytest.param(4, 1, 2, 16, 16, torch.bfloat16, 0.0, False, id="mqa4-2chunks-bf16"),
    pytest.param(8, 2, 4, 40, 24, torch.float16, 5.0, True, id="gqa4-4chunks-D40-Dv24-softcap-dlse-fp16"),
    pytest.param(6, 2, 3, 16, 16, torch.float32, 0.0, True, id="gqa3-3chunks-dlse-fp32"),
]


def _dkdv_grids(monkeypatch):
    """The grid size of every dK/dV launch from now on (this test's), in order."""
    import flashrange.kernels.backward as bwd

    grids = []
    real_launch = bwd.launch

    def recording(kernel, grid, args, **kw):
        if kernel is bwd._bwd_dkdv_kernel:
            grids.append(grid[0])
        return real_launch(kernel, grid, args, **kw)

    monkeypatch.setattr(bwd, "launch", recording)
    return grids


@pytest.mark.parametrize("Hq, Hkv, chunks, D, Dv, dtype, softcap, with_dlse", CHUNKED)
def test_split_query_heads_of_a_group(Hq, Hkv, chunks, D, Dv, dtype, softcap, with_dlse, monkeypatch):
    """dK/dV from chunks of a group's query heads, added after the kernel: the kernel's grid has a program per
    chunk, the gradients are within the three-way budget, dQ is bitwise that of the unsplit call (its kernel
    is the same), and all are bitwise the same on a rerun, on a permuted slice list and with empty slices
    added."""
    grids = _dkdv_grids(monkeypatch)
    Tq, Tk = 97, 83
    rows = _random_rows(Tq, Tk, 6, seed=31, n_empty=1, uncovered=2)
    base = BwdConfig(32, 32, 4, 1, 32, 32, 4, 1)
    split = BwdConfig(32, 32, 4, 1, 32, 32, 4, 1, kv_head_chunks=chunks)
    (dq, dk, dv), (q, k, v, do, out, lse, dlse) = _check_grads(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, softcap=softcap,
                                                              with_dlse=with_dlse, seed=5, config=split)
    qr, kr, mt = _ranges(rows)
    unsplit = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, softcap, dlse, config=base)
    assert grids == [grids[1] * chunks, grids[1]]
    assert torch.equal(dq, unsplit[0])
    shuffled, padded = shuffled_and_padded(rows, random.Random(1), 3)
    for variant in (rows, shuffled, padded):
        qr, kr, mt = _ranges(variant)
        got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, softcap, dlse, config=split)
        for a, b in zip((dq, dk, dv), got):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n_items, group, n_sms, want", [
    pytest.param(64, 16, 132, 4, id="mqa-8k-h200"),       # 2 chunks: 128 items, short of 132
    pytest.param(64, 8, 132, 4, id="gqa8-4k"),
    pytest.param(132, 4, 132, 1, id="one-per-sm-already"),
    pytest.param(1024, 4, 132, 1, id="many-items"),
    pytest.param(10, 6, 25, 3, id="divisor-3"),            # 2 chunks: 20 items; 3: 30
    pytest.param(8, 3, 132, 3, id="none-enough-takes-the-group"),
    pytest.param(5, 1, 132, 1, id="mha-cannot-split"),
    pytest.param(5, 8, 0, 1, id="no-multiprocessor-count"),
])
def test_default_chunks_rule(n_items, group, n_sms, want):
    """The fewest chunks (a divisor of the group) that give every streaming multiprocessor a work item."""
    assert kv_head_chunks_for(n_items, group, n_sms) == want


@pytest.mark.parametrize("n_sms, want_chunks", [pytest.param(10**6, 4, id="many-sms-splits-the-group"),
                                                pytest.param(1, 1, id="one-sm-keeps-it")])
def test_default_call_splits_from_the_processor_count(n_sms, want_chunks, monkeypatch):
    """A call without a config splits as the rule says for the device's processor count (stood in for here:
    the interpreter has none), bitwise as the config with those chunks; a config passed in is kept."""
    import flashrange.kernels.backward as bwd

    grids = _dkdv_grids(monkeypatch)
    monkeypatch.setattr(bwd, "_processors", lambda device: n_sms)
    Tq, Tk, Hq, Hkv = 61, 70, 4, 1
    q, k, v, do, _ = grad_inputs(Tq, Tk, Hq, Hkv, 16, 16, torch.bfloat16, 3, False)
    qr, kr, mt = _ranges(_random_rows(Tq, Tk, 5, seed=8, n_empty=1, uncovered=1))
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt)
    config = dataclasses.replace(bwd.default_config(16, 16, torch.bfloat16, q.device), kv_head_chunks=want_chunks)
    want = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, config=config)
    range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt,
                                    config=bwd.default_config(16, 16, torch.bfloat16, q.device))
    assert grids[0] == grids[1] == grids[2] * want_chunks
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_split_query_heads_checks():
    """A chunk count that does not divide the group is refused with the fix; the fused backward takes none."""
    q, k, v, do, _ = grad_inputs(17, 17, 6, 2, 16, 16, torch.bfloat16, 0, False)
    qr, kr, mt = _ranges([(0, 17, 0, 17, CAUSAL)])
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt)
    with pytest.raises(ValueError, match="kv_head_chunks=2 must divide the query heads per KV head, 3"):
        range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt,
                                        config=BwdConfig(32, 32, 4, 1, 32, 32, 4, 1, kv_head_chunks=2))
    with pytest.raises(ValueError, match="positive int"):
        BwdConfig(32, 32, 4, 1, 32, 32, 4, 1, kv_head_chunks=0)
    with pytest.raises(ValueError, match="leave it 1 with fused_dq"):
        BwdConfig(32, 32, 4, 1, 32, 32, 4, 1, fused_dq=True, kv_head_chunks=2)
