"""Passes over the heads: the order in which every kernel's programs take (block, head) work items.

A pass takes a few heads over every plan block, heaviest block first, so that the items in flight read the
keys and values (forward, dQ) or queries and output gradients (dK/dV) of few heads (docs/design.md, "Passes
over the heads"). The order must cover every item exactly once, and the results must not depend on it.
Run on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from flashrange import reference  # noqa: E402
from flashrange.constants import PLAN_BLOCK  # noqa: E402
from flashrange.kernels import backward as bwd  # noqa: E402
from flashrange.kernels import forward as fwd  # noqa: E402
from flashrange.kernels.common import heads_per_pass, pass_budget, plan_program  # noqa: E402
from golden import assert_three_way, grad_inputs, random_slice_rows  # noqa: E402
from test_kernel_forward import check_three_way  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _plan_program_kernel(block_order_ptr, block_lo_ptr, block_hi_ptr, out_ptr, n_heads, pass_heads, T,
                         SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    head, start, end, s_lo, s_hi = plan_program(pid, n_heads, pass_heads, T, block_order_ptr, block_lo_ptr,
                                                block_hi_ptr, SPLIT, BLOCK)
    tl.store(out_ptr + pid * 5 + 0, head)
    tl.store(out_ptr + pid * 5 + 1, start)
    tl.store(out_ptr + pid * 5 + 2, end)
    tl.store(out_ptr + pid * 5 + 3, s_lo)
    tl.store(out_ptr + pid * 5 + 4, s_hi)


def _expected_items(n_heads, pass_heads, T, split, block, order, lo, hi):
    """The order written out: passes of ``pass_heads`` heads (the last one the rest), in each the plan's
    blocks in ``order``, each block's ``split`` tiles in turn, each tile's heads side by side."""
    items = []
    for first in range(0, n_heads, pass_heads):
        heads = range(first, min(n_heads, first + pass_heads))
        for b in order:
            for t in range(split):
                start = (b * split + t) * block
                for h in heads:
                    items.append((h, start, min(start + block, T), lo[b], hi[b]))
    return items


@pytest.mark.parametrize("n_heads, pass_heads, T, split", [
    pytest.param(6, 4, 333, 2, id="ragged-last-pass-split2"),
    pytest.param(5, 1, 257, 1, id="one-head-per-pass"),
    pytest.param(8, 8, 300, 1, id="one-pass"),
    pytest.param(4, 7, 100, 2, id="pass-wider-than-heads"),
    pytest.param(12, 6, 1000, 4, id="two-passes-split4"),
    pytest.param(3, 2, 1, 1, id="one-token"),
])
def test_plan_program_walks_passes_of_heads(n_heads, pass_heads, T, split):
    """Every (tile, head) once, in passes of heads, each pass over the blocks in the plan's order."""
    block = PLAN_BLOCK // split
    n_blocks = -(-T // PLAN_BLOCK)
    rng = random.Random(n_heads * 1000 + T)
    order = list(range(n_blocks))
    rng.shuffle(order)
    lo = [rng.randrange(0, 50) for _ in range(n_blocks)]
    hi = [x + rng.randrange(0, 9) for x in lo]
    n_items = n_blocks * split * n_heads
    out = torch.full((n_items, 5), -1, dtype=torch.int32, device=DEV)
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    _plan_program_kernel[(n_items,)](as_t(order), as_t(lo), as_t(hi), out, n_heads, pass_heads, T, split, block)
    got = [tuple(r) for r in out.cpu().tolist()]
    want = _expected_items(n_heads, pass_heads, T, split, block, order, lo, hi)
    assert got == want
    assert len({(h, s) for h, s, *_ in got}) == n_items


@pytest.mark.parametrize("n_heads, group, group_mib, want", [
    pytest.param(16, 1, 16, 2, id="doc-32k-d128"),  # 32768 tokens x (128 + 128) x 2 bytes per head
    pytest.param(16, 1, 4, 8, id="causal-8k-d128"),
    # 16384 tokens: a key/value head's 8 MiB serves four query heads; four of them fit.
    pytest.param(32, 4, 8, 16, id="gqa32to8-16k"),
    pytest.param(16, 1, 0.25, 16, id="short-sequence-all-heads"),
    pytest.param(16, 1, 64, 1, id="one-head-past-the-budget"),
    pytest.param(8, 4, 64, 4, id="one-group-past-the-budget"),
])
def test_heads_per_pass_takes_whole_groups_within_the_budget(n_heads, group, group_mib, want):
    """On a 50 MiB L2 (H100, H200), two thirds of it: whole GQA groups, at least one, at most every head."""
    budget = int(50 * 2**20 * 2 / 3)
    assert heads_per_pass(n_heads, group, int(group_mib * 2**20), budget) == want


def test_pass_budget_without_a_cache():
    """Off the GPU there is no cache to fit: the small stand-in that makes the interpreted tests walk passes."""
    from flashrange.kernels.common import INTERPRETER_PASS_BYTES

    assert pass_budget(torch.device("cpu")) == INTERPRETER_PASS_BYTES


def _fixed_width(width):
    """Stands in for ``heads_per_pass``: every launch takes passes of ``width`` heads (groups may split)."""
    return lambda n_heads, group, group_bytes, budget: width


def _rows(Tq, Tk, seed):
    rows = random_slice_rows(Tq, Tk, 7, random.Random(seed), n_empty=2, random_types=True)
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")])
def test_forward_bits_do_not_depend_on_the_passes(dtype, monkeypatch):
    """Passes of 1, 2, 4 and all 6 heads (groups of 3 split across passes too): the same bits, and right."""
    Tq, Tk, Hq, Hkv = 301, 259, 6, 2
    g = torch.Generator().manual_seed(3)
    q = torch.randn(Tq, Hq, 24, generator=g).to(DEV, dtype)
    k = torch.randn(Tk, Hkv, 24, generator=g).to(DEV, dtype)
    v = torch.randn(Tk, Hkv, 16, generator=g).to(DEV, dtype)
    qr, kr, mt = (t.to(DEV) for t in _rows(Tq, Tk, 5))
    results = []
    for width in (1, 2, 4, Hq):
        monkeypatch.setattr(fwd, "heads_per_pass", _fixed_width(width))
        results.append(fwd.range_attention_forward_triton(q, k, v, qr, kr, mt, 0.3))
    check_three_way(q, k, v, qr, kr, mt, 0.3, 0.0, *results[-1])
    for out, lse in results[:-1]:
        assert torch.equal(out, results[-1][0]) and torch.equal(lse, results[-1][1])


def test_backward_bits_do_not_depend_on_the_passes(monkeypatch):
    """Both backward kernels in passes of 1, 2 and all heads: dQ, dK and dV the same bits, and right."""
    Tq, Tk, Hq, Hkv = 203, 187, 4, 2
    q, k, v, do, dlse = grad_inputs(Tq, Tk, Hq, Hkv, 16, 24, torch.float16, 11, True, device=DEV)
    qr, kr, mt = (t.to(DEV) for t in _rows(Tq, Tk, 8))
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, None)
    results = []
    for width in (1, 2, Hq):
        monkeypatch.setattr(bwd, "heads_per_pass", _fixed_width(width))
        results.append(bwd.range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse))
    f64 = [t.double() for t in (q, k, v)]
    out64, lse64 = reference.range_attention_forward(*f64, qr, kr, mt, None)
    golden = reference.range_attention_backward(do.double(), *f64, out64, lse64, qr, kr, mt, None, 0.0, dlse)
    ref = reference.range_attention_backward(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse)
    for name, got, r, gold in zip(("dq", "dk", "dv"), results[-1], ref, golden):
        assert_three_way(name, got, r, gold)
    for other in results[:-1]:
        assert all(torch.equal(a, b) for a, b in zip(other, results[-1]))
