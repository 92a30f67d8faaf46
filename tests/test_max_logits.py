"""Max logits (MagiAttention's ``return_max_logits``, the statistic of QK-clip / MuonClip).

The golden is written here from its definition: per query head, the largest
score ``softcap * tanh(scale * q_i . k_j / softcap)`` (or ``scale * q_i . k_j``)
over the cells that ``golden.dense_counts`` marks covered, in float64 on the
same (rounded) inputs; ``-inf`` for a head with no covered cell. It is checked
on the reference (the CPU path), on the Triton forward kernel under the
interpreter (the row max of its online softmax), through ``range_attention``
and ``flex_flash_attn_func`` (MagiAttention's ``(out, meta)`` return), with
sinks (excluded from the statistic), under ``torch.compile(fullgraph=True)``
and with ``opcheck`` on the ``flashrange::fwd_max_logits`` op.
"""

from __future__ import annotations

import random

import pytest
import torch

import flashrange
from flashrange import reference
from flashrange.compat import AttnForwardMeta
from golden import dense_counts, random_slice_rows

triton = pytest.importorskip("triton")

from flashrange.kernels.forward import range_attention_forward_triton  # noqa: E402

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3


def golden_max_logits(q, k, counts, scale, softcap=0.0):
    """Float64 `(Hq,)`: each head's largest score over the covered cells of ``counts`` `(Tq, Tk)`."""
    q, k = q.double(), k.double()
    G = q.shape[1] // k.shape[1]
    s = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(G, dim=1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = torch.where(counts[None] > 0, s, float("-inf"))
    return s.reshape(s.shape[0], -1).amax(dim=1) if s.numel() else torch.full((q.shape[1],), float("-inf"))


def _ranges(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _qkv(Tq, Tk, Hq, Hkv, D, dtype, seed, scale_q=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(Tq, Hq, D, generator=g) * scale_q).to(dtype)
    k = torch.randn(Tk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(Tk, Hkv, D, generator=g).to(dtype)
    return q, k, v


def _assert_close(got, gold, name):
    """Float32 scores of exact low-precision products: a few float32 ulps of the dot products' size."""
    assert got.shape == gold.shape, name
    assert torch.equal(torch.isneginf(got), torch.isneginf(gold)), f"{name}: -inf heads {got} vs {gold}"
    fin = torch.isfinite(gold)
    tol = 1e-5 * (1 + gold[fin].abs())
    assert ((got[fin].double() - gold[fin]).abs() <= tol).all(), f"{name}: {got} vs golden {gold}"


# (Tq, Tk, Hq, Hkv, D, dtype, scale, softcap)
CASES = [
    pytest.param(37, 41, 4, 2, 16, torch.bfloat16, 0.25, 0.0, id="gqa2-bf16"),
    pytest.param(70, 33, 2, 1, 24, torch.float16, 0.3, 5.0, id="softcap-fp16"),
    pytest.param(29, 29, 2, 2, 16, torch.float32, -0.2, 0.0, id="negative-scale-fp32"),
]


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D,dtype,scale,softcap", CASES)
def test_reference_and_kernel_against_golden(Tq, Tk, Hq, Hkv, D, dtype, scale, softcap):
    """Random masks with overlaps (a cell covered twice still has one score), empty slices, uncovered rows."""
    q, k, v = _qkv(Tq, Tk, Hq, Hkv, D, dtype, seed=Tq + D, scale_q=3.0 if softcap else 1.0)
    rows = random_slice_rows(Tq, Tk, 5, random.Random(Tq * 3 + Tk), n_empty=2, uncovered=4)
    qr, kr, mt = _ranges(rows)
    gold = golden_max_logits(q, k, dense_counts(qr, kr, mt, Tq, Tk), scale, softcap)
    ref = reference.range_attention_max_logits(q, k, qr, kr, mt, scale, softcap)
    assert ref.dtype == torch.float32
    _assert_close(ref, gold, "reference")
    out, lse, got = range_attention_forward_triton(q, k, v, qr, kr, mt, scale, softcap, return_max_logits=True)
    assert got.dtype == torch.float32 and got.shape == (Hq,)
    _assert_close(got, gold, "kernel")
    # Asking for the statistic changes no bit of the attention.
    out0, lse0 = range_attention_forward_triton(q, k, v, qr, kr, mt, scale, softcap)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_float64_reference_is_exact():
    q, k, _ = _qkv(19, 23, 4, 1, 8, torch.float64, seed=3)
    qr, kr, mt = _ranges([(0, 19, 0, 23, CAUSAL), (4, 9, 10, 23, INV_CAUSAL), (0, 0, 0, 0, FULL)])
    gold = golden_max_logits(q, k, dense_counts(qr, kr, mt, 19, 23), 0.4, 2.0)
    got = reference.range_attention_max_logits(q, k, qr, kr, mt, 0.4, 2.0)
    assert got.dtype == torch.float64
    assert (got - gold).abs().max() < 1e-12


def test_max_is_taken_over_covered_cells_only():
    """A huge score on a cell no slice covers (the row above a causal diagonal) must not count."""
    T, D = 20, 16
    q, k, v = _qkv(T, T, 2, 2, D, torch.float32, seed=4)
    k[T - 1] = q[0] * 50  # key T-1 meets query 0 only above the diagonal
    qr, kr, mt = _ranges([(0, T, 0, T, CAUSAL)])
    gold = golden_max_logits(q, k, dense_counts(qr, kr, mt, T, T), 0.25)
    full = golden_max_logits(q, k, torch.ones(T, T, dtype=torch.int32), 0.25)
    assert (full > gold + 10).all()
    _assert_close(reference.range_attention_max_logits(q, k, qr, kr, mt, 0.25), gold, "reference")
    _assert_close(range_attention_forward_triton(q, k, v, qr, kr, mt, 0.25, return_max_logits=True)[2], gold,
                  "kernel")


@pytest.mark.parametrize(
    "Tq, Tk, rows",
    [
        pytest.param(9, 7, [], id="no-slices"),
        pytest.param(9, 7, [(0, 0, 0, 0, FULL), (3, 3, 0, 7, CAUSAL)], id="all-empty"),
        pytest.param(9, 7, [(0, 5, 0, 2, BI_CAUSAL)], id="bicausal-taller-than-wide"),
        pytest.param(0, 7, [(0, 0, 0, 7, FULL)], id="Tq0"),
        pytest.param(9, 0, [(0, 9, 0, 0, FULL)], id="Tk0"),
    ],
)
def test_nothing_covered_gives_minus_inf(Tq, Tk, rows):
    q, k, v = _qkv(Tq, Tk, 3, 1, 16, torch.bfloat16, seed=6)
    qr, kr, mt = _ranges(rows) if rows else (torch.zeros(0, 2, dtype=torch.int32),) * 2 + (
        torch.zeros(0, dtype=torch.int32),)
    want = torch.full((3,), float("-inf"))
    assert torch.equal(reference.range_attention_max_logits(q, k, qr, kr, mt, 0.25), want)
    assert torch.equal(range_attention_forward_triton(q, k, v, qr, kr, mt, 0.25, return_max_logits=True)[2], want)
    assert torch.equal(flashrange.range_attention(q, k, v, qr, kr, mt, return_max_logits=True)[2], want)


def test_range_attention_returns_three_and_keeps_gradients():
    """``(out, lse, max_logits)``: max logits carry no gradient; out, lse and every gradient are bitwise those of a
    call without the flag."""
    q, k, v = _qkv(23, 31, 4, 2, 16, torch.float32, seed=7)
    qr, kr, mt = _ranges([(0, 23, 0, 31, CAUSAL), (5, 15, 0, 10, FULL)])
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse, ml = flashrange.range_attention(*leaves, qr, kr, mt, softmax_scale=0.3, return_max_logits=True)
    assert not ml.requires_grad and ml.shape == (4,)
    _assert_close(ml, golden_max_logits(q, k, dense_counts(qr, kr, mt, 23, 31), 0.3), "range_attention")
    g = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), leaves)
    leaves0 = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out0, lse0 = flashrange.range_attention(*leaves0, qr, kr, mt, softmax_scale=0.3)
    grads0 = torch.autograd.grad((out0 * dout).sum() + (lse0 * dlse).sum(), leaves0)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    for a, b in zip(grads, grads0):
        assert torch.equal(a, b)


def test_flex_flash_attn_func_meta_and_sinks():
    """MagiAttention's return structure: ``(out, meta)`` with ``meta.lse`` and ``meta.max_logits``; sinks change lse
    but not the max logits."""
    q, k, v = _qkv(17, 17, 2, 1, 16, torch.bfloat16, seed=8)
    qr, kr, mt = _ranges([(0, 17, 0, 17, CAUSAL)])
    out, meta = flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt, return_max_logits=True)
    assert isinstance(meta, AttnForwardMeta)
    o2, l2 = flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt)
    assert torch.equal(out, o2) and torch.equal(meta.lse, l2)
    _assert_close(meta.max_logits, golden_max_logits(q, k, dense_counts(qr, kr, mt, 17, 17), 16 ** -0.5), "ffa")
    sink = torch.tensor([[3.0, -1.0]])
    out_s, meta_s = flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt, sink=sink, return_max_logits=True)
    assert torch.equal(meta_s.max_logits, meta.max_logits)
    assert (meta_s.lse > meta.lse).all()


