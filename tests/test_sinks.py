"""Learnable attention sinks (GPT-OSS; MagiAttention's ``sink``, FlashAttention-4's ``learnable_sink``).

Contract (docs/features.md): ``sink`` `(S_sink, Hq)` adds logits to every
row's softmax denominator that carry no value:
``lse_i = log(sum_j exp(s_ij) + sum_t exp(sink_t))``,
``out_i = sum_j exp(s_ij - lse_i) v_j``; a row no slice covers gets
``out = 0`` and ``lse = logsumexp(sink)``. Differentiable in q, k, v and sink.

The golden is written here, in float64, the way MagiAttention's torch
reference writes it: the dense scores of ``golden.dense_counts`` with the
sink logits appended as extra columns, one logsumexp over the row, and the
sink columns dropped before ``p @ v``; its gradients come from autograd.
Checked: the CPU path (reference op + sink merge) in float64 to ~1e-12; the
Triton kernels under the interpreter, forward and backward, with the
three-way rule; uncovered rows and empty masks; ``-inf`` sinks (no sink);
every front-end's spelling; ``torch.compile(fullgraph=True)`` of a training
step.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

import flashrange
from flashrange import reference
from flashrange.interface import merge_sink
from golden import assert_sink_three_way, dense_counts, fa3_window_counts, random_slice_rows

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------
# Golden


def golden_sink_attention(q, k, v, counts, sink, softmax_scale=None, softcap=0.0):
    """Float64 `(out, lse)` with sinks; `q` `(Tq, Hq, D)`, `k` `(Tk, Hkv, D)`, `v` `(Tk, Hkv, Dv)`,
    `counts` `(Tq, Tk)`, `sink` `(S_sink, Hq)` (finite). Differentiable in q, k, v, sink."""
    q, k, v, sink = q.double(), k.double(), v.double(), sink.double()
    Tq, Hq, D = q.shape
    Tk = k.shape[0]
    G = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    s = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(G, dim=1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    # A cell covered c times weighs c; an uncovered cell is -inf (where(): no NaN gradient).
    weight = torch.log(counts.double().clamp_min(1))
    logits = torch.where(counts[None] > 0, s + weight, float("-inf"))
    logits = torch.cat([logits, sink.t()[:, None, :].expand(Hq, Tq, sink.shape[0])], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)  # (Hq, Tq): finite, the sinks are in every row
    p = torch.exp(logits - lse[..., None])[..., :Tk]
    out = torch.einsum("hij,jhd->ihd", p, v.repeat_interleave(G, dim=1))
    return out, lse.t()


def _golden_grads(q, k, v, counts, sink, scale, softcap, dout, dlse):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, sink)]
    out, lse = golden_sink_attention(*leaves[:3], counts, leaves[3], scale, softcap)
    loss = (out * dout.double()).sum() + (lse * dlse.double()).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)


def _ranges(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _inputs(Tq, Tk, Hq, Hkv, D, Dv, S_sink, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, Hq, D, generator=g).to(dtype)
    k = torch.randn(Tk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(Tk, Hkv, Dv, generator=g).to(dtype)
    sink = torch.randn(S_sink, Hq, generator=g) * 2
    dout = torch.randn(Tq, Hq, Dv, generator=g).to(dtype)
    dlse = torch.randn(Tq, Hq, generator=g)
    return q, k, v, sink, dout, dlse


def _grads(fn, q, k, v, sink, dout, dlse):
    """``(out, lse, (dq, dk, dv, dsink))`` of ``fn(q, k, v, sink) -> (out, lse)``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sink)]
    out, lse = fn(*leaves)
    loss = (out.float() * dout.float()).sum() + (lse * dlse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return out.detach(), lse.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


# ---------------------------------------------------------------------------------------------
# The CPU path in float64


MASKS = [
    pytest.param(23, 29, 4, 2, 1, 0.0, id="gqa2-one-sink"),
    pytest.param(31, 17, 2, 1, 3, 0.0, id="mqa-three-sinks"),
    pytest.param(19, 19, 2, 2, 2, 4.0, id="softcap-two-sinks"),
]


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,S_sink,softcap", MASKS)
def test_reference_float64_matches_golden(Tq, Tk, Hq, Hkv, S_sink, softcap):
    """Random masks (every type, overlaps, empty slices, uncovered rows): forward and every gradient, sink's too."""
    q, k, v, sink, dout, dlse = _inputs(Tq, Tk, Hq, Hkv, 8, 12, S_sink, torch.float64, seed=Tq + S_sink)
    sink = sink.double()
    qr, kr, mt = _ranges(random_slice_rows(Tq, Tk, 5, random.Random(Tq * Tk), n_empty=2, uncovered=3))
    counts = dense_counts(qr, kr, mt, Tq, Tk)
    gold_out, gold_lse, gold_grads = _golden_grads(q, k, v, counts, sink, 0.3, softcap, dout, dlse)

    def fn(q, k, v, sink):
        return flashrange.range_attention(q, k, v, qr, kr, mt, softmax_scale=0.3, softcap=softcap, sink=sink)

    out, lse, grads = _grads(fn, q, k, v, sink, dout, dlse)
    assert out.dtype == lse.dtype == torch.float64
    assert (out - gold_out).abs().max() < 1e-12 and (lse - gold_lse).abs().max() < 1e-12
    for name, got, gold in zip(("dq", "dk", "dv", "dsink"), grads, gold_grads):
        assert (got - gold).abs().max() < 1e-11, name


def test_uncovered_rows_and_empty_masks():
    """A row no slice covers: out = 0, lse = logsumexp(sink), no gradient to its q; dsink gets its dlse."""
    Tq, Tk, Hq = 13, 9, 2
    q, k, v, sink, dout, dlse = _inputs(Tq, Tk, Hq, 1, 8, 8, 2, torch.float64, seed=1)
    sink = sink.double()
    L = torch.logsumexp(sink, dim=0)
    for rows in ([(0, 6, 0, 9, CAUSAL)], [(0, 0, 0, 0, FULL)], []):
        qr, kr, mt = _ranges(rows) if rows else (torch.zeros(0, 2, dtype=torch.int32),) * 2 + (
            torch.zeros(0, dtype=torch.int32),)
        covered = dense_counts(qr, kr, mt, Tq, Tk).any(dim=1) if rows else torch.zeros(Tq, dtype=torch.bool)

        def fn(q, k, v, sink):
            return flashrange.range_attention(q, k, v, qr, kr, mt, sink=sink)

        out, lse, (dq, dk, dv, dsink) = _grads(fn, q, k, v, sink, dout, dlse)
        assert (out[~covered] == 0).all()
        assert (lse[~covered] - L).abs().max() < 1e-14
        assert (dq[~covered] == 0).all()
        gold = _golden_grads(q, k, v, dense_counts(qr, kr, mt, Tq, Tk), sink, None, 0.0, dout, dlse)
        assert (dsink - gold[2][3]).abs().max() < 1e-12
        if not covered.any():
            # Only the sinks: d sink_t = sum_i dlse_i * softmax(sink)_t.
            want = dlse.double().sum(0) * torch.softmax(sink, dim=0)
            assert (dsink - want).abs().max() < 1e-12


def test_minus_inf_sinks_are_no_sinks():
    """A head whose sinks are all -inf behaves bitwise as without sinks, and every gradient stays finite."""
    q, k, v, _, dout, dlse = _inputs(17, 17, 2, 1, 8, 8, 1, torch.float32, seed=2)
    qr, kr, mt = _ranges([(0, 10, 0, 17, CAUSAL)])  # rows 10..16 uncovered
    sink = torch.full((2, 2), float("-inf"))

    out, lse, (dq, dk, dv, dsink) = _grads(
        lambda q, k, v, s: flashrange.range_attention(q, k, v, qr, kr, mt, sink=s), q, k, v, sink, dout, dlse
    )
    finite = torch.isfinite(lse)
    out0, lse0, grads0 = _grads(
        lambda q, k, v, s: flashrange.range_attention(q, k, v, qr, kr, mt), q, k, v, sink, dout,
        torch.where(finite, dlse, torch.zeros_like(dlse)),
    )
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    assert torch.isneginf(lse[10:]).all()
    for got in (dq, dk, dv, dsink):
        assert torch.isfinite(got).all()
    assert (dsink == 0).all()


def test_sink_dtypes():
    """float32 is the usual sink dtype; bf16 / fp16 sinks (FA4 takes them) are upcast, their gradients cast back."""
    q, k, v, sink, _, _ = _inputs(11, 11, 2, 2, 8, 8, 1, torch.bfloat16, seed=3)
    qr, kr, mt = _ranges([(0, 11, 0, 11, CAUSAL)])
    want_out, want_lse = flashrange.range_attention(q, k, v, qr, kr, mt, sink=sink.to(torch.bfloat16).float())
    s16 = sink.to(torch.bfloat16).requires_grad_(True)
    out, lse = flashrange.range_attention(q, k, v, qr, kr, mt, sink=s16)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and lse.dtype == torch.float32
    lse.sum().backward()
    assert s16.grad.dtype == torch.bfloat16 and torch.isfinite(s16.grad).all()


# ---------------------------------------------------------------------------------------------
# The Triton kernels (interpreter on the CPU), composed with the sink merge as on the GPU


def attention_function(forward, backward):
    """An autograd function ``(q, k, v, qr, kr, mt, scale) -> (out, lse)`` from a forward and a backward with the
    signatures of :mod:`flashrange.reference`'s (softcap 0)."""

    class _Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, qr, kr, mt, scale):
            out, lse = forward(q, k, v, qr, kr, mt, scale)
            ctx.save_for_backward(q, k, v, out, lse, qr, kr, mt)
            ctx.scale = scale
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, qr, kr, mt = ctx.saved_tensors
            dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, qr, kr, mt, ctx.scale, 0.0, dlse.contiguous())
            return dq, dk, dv, None, None, None, None

    return _Attention


