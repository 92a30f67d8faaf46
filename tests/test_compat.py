"""Drop-in front-ends against the definitions they promise.

``flash_attn_func`` / ``flash_attn_varlen_func`` against FlashAttention-3's
mask written as inequalities (``tests/golden.py``: bottom-right causal with
``Sq != Sk``, windows ``(-1, 0)``, ``(w, 0)``, ``(l, r)``, right-only),
softcap, GQA, FA3's lse layouts, ``seqused``; inputs are float64 so that the
CPU path (the reference) must match the dense golden to ~1e-10.
``flex_flash_attn_func`` must equal ``range_attention`` bit for bit. The
FA3 front-ends build their slices on the device: they must trace with
``fullgraph=True`` (no graph break, so no host read).
"""

from __future__ import annotations

import pytest
import torch

from flashrange import (
    BI_CAUSAL,
    CAUSAL,
    FULL,
    INV_CAUSAL,
    RangeMask,
    flash_attn_func,
    flash_attn_varlen_func,
    flex_flash_attn_func,
    range_attention,
)
from golden import dense_attention, dense_counts, fa3_window_counts, max_err

F64_TOL = 1e-10


def _randn(*shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


# (B, Sq, Sk, Hq, Hkv, D, Dv, causal, window_size, softcap)
FA_CASES = [
    pytest.param(2, 9, 9, 2, 2, 16, 16, False, (-1, -1), 0.0, id="full-B2-S9"),
    pytest.param(2, 9, 9, 2, 2, 16, 16, True, (-1, -1), 0.0, id="causal-S9"),
    pytest.param(3, 7, 13, 4, 2, 16, 8, True, (-1, -1), 0.0, id="causal-Sq7-Sk13-gqa2-Dv8"),
    pytest.param(2, 13, 7, 4, 1, 8, 8, True, (-1, -1), 0.0, id="causal-Sq13-Sk7-mqa-empty-top-rows"),
    pytest.param(2, 11, 11, 2, 1, 16, 16, False, (-1, 0), 0.0, id="window(-1,0)-is-causal"),
    pytest.param(2, 15, 15, 2, 2, 16, 16, False, (4, 0), 0.0, id="window(4,0)"),
    pytest.param(1, 15, 19, 3, 1, 16, 24, True, (3, -1), 2.0, id="causal-window(3,-1)-softcap-Dv24"),
    pytest.param(2, 17, 11, 4, 2, 8, 8, False, (2, 3), 0.0, id="window(2,3)-Sq17-Sk11"),
    pytest.param(2, 11, 17, 2, 2, 8, 8, False, (-1, 2), 5.0, id="window(-1,2)-right-only-softcap"),
    pytest.param(1, 1, 9, 2, 1, 16, 16, True, (-1, -1), 0.0, id="decode-Sq1-causal"),
]


@pytest.mark.parametrize("B, Sq, Sk, Hq, Hkv, D, Dv, causal, window_size, softcap", FA_CASES)
def test_flash_attn_func_matches_fa3_definition(B, Sq, Sk, Hq, Hkv, D, Dv, causal, window_size, softcap):
    q = _randn(B, Sq, Hq, D, seed=1)
    k = _randn(B, Sk, Hkv, D, seed=2)
    v = _randn(B, Sk, Hkv, Dv, seed=3)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap, return_attn_probs=True)
    assert out.shape == (B, Sq, Hq, Dv) and lse.shape == (B, Hq, Sq) and lse.is_contiguous()
    counts = fa3_window_counts(Sq, Sk, causal, window_size)
    for b in range(B):
        gold_out, gold_lse = dense_attention(q[b], k[b], v[b], counts, softcap=softcap)
        assert max_err(out[b], gold_out) < F64_TOL
        assert max_err(lse[b], gold_lse.transpose(0, 1)) < F64_TOL
    only_out = flash_attn_func(q, k, v, causal=causal, window_size=window_size, softcap=softcap)
    assert isinstance(only_out, torch.Tensor) and torch.equal(only_out, out)


