"""``torch.export`` of a module that calls the ``flashrange`` op (docs/design.md §7).

The exported program keeps ``flashrange::fwd`` as one node; running
``ep.module()`` forward and backward gives eager's results, also after a
save/load round trip, and a program exported with a dynamic slice count
serves any number of slices.
"""

from __future__ import annotations

import io
import random

import pytest
import torch
from torch import nn

import flashrange
from flashrange.mask import RangeMask

T, DIM, HQ, HKV, HD = 41, 16, 4, 2, 8


class Attention(nn.Module):
    """qkv projection -> range attention (softcap) -> out projection on a packed `(T, DIM)` stream."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(DIM, (HQ + 2 * HKV) * HD)
        self.proj = nn.Linear(HQ * HD, DIM)

    def forward(self, x, q_ranges, k_ranges, mask_types):
        q, k, v = self.qkv(x).split([HQ * HD, HKV * HD, HKV * HD], dim=-1)
        n = x.shape[0]
        out, lse = flashrange.range_attention(
            q.view(n, HQ, HD), k.view(n, HKV, HD), v.view(n, HKV, HD), q_ranges, k_ranges, mask_types, softcap=20.0
        )
        return self.proj(out.reshape(n, HQ * HD)), lse


def _mask(seed, n_docs, capacity=None):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n_docs - 1))
    mask = RangeMask.varlen([0, *cuts, T], causal=True)
    return mask if capacity is None else mask.pad_to(capacity)


def _forward_backward(module, x, mask, wy, wl):
    """Output, lse and the gradients of x and of every parameter (in ``named_parameters`` order)."""
    x = x.detach().requires_grad_(True)
    y, lse = module(x, *mask.tensors())
    loss = (y * wy).sum() + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * wl).sum()
    params = [p for _, p in sorted(module.named_parameters())]
    grads = torch.autograd.grad(loss, [x, *params])
    return [y.detach(), lse.detach(), *grads]


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, DIM, generator=g), torch.randn(T, DIM, generator=g), torch.randn(T, HQ, generator=g)


def _assert_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        # The exported graph runs the same aten ops and the same op kernel as eager.
        assert torch.equal(g, w), (g - w).abs().max()


def _save_load(ep):
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    return torch.export.load(buf)


def _op_nodes(ep):
    return [n for n in ep.graph.nodes if n.op == "call_function" and "flashrange.fwd" in str(n.target)]


@pytest.mark.parametrize("round_trip", [pytest.param(False, id="exported"), pytest.param(True, id="saved-loaded")])
def test_export_forward_backward_matches_eager(round_trip):
    model = Attention()
    mask = _mask(1, 6, capacity=16)
    x, wy, wl = _inputs(2)
    ep = torch.export.export(model, (x, *mask.tensors()))
    assert len(_op_nodes(ep)) == 1
    if round_trip:
        ep = _save_load(ep)
    exported = ep.module()
    # New slice values (same capacity) and new inputs: the program is not tied to the example.
    for seed, n_docs in ((3, 6), (4, 11), (5, 1)):
        mask = _mask(seed, n_docs, capacity=16)
        x, wy, wl = _inputs(seed)
        _assert_equal(_forward_backward(exported, x, mask, wy, wl), _forward_backward(model, x, mask, wy, wl))


def test_export_dynamic_slice_count():
    """One program for every slice count: ``S`` exported as a dynamic dimension."""
    model = Attention()
    mask = _mask(6, 8)
    x, wy, wl = _inputs(6)
    S = torch.export.Dim("S", min=1, max=4096)
    ep = torch.export.export(
        model, (x, *mask.tensors()), dynamic_shapes=(None, {0: S}, {0: S}, {0: S})
    )
    assert len(_op_nodes(ep)) == 1
    exported = ep.module()
    for seed, n_docs in ((7, 1), (8, 2), (9, 23), (10, 40)):
        mask = _mask(seed, n_docs)
        assert mask.num_slices == n_docs
        x, wy, wl = _inputs(seed)
        _assert_equal(_forward_backward(exported, x, mask, wy, wl), _forward_backward(model, x, mask, wy, wl))
