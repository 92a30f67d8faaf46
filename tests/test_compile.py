"""The ``torch.compile`` contract on the CPU (docs/design.md §7).

- Every front-end traces with ``fullgraph=True`` under inductor and
  ``aot_eager``: one graph, zero graph breaks, the ``flashrange::fwd`` op in
  it, forward and backward matching eager.
- Training loops whose slice count changes every step: exactly one
  compilation when padded to a fixed capacity, one per capacity hit when
  bucketed, and no recompilation after the first dynamic graph with
  ``dynamic=True``. Changing slice values never recompiles.
- Padding and permuting a slice list change no bit of ``out``, ``lse``,
  ``dq``, ``dk``, ``dv``.

Inductor compiles are slow on the CPU, so the models are tiny and each
compiled function serves as many checks as it can.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch import nn

import flashrange
from flashrange.mask import RangeMask, bucket_capacity

DIM, HQ, HKV, HD = 16, 4, 2, 8
CAPACITY = 64
STEPS = 50
T_TRAIN = 67  # room for 64 one-token documents; odd


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts and ends with empty dynamo caches and counters."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


# ----------------------------------------------------------------------------- model


def _attn_range(q, k, v, q_ranges, k_ranges, mask_types):
    return flashrange.range_attention(q, k, v, q_ranges, k_ranges, mask_types)


class Block(nn.Module):
    """qkv projection -> attention -> out projection, on a packed `(T, DIM)` stream.

    ``attn(q, k, v, *mask_args)`` takes `(T, H, HD)` heads and returns
    ``(out (T, HQ, HD), lse)``; the block returns the projected output and lse.
    """

    def __init__(self, attn, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = attn
        self.qkv = nn.Linear(DIM, (HQ + 2 * HKV) * HD)
        self.proj = nn.Linear(HQ * HD, DIM)

    def forward(self, x, *mask_args):
        q, k, v = self.qkv(x).split([HQ * HD, HKV * HD, HKV * HD], dim=-1)
        T = x.shape[0]
        out, lse = self.attn(q.view(T, HQ, HD), k.view(T, HKV, HD), v.view(T, HKV, HD), *mask_args)
        return self.proj(out.reshape(T, HQ * HD)), lse


def _loss(y, lse, wy, wl):
    """Uses both outputs; rows no slice covers have lse = -inf and are left out.

    Scaled by 1/T so that SGD steps stay small and training stays finite.
    """
    lse_finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return ((y * wy).sum() + (lse_finite * wl).sum()) / y.shape[0]


def _step(fn, params, x, mask_args, wy, wl):
    """Forward + backward: returns (y, lse, grads of params and x)."""
    y, lse = fn(x, *mask_args)
    grads = torch.autograd.grad(_loss(y, lse, wy, wl), [*params, x])
    return [y.detach(), lse.detach(), *grads]


def _assert_same(got, want, exact):
    for g, w in zip(got, want, strict=True):
        if exact:
            assert torch.equal(g, w), (g - w).abs().max()
        else:
            torch.testing.assert_close(g, w)


def _fwd_in_graph(counter) -> bool:
    return all("flashrange.fwd" in gm.code for gm in counter.graphs)


def _op_graphs(counter) -> int:
    """Compiled graphs that call the op.

    Under ``dynamic=True`` a float argument left at its default
    (``softcap=0.0``) starts as a symbolic float; dynamo then restarts the
    analysis once to specialize it and hands the backend an empty graph,
    which this count leaves out.
    """
    return sum("flashrange.fwd" in gm.code for gm in counter.graphs)


def _cache_entries(fn) -> int:
    """How many compiled variants dynamo keeps for ``fn``: one per compilation that was kept."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


def _random_doc_mask(rng, T, n_docs):
    """Causal documents of random lengths packed into T tokens: ``n_docs`` slices."""
    cuts = sorted(rng.sample(range(1, T), n_docs - 1))
    return RangeMask.varlen([0, *cuts, T], causal=True)


# ------------------------------------------------------------------- fullgraph, per front-end

T_FG = 39  # 3 sequences of 13 for the (B, S, H, D) front-end


def _mask_args_range(seed, T=T_FG, n_docs=5, capacity=8):
    rng = random.Random(seed)
    mask = _random_doc_mask(rng, T, n_docs)
    return (mask if capacity is None else mask.pad_to(capacity)).tensors()


def _attn_flex(q, k, v, q_ranges, k_ranges, attn_type_map):
    return flashrange.flex_flash_attn_func(q, k, v, q_ranges, k_ranges, attn_type_map=attn_type_map)