def replay_function(backward):
    """An autograd function ``(q, k, v, out, lse, qr, kr, mt, scale) -> (out, lse)`` that returns the given forward
    outputs and differentiates them with ``backward`` (the signature of :mod:`flashrange.reference`'s, softcap 0).

    The yardstick of the gradients in the three-way rule: the reference backward run on the candidate's own
    forward outputs. A backward's result depends on the forward's ``out`` (``delta = rowsum(dO * O) - dlse``,
    and the sink merge's terms), so the reference must see the same ``out`` as the candidate; given its own,
    more accurate one (float32 P, one rounding) the comparison charges the candidate's backward with its
    forward's error (see :func:`golden.assert_sink_three_way`).
    """

    class _Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, out, lse, qr, kr, mt, scale):
            ctx.save_for_backward(q, k, v, out, lse, qr, kr, mt)
            ctx.scale = scale
            return out.clone(), lse.clone()

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, qr, kr, mt = ctx.saved_tensors
            dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, qr, kr, mt, ctx.scale, 0.0, dlse.contiguous())
            return dq, dk, dv, None, None, None, None, None, None

    return _Replay


# The reference backward on given forward outputs.
_RefReplay = replay_function(reference.range_attention_backward)


def _triton_forward(*args):
    from flashrange.kernels.forward import range_attention_forward_triton

    return range_attention_forward_triton(*args)