def test_flash_attn_func_gradients_match_autograd():
    B, Sq, Sk, Hq, Hkv, D = 2, 11, 14, 4, 2, 8
    q = _randn(B, Sq, Hq, D, seed=4).requires_grad_(True)
    k = _randn(B, Sk, Hkv, D, seed=5).requires_grad_(True)
    v = _randn(B, Sk, Hkv, D, seed=6).requires_grad_(True)
    dout = _randn(B, Sq, Hq, D, seed=7)
    dlse = _randn(B, Hq, Sq, seed=8)
    ws = (5, 1)
    out, lse = flash_attn_func(q, k, v, causal=False, window_size=ws, softmax_scale=0.3, return_attn_probs=True)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    counts = fa3_window_counts(Sq, Sk, False, ws)
    loss = 0
    for b in range(B):
        o, l = dense_attention(q[b], k[b], v[b], counts, softmax_scale=0.3)
        loss = loss + (o * dout[b]).sum() + (l.transpose(0, 1) * dlse[b]).sum()
    gold = torch.autograd.grad(loss, (q, k, v))
    for g, e in zip(grads, gold):
        assert max_err(g, e) < F64_TOL


def _varlen_golden(q, k, v, cu_q, cu_k, used_q, used_k, causal, ws, softcap):
    counts = torch.zeros(q.shape[0], k.shape[0], dtype=torch.int32)
    for b in range(len(cu_q) - 1):
        lq, lk = used_q[b], used_k[b]
        counts[cu_q[b]:cu_q[b] + lq, cu_k[b]:cu_k[b] + lk] = fa3_window_counts(lq, lk, causal, ws)
    return dense_attention(q, k, v, counts, softcap=softcap)


# (cu_q, cu_k, seqused_q, seqused_k, causal, window_size, softcap)
VARLEN_CASES = [
    pytest.param([0, 5, 12, 13], [0, 5, 12, 13], None, None, True, (-1, -1), 0.0, id="causal-3docs"),
    pytest.param([0, 5, 12, 13], [0, 9, 11, 20], None, None, True, (-1, -1), 0.0, id="causal-Lq!=Lk"),
    pytest.param([0, 0, 7, 7, 10], [0, 3, 3, 8, 15], None, None, False, (2, 1), 0.0, id="window(2,1)-empty-docs"),
    pytest.param([0, 9, 20], [0, 9, 20], None, None, False, (3, 0), 3.0, id="window(3,0)-softcap"),
    pytest.param([0, 9, 20], [0, 12, 20], [6, 11], None, True, (-1, -1), 0.0, id="seqused_q"),
    pytest.param([0, 9, 20], [0, 12, 20], None, [7, 2], True, (4, -1), 0.0, id="seqused_k-causal-window"),
    pytest.param([0, 9, 20], [0, 12, 20], [0, 5], [12, 0], False, (-1, -1), 0.0, id="seqused-zero"),
]


@pytest.mark.parametrize("cu_q, cu_k, seqused_q, seqused_k, causal, window_size, softcap", VARLEN_CASES)
@pytest.mark.parametrize("Hq, Hkv", [pytest.param(2, 2, id="mha"), pytest.param(4, 1, id="mqa4")])
def test_flash_attn_varlen_func_matches_fa3_definition(cu_q, cu_k, seqused_q, seqused_k, causal, window_size, softcap, Hq, Hkv):
    D, Dv = 16, 8
    q = _randn(cu_q[-1], Hq, D, seed=11)
    k = _randn(cu_k[-1], Hkv, D, seed=12)
    v = _randn(cu_k[-1], Hkv, Dv, seed=13)
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32)  # noqa: E731
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    out, lse = flash_attn_varlen_func(
        q, k, v, t(cu_q), t(cu_k), max(lens_q), max(lens_k), seqused_q=t(seqused_q), seqused_k=t(seqused_k),
        causal=causal, window_size=window_size, softcap=softcap, return_attn_probs=True,
    )
    assert out.shape == (cu_q[-1], Hq, Dv) and lse.shape == (Hq, cu_q[-1])
    gold_out, gold_lse = _varlen_golden(
        q, k, v, cu_q, cu_k, seqused_q or lens_q, seqused_k or lens_k, causal, window_size, softcap
    )
    assert max_err(out, gold_out) < F64_TOL
    assert max_err(lse, gold_lse.transpose(0, 1)) < F64_TOL
    if seqused_q is not None:  # rows past seqused_q: out 0, lse -inf
        for b, used in enumerate(seqused_q):
            rows = slice(cu_q[b] + used, cu_q[b + 1])
            assert torch.equal(out[rows], torch.zeros_like(out[rows]))
            assert bool((lse[:, rows] == float("-inf")).all())