def _attn_fa3(q, k, v):
    """Packed `(3 * 13, H, D)` viewed as a `(3, 13, H, D)` batch; causal sliding window."""
    B = 3
    q4, k4, v4 = (t.view(B, t.shape[0] // B, t.shape[1], t.shape[2]) for t in (q, k, v))
    out, lse = flashrange.flash_attn_func(q4, k4, v4, causal=True, window_size=(5, -1), return_attn_probs=True)
    return out.reshape(q.shape), lse.transpose(1, 2).reshape(q.shape[0], q.shape[1])


def _attn_varlen(q, k, v, cu_seqlens):
    out, lse = flashrange.flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q=T_FG, max_seqlen_k=T_FG,
        causal=True, window_size=(6, -1), return_attn_probs=True,
    )
    return out, lse.transpose(0, 1)


def _mask_args_none(seed, T=T_FG, n_docs=None, capacity=None):
    return ()


def _mask_args_cu_seqlens(seed, T=T_FG, n_docs=5, capacity=None):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n_docs - 1))
    return (torch.tensor([0, *cuts, T], dtype=torch.int32),)


FRONTENDS = {
    "range_attention": (_attn_range, _mask_args_range),
    "flex_flash_attn_func": (_attn_flex, _mask_args_range),
    "flash_attn_func": (_attn_fa3, _mask_args_none),
    "flash_attn_varlen_func": (_attn_varlen, _mask_args_cu_seqlens),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_fullgraph_matches_eager(frontend, backend):
    attn, make_args = FRONTENDS[frontend]
    model = Block(attn)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1)
    for seed in (11, 12, 13):  # new slice values each call: no recompilation
        x = torch.randn(T_FG, DIM, generator=g, requires_grad=True)
        wy = torch.randn(T_FG, DIM, generator=g)
        wl = torch.randn(T_FG, HQ, generator=g)
        mask_args = make_args(seed)
        got = _step(compiled, params, x, mask_args, wy, wl)
        want = _step(model, params, x, mask_args, wy, wl)
        _assert_same(got, want, exact=backend == "aot_eager")
    assert counter.frame_count == 1
    assert _graph_breaks() == 0
    assert _fwd_in_graph(counter)


@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_dynamic_frontend_one_graph(frontend):
    """``dynamic=True``: new token counts and slice counts reuse the first graph, results equal eager."""
    attn, make_args = FRONTENDS[frontend]
    model = Block(attn)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(2)
    # Multiples of 3 for the (3, S, H, D) front-end; at least 2 slices (dynamo specializes 0 and 1).
    for seed, (T, n_docs) in enumerate([(39, 3), (45, 6), (51, 11)]):
        x = torch.randn(T, DIM, generator=g, requires_grad=True)
        wy, wl = torch.randn(T, DIM, generator=g), torch.randn(T, HQ, generator=g)
        mask_args = make_args(seed, T=T, n_docs=n_docs, capacity=None)
        got = _step(compiled, params, x, mask_args, wy, wl)
        want = _step(model, params, x, mask_args, wy, wl)
        _assert_same(got, want, exact=True)
    assert _op_graphs(counter) == 1
    assert _cache_entries(Block.forward) == 1
    assert _graph_breaks() == 0


# ------------------------------------------------------------- slice count varies every step


