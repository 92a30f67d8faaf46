"""``torch.library.opcheck`` on the ``flashrange`` ops (docs/design.md §7).

Every default check runs (schema, autograd registration, fake tensor,
aot_dispatch_dynamic) on ``flashrange::fwd`` and ``flashrange::bwd`` over a
grid of odd shapes, ``Tq != Tk``, GQA ratios 1/2/4, softcap on and off, and
slice lists padded with empty ``[0, 0)`` slices; and the ops' autograd under
activation checkpointing, reentrant and not.
"""

from __future__ import annotations

import random

import pytest
import torch

import flashrange.ops  # noqa: F401  (registers torch.ops.flashrange)
from flashrange import reference

ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _random_slices(Tq, Tk, n_slices, n_pad, seed):
    """Random slices of all four types (edges, length 1, overlaps), then ``n_pad`` empty slices.

    The empty slices are scattered through the list, not only appended,
    since padding anywhere must be harmless.
    """
    rng = random.Random(seed)
    rows = []
    for s in range(n_slices):
        qs = rng.randrange(0, Tq)
        qe = rng.randint(qs + 1, Tq)
        ks = rng.randrange(0, Tk)
        ke = rng.randint(ks + 1, Tk)
        rows.append(((qs, qe), (ks, ke), s % 4))
    for _ in range(n_pad):
        rows.insert(rng.randint(0, len(rows)), ((0, 0), (0, 0), 0))
    q_ranges = torch.tensor([r[0] for r in rows], dtype=torch.int32).reshape(-1, 2)
    k_ranges = torch.tensor([r[1] for r in rows], dtype=torch.int32).reshape(-1, 2)
    mask_types = torch.tensor([r[2] for r in rows], dtype=torch.int32).reshape(-1)
    return q_ranges, k_ranges, mask_types


# (Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, softcap)
CASES = [
    pytest.param(17, 17, 2, 2, 16, 16, 3, 0, 0.0, id="T17-mha-nopad"),
    pytest.param(17, 29, 4, 2, 16, 8, 5, 3, 0.0, id="Tq17-Tk29-gqa2-pad3"),
    pytest.param(31, 13, 4, 1, 8, 8, 4, 4, 5.0, id="Tq31-Tk13-mqa4-softcap-pad4"),
    pytest.param(1, 7, 2, 1, 16, 16, 1, 2, 0.0, id="Tq1-Tk7-gqa2-pad2"),
    pytest.param(9, 9, 4, 4, 8, 16, 0, 5, 2.0, id="T9-all-empty-softcap"),
    pytest.param(23, 23, 8, 2, 16, 16, 7, 1, 3.0, id="T23-gqa4-softcap-pad1"),
    pytest.param(63, 130, 2, 1, 64, 64, 9, 6, 0.0, id="Tq63-Tk130-D64-gqa2-pad6"),
]


def _inputs(Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, seed, requires_grad):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, Hq, D, generator=g).requires_grad_(requires_grad)
    k = torch.randn(Tk, Hkv, D, generator=g).requires_grad_(requires_grad)
    v = torch.randn(Tk, Hkv, Dv, generator=g).requires_grad_(requires_grad)
    q_ranges, k_ranges, mask_types = _random_slices(Tq, Tk, n_slices, n_pad, seed)
    return q, k, v, q_ranges, k_ranges, mask_types


def _plan(qr, kr, mt, q, k):
    return list(torch.ops.flashrange.plan(qr, kr, mt, q.shape[0], k.shape[0]))


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D,Dv,n_slices,n_pad,softcap", CASES)
def test_opcheck_plan(Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, softcap):
    _, _, _, qr, kr, mt = _inputs(Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, 99 + Tq, False)
    torch.library.opcheck(torch.ops.flashrange.plan.default, (qr, kr, mt, Tq, Tk), test_utils=ALL_TESTS)