def test_bf16_keeps_dtypes_and_layouts():
    q = _randn(2, 7, 4, 16, seed=14, dtype=torch.bfloat16)
    k = _randn(2, 9, 2, 16, seed=15, dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 4, 7)
    # The same call written as ranges gives the same bits.
    mask = RangeMask.varlen([0, 7, 14], [0, 9, 18], causal=True)
    o2, l2 = range_attention(q.reshape(14, 4, 16), k.reshape(18, 2, 16), k.reshape(18, 2, 16), *mask.tensors())
    assert torch.equal(out.reshape(14, 4, 16), o2) and torch.equal(lse, l2.view(2, 7, 4).transpose(1, 2))


def test_fa3_speed_flags_accepted():
    q = _randn(1, 5, 2, 8, seed=16)
    base = flash_attn_func(q, q, q, causal=True)
    same = flash_attn_func(q, q, q, causal=True, deterministic=True, num_splits=1, pack_gqa=None, sm_margin=0)
    assert torch.equal(base, same)


def _ffa_inputs(seed):
    Tq, Tk = 19, 23
    q = _randn(Tq, 4, 16, seed=seed)
    k = _randn(Tk, 2, 16, seed=seed + 1)
    v = _randn(Tk, 2, 8, seed=seed + 2)
    q_ranges = torch.tensor([[0, 7], [5, 19], [0, 0], [10, 11]], dtype=torch.int32)
    k_ranges = torch.tensor([[0, 23], [3, 17], [0, 0], [22, 23]], dtype=torch.int32)
    types = torch.tensor([CAUSAL, BI_CAUSAL, FULL, INV_CAUSAL], dtype=torch.int32)
    return q, k, v, q_ranges, k_ranges, types


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64"), pytest.param(torch.bfloat16, id="bf16")])
def test_flex_flash_attn_func_equals_range_attention(dtype):
    q, k, v, q_ranges, k_ranges, types = _ffa_inputs(20)
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    out, lse = flex_flash_attn_func(
        q, k, v, q_ranges, k_ranges, attn_type_map=types, softmax_scale=0.2, softcap=4.0, deterministic=True,
        sm_margin=0, disable_fwd_atomic_reduction=True, auto_range_merge=False, ref_block_size=None,
    )
    out2, lse2 = range_attention(q, k, v, q_ranges, k_ranges, types, softmax_scale=0.2, softcap=4.0)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    dout = torch.ones_like(out)
    g1 = torch.autograd.grad((out * dout).sum() + lse.nan_to_num(neginf=0).sum(), (q, k, v))
    g2 = torch.autograd.grad((out2 * dout).sum() + lse2.nan_to_num(neginf=0).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_flex_flash_attn_func_defaults_and_old_positional_order():
    q, k, v, q_ranges, k_ranges, types = _ffa_inputs(30)
    out, lse = flex_flash_attn_func(q, k, v, q_ranges, k_ranges)
    full = torch.zeros(4, dtype=torch.int32)
    ref_out, ref_lse = range_attention(q, k, v, q_ranges, k_ranges, full)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # Older MagiAttention order: (..., k_ranges, max_seqlen_q, max_seqlen_k, attn_type_map).
    old_out, old_lse = flex_flash_attn_func(q, k, v, q_ranges, k_ranges, 19, 23, types)
    new_out, new_lse = flex_flash_attn_func(q, k, v, q_ranges, k_ranges, types, 19, 23)
    assert torch.equal(old_out, new_out) and torch.equal(old_lse, new_lse)
    gold_out, _ = dense_attention(q, k, v, dense_counts(q_ranges, k_ranges, types, 19, 23))
    assert max_err(new_out, gold_out) < F64_TOL


def test_fa3_front_ends_trace_fullgraph_without_host_reads():
    """``fullgraph=True`` fails on any graph break, e.g. a ``.item()`` / ``.tolist()`` in the slice building."""
    torch._dynamo.reset()
    cu = torch.tensor([0, 4, 11, 17], dtype=torch.int32)
    used = torch.tensor([4, 5, 6], dtype=torch.int32)
    q = _randn(17, 2, 8, seed=40)

    def varlen(q, cu, used):
        return flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, seqused_k=used, window_size=(2, 1), return_attn_probs=True)

    def padded(q):
        return flash_attn_func(q, q, q, causal=True, window_size=(3, 0), return_attn_probs=True)

    for fn, args in ((varlen, (q, cu, used)), (padded, (q[:16].reshape(2, 8, 2, 8),))):
        got = torch.compile(fn, backend="eager", fullgraph=True)(*args)
        want = fn(*args)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