def _triton_backward(*args):
    from flashrange.kernels.backward import range_attention_backward_triton

    return range_attention_backward_triton(*args)


# The Triton backward on given forward outputs (the Triton forward's): the GPU path of the ops, called directly.
_KernelReplay = replay_function(_triton_backward)


def _kernels_three_way(q, k, v, sink, dout, dlse, qr, kr, mt, scale, dsink_atol, grads_hook=None):
    """The kernels composed with the sink merge against the float64 golden, by the three-way rule.

    The yardstick: the CPU path (reference op + merge) for ``out`` and ``lse``; for the gradients, the
    reference backward on the kernels' own forward outputs (:func:`replay_function`), which the kernels'
    backward differentiates too. ``grads_hook``: applied to the kernels' gradients (to test the test).
    """
    Tq, Tk = q.shape[0], k.shape[0]
    gold = _golden_grads(q, k, v, dense_counts(qr, kr, mt, Tq, Tk), sink, scale, 0.0, dout, dlse)
    out_k, lse_k = _triton_forward(q, k, v, qr, kr, mt, scale)

    def kernels(q, k, v, sink):
        return merge_sink(*_KernelReplay.apply(q, k, v, out_k, lse_k, qr, kr, mt, scale), sink)

    def replayed(q, k, v, sink):
        return merge_sink(*_RefReplay.apply(q, k, v, out_k, lse_k, qr, kr, mt, scale), sink)

    out, lse, grads = _grads(kernels, q, k, v, sink, dout, dlse)
    if grads_hook is not None:
        grads = grads_hook(grads)
    ref_grads = _grads(replayed, q, k, v, sink, dout, dlse)[2]
    with torch.no_grad():
        ref_out, ref_lse = flashrange.range_attention(q, k, v, qr, kr, mt, softmax_scale=scale, sink=sink)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_sink_three_way((out, lse, grads), (ref_out, ref_lse, ref_grads), gold, dsink_atol)