def _train(compiled, model, mask_for_step, backend, steps=STEPS, seed=0, on_step=None):
    """``steps`` SGD steps; each step checks the compiled forward/backward against eager."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(T_TRAIN, DIM, generator=g, requires_grad=True)
        wy = torch.randn(T_TRAIN, DIM, generator=g)
        wl = torch.randn(T_TRAIN, HQ, generator=g)
        mask = mask_for_step(step)
        got = _step(compiled, params, x, mask.tensors(), wy, wl)
        want = _step(model, params, x, mask.tensors(), wy, wl)
        _assert_same(got, want, exact=backend == "aot_eager")
        for p, grad in zip(params, got[2:]):
            p.grad = grad
        opt.step()
        if on_step is not None:
            on_step(step, mask)


def _doc_counts(seed, steps=STEPS, lo=1, hi=CAPACITY):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(steps)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_padded_slice_count_compiles_once(backend):
    counts = _doc_counts(100)
    assert len(set(counts)) > 20  # the slice count really changes
    rng = random.Random(101)
    masks = [_random_doc_mask(rng, T_TRAIN, n).pad_to(CAPACITY) for n in counts]
    model = Block(_attn_range)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    _train(compiled, model, lambda step: masks[step], backend)
    assert counter.frame_count == 1
    assert _graph_breaks() == 0
    assert _fwd_in_graph(counter)


def test_bucketed_slice_count_compiles_once_per_capacity():
    counts = _doc_counts(200)
    rng = random.Random(201)
    masks = [_random_doc_mask(rng, T_TRAIN, n).bucketed() for n in counts]
    capacities = [bucket_capacity(n) for n in counts]
    assert [m.num_slices for m in masks] == capacities
    model = Block(_attn_range)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    # dynamic=False: one static graph per capacity (automatic dynamic shapes
    # would otherwise fold every capacity into one dynamic graph).
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    seen = set()

    def on_step(step, mask):
        # A compilation happens exactly when a capacity is met for the first time.
        seen.add(mask.num_slices)
        assert counter.frame_count == len(seen), (step, mask.num_slices)

    _train(compiled, model, lambda step: masks[step], "aot_eager", on_step=on_step)
    assert counter.frame_count == len(set(capacities)) <= 7
    assert len(set(capacities)) >= 5  # the seed hits most buckets
    assert _graph_breaks() == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dynamic_unpadded_no_recompile(backend):
    counts = _doc_counts(300)
    assert 1 in counts and counts[0] != 1 and len(set(counts)) > 20
    rng = random.Random(301)
    masks = [_random_doc_mask(rng, T_TRAIN, n) for n in counts]
    model = Block(_attn_range)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    # Dynamo specializes sizes 0 and 1, so a single-slice mask gets its own
    # graph; every other slice count runs in the first dynamic graph.
    graphs_after = []
    _train(compiled, model, lambda step: masks[step], backend,
           on_step=lambda step, mask: graphs_after.append(_op_graphs(counter)))
    first_single = counts.index(1)
    assert graphs_after == [1 + int(i >= first_single) for i in range(STEPS)]
    assert _cache_entries(Block.forward) == 2
    assert _graph_breaks() == 0


def test_slice_values_never_recompile():
    """Same slice count, new values every call: one compilation, each result equal to eager."""
    model = Block(_attn_range)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    rng = random.Random(400)
    masks = []
    for _ in range(12):
        # Mixed types, overlaps, uncovered rows: values only matter to the kernel.
        rows = [sorted(rng.sample(range(T_TRAIN + 1), 2)) for _ in range(9)]
        cols = [sorted(rng.sample(range(T_TRAIN + 1), 2)) for _ in range(9)]
        types = [rng.randrange(4) for _ in range(9)]
        masks.append(RangeMask(rows, cols, types))
    _train(compiled, model, lambda step: masks[step], "aot_eager", steps=len(masks))
    assert counter.frame_count == 1
    assert _graph_breaks() == 0


# ------------------------------------------------------------- padding and order change no bit


def _random_slices(rng, Tq, Tk, n):
    rows = []
    for s in range(n):
        qs = rng.randrange(Tq)
        ks = rng.randrange(Tk)
        rows.append(((qs, rng.randint(qs + 1, Tq)), (ks, rng.randint(ks + 1, Tk)), s % 4))
    return rows


def _tensors(rows):
    return (
        torch.tensor([r[0] for r in rows], dtype=torch.int32).reshape(-1, 2),
        torch.tensor([r[1] for r in rows], dtype=torch.int32).reshape(-1, 2),
        torch.tensor([r[2] for r in rows], dtype=torch.int32).reshape(-1),
    )


def _attention_and_grads(fn, q, k, v, mask_args, dout, dlse):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v, *mask_args)
    finite = torch.isfinite(lse)
    loss = (out * dout).sum() + (torch.where(finite, lse, torch.zeros_like(lse)) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, [q, k, v])
    return out.detach(), lse.detach(), dq, dk, dv


@pytest.mark.parametrize(
    "Tq,Tk,Hq,Hkv,softcap",
    [
        pytest.param(37, 37, 4, 2, 0.0, id="T37-gqa2"),
        pytest.param(29, 53, 4, 1, 4.0, id="Tq29-Tk53-mqa4-softcap"),
    ],
)
def test_padding_and_permutation_are_bitwise_invisible(Tq, Tk, Hq, Hkv, softcap):
    rng = random.Random(Tq * 1000 + Tk)
    rows = _random_slices(rng, Tq, Tk, 11)
    padded = list(rows)
    for _ in range(9):  # empty slices at the front, the middle and the end
        padded.insert(rng.randint(0, len(padded)), ((0, 0), (0, 0), rng.randrange(4)))
    padded.append(((5, 5), (0, Tk), 0))  # empty in q only
    padded.insert(0, ((0, Tq), (7, 7), 1))  # empty in k only
    permuted = list(padded)
    rng.shuffle(permuted)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(Tq, Hq, 16, generator=g)
    k = torch.randn(Tk, Hkv, 16, generator=g)
    v = torch.randn(Tk, Hkv, 16, generator=g)
    dout = torch.randn(Tq, Hq, 16, generator=g)
    dlse = torch.randn(Tq, Hq, generator=g)

    def attn(q, k, v, qr, kr, mt):
        return flashrange.range_attention(q, k, v, qr, kr, mt, softcap=softcap)

    want = _attention_and_grads(attn, q, k, v, _tensors(rows), dout, dlse)
    for variant in (padded, permuted):
        got = _attention_and_grads(attn, q, k, v, _tensors(variant), dout, dlse)
        _assert_same(got, want, exact=True)
    # Through a compiled function too: the padded, permuted list gives eager's bits.
    compiled = torch.compile(attn, backend="aot_eager", fullgraph=True)
    got = _attention_and_grads(compiled, q, k, v, _tensors(permuted), dout, dlse)
    _assert_same(got, want, exact=True)