@pytest.mark.parametrize("requires_grad", [pytest.param(True, id="grad"), pytest.param(False, id="nograd")])
@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D,Dv,n_slices,n_pad,softcap", CASES)
def test_opcheck_fwd(Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, softcap, requires_grad):
    q, k, v, qr, kr, mt = _inputs(Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, 1234 + Tq, requires_grad)
    scale = 0.3
    torch.library.opcheck(
        torch.ops.flashrange.fwd.default, (q, k, v, qr, kr, mt, _plan(qr, kr, mt, q, k), scale, softcap), test_utils=ALL_TESTS
    )


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D,Dv,n_slices,n_pad,softcap", CASES)
def test_opcheck_bwd(Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, softcap):
    q, k, v, qr, kr, mt = _inputs(Tq, Tk, Hq, Hkv, D, Dv, n_slices, n_pad, 4321 + Tq, False)
    scale = 0.3
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, scale, softcap)
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    torch.library.opcheck(
        torch.ops.flashrange.bwd.default,
        (dout, dlse, q, k, v, out, lse, qr, kr, mt, _plan(qr, kr, mt, q, k), scale, softcap),
        test_utils=ALL_TESTS,
    )


def test_fwd_matches_reference_and_grad_flows():
    """The op's CPU kernel is the reference, and autograd reaches q, k, v through out and lse."""
    q, k, v, qr, kr, mt = _inputs(19, 23, 4, 2, 16, 16, 5, 2, 99, True)
    out, lse = torch.ops.flashrange.fwd(q, k, v, qr, kr, mt, _plan(qr, kr, mt, q, k), 0.25, 0.0)
    ref_out, ref_lse = reference.range_attention_forward(q.detach(), k.detach(), v.detach(), qr, kr, mt, 0.25, 0.0)
    assert torch.equal(out.detach(), ref_out)
    assert torch.equal(lse.detach(), ref_lse)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    finite = torch.isfinite(lse).detach()
    (out * dout).sum().backward(inputs=[q, k, v], retain_graph=True)
    ref_dq, ref_dk, ref_dv = reference.range_attention_backward(
        dout, q.detach(), k.detach(), v.detach(), ref_out, ref_lse, qr, kr, mt, 0.25, 0.0, None
    )
    assert torch.equal(q.grad, ref_dq) and torch.equal(k.grad, ref_dk) and torch.equal(v.grad, ref_dv)
    q.grad = k.grad = v.grad = None
    # lse's gradient: uncovered rows have lse = -inf, so only finite rows enter the loss.
    (torch.where(finite, lse, torch.zeros_like(lse)) * dlse).sum().backward(inputs=[q, k, v])
    ref_dq, ref_dk, ref_dv = reference.range_attention_backward(
        torch.zeros_like(ref_out), q.detach(), k.detach(), v.detach(), ref_out, ref_lse, qr, kr, mt, 0.25, 0.0,
        torch.where(finite, dlse, torch.zeros_like(dlse)),
    )
    assert torch.equal(q.grad, ref_dq) and torch.equal(k.grad, ref_dk) and torch.equal(v.grad, ref_dv)