def test_compiled_fullgraph():
    torch._dynamo.reset()
    q, k, v = _qkv(21, 21, 2, 1, 16, torch.float32, seed=9)
    qr, kr, mt = _ranges([(0, 21, 0, 21, CAUSAL), (0, 0, 0, 0, FULL)])

    def f(q, k, v, qr, kr, mt):
        out, lse, ml = flashrange.range_attention(q, k, v, qr, kr, mt, return_max_logits=True)
        return out.sum() + ml.sum(), ml

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, qr, kr, mt)
    want = f(q, k, v, qr, kr, mt)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    # New slice values, same shapes: the same graph serves.
    qr2, kr2, mt2 = _ranges([(3, 21, 0, 15, FULL), (0, 2, 0, 21, BI_CAUSAL)])
    assert torch.equal(compiled(q, k, v, qr2, kr2, mt2)[1], f(q, k, v, qr2, kr2, mt2)[1])
    torch._dynamo.reset()


ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "nograd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_fwd_max_logits(requires_grad, dtype):
    q, k, v = _qkv(13, 19, 4, 2, 8, dtype, seed=10)
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    qr, kr, mt = _ranges([(0, 13, 0, 19, CAUSAL), (0, 0, 0, 0, FULL), (2, 9, 4, 12, INV_CAUSAL)])
    plan = list(torch.ops.flashrange.plan(qr, kr, mt, 13, 19))
    torch.library.opcheck(
        torch.ops.flashrange.fwd_max_logits.default, (q, k, v, qr, kr, mt, plan, 0.3, 2.0), test_utils=ALL_TESTS
    )