@pytest.mark.parametrize(
    "Tq,Tk,Hq,Hkv,D,S_sink,dtype",
    [
        pytest.param(45, 37, 4, 2, 16, 1, torch.bfloat16, id="gqa2-bf16"),
        pytest.param(33, 70, 2, 1, 32, 2, torch.float16, id="mqa-fp16"),
    ],
)
def test_kernels_three_way(Tq, Tk, Hq, Hkv, D, S_sink, dtype):
    pytest.importorskip("triton")
    q, k, v, sink, dout, dlse = _inputs(Tq, Tk, Hq, Hkv, D, D, S_sink, dtype, seed=Tq * 5 + Tk)
    qr, kr, mt = _ranges(random_slice_rows(Tq, Tk, 5, random.Random(Tk), n_empty=1, uncovered=4))
    _kernels_three_way(q, k, v, sink, dout, dlse, qr, kr, mt, D ** -0.5, dsink_atol=1e-5)


def _packed_documents(T, n, seed, uncovered):
    """``n`` causal documents of random lengths over ``[0, T - uncovered)`` (as the GPU tests draw them)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(T - uncovered - 1, generator=g)[: n - 1].add(1).tolist())
    bounds = [0] + cuts + [T - uncovered]
    return [(a, b, a, b, CAUSAL) for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("dtype, seed", [pytest.param(torch.bfloat16, 4, id="bf16"),
                                         pytest.param(torch.float16, 2, id="fp16")])
def test_kernels_three_way_packed_documents(dtype, seed):
    """The structure of the GPU test ``test_sinks_kernels_three_way``, small: packed causal documents (many
    short ones: rows with 1-3 keys), a BI_CAUSAL band over them (cells covered twice), uncovered rows, an
    empty slice; two sinks per head; GQA 4.

    The kernels' forward rounds P to the input dtype before ``P @ V`` (flash attention), so its ``out``
    carries about twice the reference's error (float32 P, one rounding), which the rule for ``out``
    allows. The backward and the sink merge use that ``out`` (``delta = rowsum(dO * O) - dlse``; dsink
    sums ``w (1 - w) dout . out`` over the rows), so the forward's error reaches dq (on a row with few
    keys ``dq`` gains ``-scale * (dO . err(out)) * sum_j p_j k_j``, ``|k_j| ~ sqrt(D)``, unrelated to the
    row's own size), dk and dsink. Measured against the reference's gradients from its *own* forward,
    these seeds fail (fp16: dq row 19, 8.6e-4 > 2 x 2.2e-4 + eps x 0.37; bf16: dsink) with nothing
    wrong in the kernels; against the reference backward on the kernels' forward (``replay_function``)
    they pass with room, while a dq scaled by 1.01 or a dk by 1.005 still fails.
    """
    pytest.importorskip("triton")
    T, Hq, Hkv, D = 128, 8, 2, 64
    rows = _packed_documents(T, 12, seed, uncovered=12) + [(32, 96, 25, 112, BI_CAUSAL), (0, 0, 0, 0, FULL)]
    qr, kr, mt = _ranges(rows)
    counts = dense_counts(qr, kr, mt, T, T)
    assert int(counts.max()) == 2 and not counts[T - 12:].any()  # overlaps, uncovered rows
    assert int((counts > 0).sum(1)[: T - 12].min()) == 1  # rows with one key
    q, k, v, sink, dout, dlse = _inputs(T, T, Hq, Hkv, D, D, 2, dtype, seed)
    _kernels_three_way(q, k, v, sink, dout, dlse, qr, kr, mt, D ** -0.5, dsink_atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Front-ends


def test_flex_flash_attn_func_sink():
    q, k, v, sink, _, _ = _inputs(19, 23, 4, 2, 16, 16, 2, torch.bfloat16, seed=4)
    qr, kr, mt = _ranges([(0, 19, 0, 23, CAUSAL), (4, 12, 0, 6, FULL)])
    want = flashrange.range_attention(q, k, v, qr, kr, mt, sink=sink)
    got = flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt, sink=sink, sink_layout="sh")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(NotImplementedError, match=r"sink_layout='sh' only"):
        flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt, sink=sink[None].expand(19, 2, 4), sink_layout="ssh")
    with pytest.raises(ValueError, match=r"sink_layout must be one of 'sh', 'ssh', 'shd', got 'hs'"):
        flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt, sink=sink, sink_layout="hs")
    with pytest.raises(ValueError, match=r"sink must have shape \(S_sink, Hq\) = \(S_sink >= 1, 4\).*got \(2, 3\)"):
        flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt, sink=sink[:, :3])


def test_flash_attn_func_learnable_sink():
    """FA4's ``learnable_sink`` `(Hq,)` on padded batches (causal, Sq != Sk), and MagiAttention's ``sink``."""
    B, Sq, Sk, Hq, Hkv, D = 2, 7, 9, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, Sq, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Sk, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Sk, Hkv, D, generator=g, dtype=torch.float64)
    learnable = torch.randn(Hq, generator=g, dtype=torch.float64)
    out, lse = flashrange.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=learnable)
    counts = fa3_window_counts(Sq, Sk, causal=True)
    for b in range(B):
        gold_out, gold_lse = golden_sink_attention(q[b], k[b], v[b], counts, learnable[None])
        assert (out[b] - gold_out).abs().max() < 1e-12
        assert (lse[b] - gold_lse.t()).abs().max() < 1e-12
    same = flashrange.flash_attn_func(q, k, v, causal=True, sink=learnable[None])
    assert torch.equal(same, out)
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(Hq,\) = \(4,\).*got \(1, 4\)"):
        flashrange.flash_attn_func(q, k, v, learnable_sink=learnable[None])
    with pytest.raises(ValueError, match=r"not both"):
        flashrange.flash_attn_func(q, k, v, learnable_sink=learnable, sink=learnable[None])


def test_flash_attn_varlen_func_sink():
    """Packed documents: every row of every document sees the same per-head sinks; seqused rows get lse = L."""
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    T, Hq, D = 20, 2, 8
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(T, Hq, D, generator=g, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(3, Hq, generator=g, dtype=torch.float64)
    out, lse = flashrange.flash_attn_varlen_func(
        q, k, v, cu, cu, causal=True, return_attn_probs=True, sink=sink, seqused_q=torch.tensor([5, 4, 8]),
    )
    rows = [(0, 5, 0, 5, CAUSAL), (5, 9, 5, 12, CAUSAL), (12, 20, 12, 20, CAUSAL)]
    gold_out, gold_lse = golden_sink_attention(q, k, v, dense_counts(*_ranges(rows), T, T), sink)
    assert (out - gold_out).abs().max() < 1e-12 and (lse - gold_lse.t()).abs().max() < 1e-12
    assert (lse[:, 9:12] - torch.logsumexp(sink, 0)[:, None]).abs().max() < 1e-14
    learnable = sink[0]
    got = flashrange.flash_attn_varlen_func(q, k, v, cu, cu, learnable_sink=learnable)
    assert torch.equal(got, flashrange.flash_attn_varlen_func(q, k, v, cu, cu, sink=learnable[None]))


@pytest.mark.parametrize(
    "sink, error, match",
    [
        pytest.param([[0.0, 1.0]], TypeError, r"sink must be a torch.Tensor of shape \(S_sink, Hq\)", id="list"),
        pytest.param(torch.zeros(2), ValueError, r"sink must have shape \(S_sink, Hq\).*got \(2,\)", id="1d"),
        pytest.param(torch.zeros(0, 2), ValueError, r"S_sink >= 1.*got \(0, 2\)", id="no-sinks"),
        pytest.param(torch.zeros(1, 2, dtype=torch.int32), ValueError, r"sink must be a floating-point", id="int"),
        pytest.param(torch.zeros(1, 2, device="meta"), ValueError, r"sink is on meta but q is on cpu", id="device"),
    ],
)
def test_sink_errors(sink, error, match):
    q = torch.randn(5, 2, 8)
    qr, kr, mt = _ranges([(0, 5, 0, 5, CAUSAL)])
    with pytest.raises(error, match=match):
        flashrange.range_attention(q, q, q, qr, kr, mt, sink=sink)


# ---------------------------------------------------------------------------------------------
# torch.compile


class _SinkBlock(nn.Module):
    """qkv projection -> range attention with learnable sinks -> out projection (GPT-OSS style)."""

    def __init__(self, dim=16, hq=4, hkv=2, hd=8):
        super().__init__()
        torch.manual_seed(0)
        self.hq, self.hkv, self.hd = hq, hkv, hd
        self.qkv = nn.Linear(dim, (hq + 2 * hkv) * hd)
        self.proj = nn.Linear(hq * hd, dim)
        self.sinks = nn.Parameter(torch.randn(1, hq))

    def forward(self, x, q_ranges, k_ranges, mask_types):
        T = x.shape[0]
        q, k, v = self.qkv(x).split([self.hq * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        out, lse = flashrange.range_attention(
            q.view(T, self.hq, self.hd), k.view(T, self.hkv, self.hd), v.view(T, self.hkv, self.hd),
            q_ranges, k_ranges, mask_types, sink=self.sinks,
        )
        return self.proj(out.reshape(T, -1)), lse


def test_compiled_training_step_with_sinks():
    """fullgraph=True (no graph break), the same loss and gradients as eager, sinks included."""
    torch._dynamo.reset()
    model = _SinkBlock()
    x = torch.randn(19, 16, generator=torch.Generator().manual_seed(7))
    qr, kr, mt = _ranges([(0, 8, 0, 8, CAUSAL), (8, 17, 8, 17, CAUSAL), (0, 0, 0, 0, FULL)])  # rows 17, 18 uncovered

    def loss_fn(x, qr, kr, mt):
        y, lse = model(x, qr, kr, mt)
        return y.square().mean() + lse.mean()

    compiled = torch.compile(loss_fn, fullgraph=True)
    losses, grads = [], []
    for fn in (loss_fn, compiled):
        model.zero_grad()
        loss = fn(x, qr, kr, mt)
        loss.backward()  # through the compiled graph's backward
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[1], losses[0])
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads[0][-1].abs().sum() > 0  # the sinks learn
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# transformers: GPT-OSS passes its sinks as ``s_aux``


def test_gpt_oss_sinks_through_the_transformers_backend(monkeypatch):
    """A tiny GPT-OSS (sliding and full layers, left padding) gives eager attention's logits and sink gradients."""
    pytest.importorskip("transformers")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss")
    import flashrange.integrations.transformers as backend  # registers "flashrange"

    sinks_seen = []

    def counting(*args, sink=None, **kwargs):
        sinks_seen.append(sink is not None)
        return flashrange.interface.attention(*args, sink=sink, **kwargs)

    monkeypatch.setattr(backend, "attention", counting)

    cfg = gpt_oss.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    model = gpt_oss.GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0
    results = {}
    for impl in ("eager", "flashrange"):
        # Set on the config: set_attn_implementation("flashrange") on a model that lists compatible
        # flash kernels (GPT-OSS) swaps any name containing "flash" for one of those kernels.
        model.config._attn_implementation = impl
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[mask.bool()].square().mean().backward()
        results[impl] = logits.detach()[mask.bool()], [layer.self_attn.sinks.grad.clone() for layer in model.model.layers]
    assert sinks_seen == [True] * 2  # one call per layer, each with the layer's sinks
    torch.testing.assert_close(results["flashrange"][0], results["eager"][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(results["flashrange"][1], results["eager"][1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