def test_opcheck_fwd_garbage_ranges():
    """Out-of-bounds ranges, start > end and unknown types: the op clamps / ignores them (compiled calls
    cannot validate on the host), and every opcheck test still passes."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(13, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(19, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(19, 2, 8, generator=g, requires_grad=True)
    q_ranges = torch.tensor([[-5, 6], [4, 40], [9, 3], [0, 13], [2, 11]], dtype=torch.int32)
    k_ranges = torch.tensor([[0, 7], [-3, 25], [0, 19], [10, 99], [1, 18]], dtype=torch.int32)
    mask_types = torch.tensor([1, 2, 0, 3, 7], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.flashrange.fwd.default, (q, k, v, q_ranges, k_ranges, mask_types, _plan(q_ranges, k_ranges, mask_types, q, k), 0.35, 0.0), test_utils=ALL_TESTS
    )
    out, lse = torch.ops.flashrange.fwd(q, k, v, q_ranges, k_ranges, mask_types, _plan(q_ranges, k_ranges, mask_types, q, k), 0.35, 0.0)
    # Same as the ranges clamped to [0, Tq] / [0, Tk] with the empty and unknown-type slices dropped.
    clamped = torch.ops.flashrange.fwd(
        q, k, v,
        torch.tensor([[0, 6], [4, 13], [0, 13]], dtype=torch.int32),
        torch.tensor([[0, 7], [0, 19], [10, 19]], dtype=torch.int32),
        torch.tensor([1, 2, 3], dtype=torch.int32),
        _plan(torch.tensor([[0, 6], [4, 13], [0, 13]], dtype=torch.int32),
              torch.tensor([[0, 7], [0, 19], [10, 19]], dtype=torch.int32),
              torch.tensor([1, 2, 3], dtype=torch.int32), q, k),
        0.35, 0.0,
    )
    assert torch.isfinite(out).all()
    assert torch.equal(out, clamped[0]) and torch.equal(lse, clamped[1])


def _layout(t, layout):
    """The same values as ``t`` `(T, H, D)` in another memory layout."""
    if layout == "head-major":  # dense but permuted strides, e.g. from a (H, T, D) transpose
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "gapped":  # a slice of a wider tensor, e.g. q out of a fused qkv projection
        wide = torch.zeros(t.shape[0], t.shape[1], t.shape[2] + 5, dtype=t.dtype)
        wide[..., 2 : 2 + t.shape[2]] = t
        return wide[..., 2 : 2 + t.shape[2]]
    return t


@pytest.mark.parametrize("layout", ["head-major", "gapped"])
def test_opcheck_non_contiguous_inputs(layout):
    """Fake and real results agree on strides (contiguous outputs) whatever the input layout."""
    q, k, v, qr, kr, mt = _inputs(21, 27, 4, 2, 8, 8, 5, 2, 77, False)
    q, k, v = (_layout(t, layout) for t in (q, k, v))
    assert not q.is_contiguous()
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashrange.fwd.default, (qg, kg, vg, qr, kr, mt, _plan(qr, kr, mt, q, k), 0.3, 0.0), test_utils=ALL_TESTS)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, 0.3, 0.0)
    g = torch.Generator().manual_seed(8)
    dout = _layout(torch.randn(out.shape, generator=g), layout)
    dlse = torch.randn(lse.shape, generator=g)
    torch.library.opcheck(
        torch.ops.flashrange.bwd.default, (dout, dlse, q, k, v, out, lse, qr, kr, mt, _plan(qr, kr, mt, q, k), 0.3, 0.0), test_utils=ALL_TESTS
    )


def test_bwd_op_without_dlse_equals_zero_dlse():
    """``dlse`` is optional in the schema: None (no gradient through lse) is the zero gradient, and passes opcheck."""
    q, k, v, qr, kr, mt = _inputs(21, 27, 4, 2, 8, 8, 5, 2, 78, False)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, 0.3, 0.0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    plan = _plan(qr, kr, mt, q, k)
    without = torch.ops.flashrange.bwd(dout, None, q, k, v, out, lse, qr, kr, mt, plan, 0.3, 0.0)
    zero = torch.ops.flashrange.bwd(dout, torch.zeros_like(lse), q, k, v, out, lse, qr, kr, mt, plan, 0.3, 0.0)
    for a, b in zip(without, zero):
        assert torch.equal(a, b)
    torch.library.opcheck(
        torch.ops.flashrange.bwd.default, (dout, None, q, k, v, out, lse, qr, kr, mt, plan, 0.3, 0.0),
        test_utils=ALL_TESTS,
    )


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("max_logits", [False, True], ids=["plain", "max-logits"])
def test_activation_checkpointing(max_logits, reentrant):
    """``torch.utils.checkpoint``: the non-reentrant mode lets each saved tensor be unpacked once, so the backward
    must read ``ctx.saved_tensors`` once. Same output and gradients, bit for bit, as the plain step."""
    import flashrange
    from torch.utils.checkpoint import checkpoint

    Tq, Tk, Hq, Hkv, D = 37, 41, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(T, H, D, generator=g) for T, H in ((Tq, Hq), (Tk, Hkv), (Tk, Hkv)))
    qr, kr, mt = _random_slices(Tq, Tk, 4, 2, seed=6)
    dout = torch.randn(Tq, Hq, D, generator=g)

    def attn(q, k, v):
        return flashrange.range_attention(q, k, v, qr, kr, mt, return_max_logits=max_logits)[0]

    def step(use_checkpoint):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = checkpoint(attn, *leaves, use_reentrant=reentrant) if use_checkpoint else attn(*leaves)
        (out * dout).sum().backward()  # the reentrant mode refuses autograd.grad
        return out.detach(), [t.grad for t in leaves]

    plain, ckpt = step(False), step(True)
    assert torch.equal(plain[0], ckpt[0])
    for a, b in zip(plain[1], ckpt[1]):
        assert torch.equal(a, b)