def test_eager_function_plumbing_on_the_interpreter():
    """``ops.fwd_eager(..., return_max_logits=True)`` (the autograd function eager CUDA calls use) runs the Triton
    kernels directly; under the interpreter it takes CPU tensors: same bits as the launchers, max logits without
    gradient, and the backward of ``out`` and ``lse`` unchanged."""
    from flashrange import ops
    from flashrange.kernels.backward import range_attention_backward_triton

    q, k, v = _qkv(21, 27, 4, 2, 16, torch.float16, seed=11)
    qr, kr, mt = _ranges([(0, 21, 0, 27, CAUSAL), (0, 0, 0, 0, FULL), (3, 9, 0, 12, FULL)])
    plan = flashrange.plan_mask(qr, kr, mt, 21, 27)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse, ml = ops.fwd_eager(*leaves, qr, kr, mt, plan, 0.25, 0.0, True)
    assert not ml.requires_grad and out.requires_grad
    want = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.25, plan=plan, return_max_logits=True)
    for a, b in zip((out, lse, ml), want):
        assert torch.equal(a.detach(), b)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((out.float() * dout.float()).sum() + (lse * dlse).sum(), leaves)
    want = range_attention_backward_triton(dout, q, k, v, want[0], want[1], qr, kr, mt, 0.25, 0.0, dlse, plan=plan)
    for a, b in zip(grads, want):
        assert torch.equal(a, b)
