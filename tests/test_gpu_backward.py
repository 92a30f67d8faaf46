"""The Triton backward on a CUDA GPU: realistic sizes, a random-slice fuzz, invariance, compile contract.

Skipped cleanly without CUDA (``pytest -m gpu`` selects these). Accuracy
follows the same three-way rule as ``tests/test_kernel_backward.py``
(``golden.assert_three_way``: golden = the reference on float64 inputs;
budget = twice the reference's error in the test dtype, per row and per
tensor, plus the small eps terms that rounding P and dS to the input dtype
before the tensor-core products costs, as in every flash attention).

The forward used by the autograd tests is the CUDA slot of ``flashrange::fwd``,
which must be the Triton forward (``test_cuda_forward_is_the_triton_kernel``).
"""

from __future__ import annotations

import random

import pytest
import torch
from golden import (assert_three_way, causal_documents, grad_inputs, heads_padded_view, heaviest_block_document,
                    random_slice_rows, short_slice_rows, shuffled_and_padded)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available():
    import flashrange
    import flashrange.ops  # noqa: F401
    from flashrange import reference
    from flashrange.kernels.backward import range_attention_backward_triton

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3
DEV = "cuda"


def _ranges(rows, device=DEV):
    t = torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _docs(T, n_docs, seed, mtype=CAUSAL):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n_docs - 1))
    b = [0] + cuts + [T]
    return [(b[i], b[i + 1], b[i], b[i + 1], mtype) for i in range(n_docs)]


def _window(T, w):
    """Causal sliding window of ``w`` keys (own key included) as ranges: two slices per ``w`` rows.

    Rows ``[a, a + w)`` see keys ``[a - w + 1, a + w)`` cut by both diagonals.
    """
    rows = [(0, min(w, T), 0, min(w, T), CAUSAL)]
    a = w
    while a < T:
        e = min(a + w, T)
        # Query i in [a, e) sees keys [i - w + 1, i]: a BI_CAUSAL band of Lk - Lq = w - 1.
        rows.append((a, e, a - w + 1, e, BI_CAUSAL))
        a = e
    return rows


def _inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse=True):
    return grad_inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse, device=DEV)


def _three_way(Tq, Tk, Hq, Hkv, D, Dv, rows, dtype, *, softcap=0.0, seed=0, with_dlse=True, golden=True, config=None):
    """Kernel gradients checked against the reference; returns ``(grads, inputs)``.

    ``golden=False`` (large sizes) uses the reference's float32 math on the
    low-precision inputs as the golden result and the same budget rule.
    """
    q, k, v, do, dlse = _inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse)
    qr, kr, mt = _ranges(rows)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, None, softcap)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, softcap, dlse, config=config)
    if golden:
        f64 = [t.double() for t in (q, k, v)]
        o64, l64 = reference.range_attention_forward(*f64, qr, kr, mt, None, softcap)
        gold = reference.range_attention_backward(do.double(), *f64, o64, l64, qr, kr, mt, None, softcap, dlse)
        ref = reference.range_attention_backward(do, q, k, v, out, lse, qr, kr, mt, None, softcap, dlse)
    else:
        gold = [t.double() for t in reference.range_attention_backward(
            do.float(), q.float(), k.float(), v.float(), out.float(), lse, qr, kr, mt, None, softcap, dlse)]
        ref = [t.to(dtype) for t in gold]
    for name, g, r, x in zip(("dq", "dk", "dv"), gold, ref, got):
        assert_three_way(name, x, r, g)
    return got, (q, k, v, do, out, lse, dlse, qr, kr, mt)


def test_cuda_forward_is_the_triton_kernel():
    """The autograd tests below run ``flashrange::fwd`` on CUDA: it must be the Triton forward, bit for bit."""
    from flashrange.kernels.forward import range_attention_forward_triton

    q, k, v, _, _ = _inputs(97, 83, 4, 2, 64, 64, torch.bfloat16, 0)
    qr, kr, mt = _ranges([(0, 97, 0, 83, CAUSAL), (10, 40, 5, 60, FULL), (0, 0, 0, 0, FULL)])
    out, lse = flashrange.range_attention(q, k, v, qr, kr, mt)
    want = range_attention_forward_triton(q, k, v, qr, kr, mt, 64 ** -0.5, 0.0)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


# (name, Tq, Hq, Hkv, D, rows-builder, dtype, softcap, golden)
REALISTIC = [
    pytest.param(8192, 4, 4, 128, lambda T: [(0, T, 0, T, FULL)], torch.bfloat16, 0.0, True, id="full-8k-D128-bf16"),
    pytest.param(32768, 2, 2, 128, lambda T: [(0, T, 0, T, CAUSAL)], torch.bfloat16, 0.0, False,
                 id="causal-32k-D128-bf16"),
    pytest.param(32768, 8, 2, 64, lambda T: _docs(T, 16, 1), torch.bfloat16, 0.0, False,
                 id="doc16-32k-D64-gqa4-bf16"),
    pytest.param(32768, 4, 1, 128, lambda T: _docs(T, 128, 2), torch.float16, 0.0, False,
                 id="doc128-32k-D128-mqa4-fp16"),
    pytest.param(32768, 2, 2, 128, lambda T: _window(T, 2048), torch.bfloat16, 0.0, False,
                 id="window2048-32k-D128-bf16"),
    pytest.param(4099, 4, 2, 96, lambda T: _docs(T, 5, 3), torch.bfloat16, 30.0, True,
                 id="doc5-4099-D96-softcap-bf16"),
    pytest.param(3001, 2, 1, 192, lambda T: [(0, T, 0, T, CAUSAL), (0, 1000, 500, 3001, FULL)], torch.bfloat16,
                 0.0, True, id="overlap-3001-D192-bf16"),
    pytest.param(2053, 2, 2, 256, lambda T: [(0, T, 0, T, BI_CAUSAL), (7, 2000, 0, 1500, INV_CAUSAL)],
                 torch.float16, 0.0, True, id="bi-inv-2053-D256-fp16"),
    pytest.param(2049, 3, 3, 32, lambda T: [(0, T, 0, T, CAUSAL)], torch.bfloat16, 0.0, True,
                 id="causal-2049-D32-bf16"),
]


@pytest.mark.parametrize("T,Hq,Hkv,D,build,dtype,softcap,golden", REALISTIC)
def test_realistic_sizes(T, Hq, Hkv, D, build, dtype, softcap, golden):
    _three_way(T, T, Hq, Hkv, D, D, build(T), dtype, softcap=softcap, seed=T, golden=golden)


def _grad_fuzz(seed, n_cases, fixed_Tq, max_T, head_dims, config_for=None):
    """Random small problems, three-way checked: all types, overlaps, empties, uncovered rows, GQA, softcap.

    ``head_dims``: one (drawn from ``rng`` only when there are several);
    ``config_for(D, dtype)``: a config to force, or the default.
    """
    rng = random.Random(seed)
    for case in range(n_cases):
        Tq = rng.choice(fixed_Tq + [rng.randint(1, max_T)])
        Tk = rng.choice([Tq, 1, 33, rng.randint(1, max_T)])
        Hkv = rng.choice([1, 2])
        Hq = Hkv * rng.choice([1, 2, 4])
        D = head_dims[0] if len(head_dims) == 1 else rng.choice(head_dims)
        dtype = torch.float16 if rng.random() < 0.2 else torch.bfloat16
        softcap = 4.0 if rng.random() < 0.2 else 0.0
        uncovered = rng.choice([0, 0, min(3, Tq - 1)])
        rows = random_slice_rows(Tq, Tk, rng.randint(1, 10), rng, n_empty=rng.randint(0, 3), uncovered=uncovered,
                                random_types=True, mixed_empties=False)
        config = None if config_for is None else config_for(D, dtype)
        try:
            (dq, dk, dv), _ = _three_way(Tq, Tk, Hq, Hkv, D, D, rows, dtype, softcap=softcap, seed=case,
                                         config=config)
        except AssertionError as e:
            raise AssertionError(f"case {case}: Tq={Tq} Tk={Tk} Hq={Hq} Hkv={Hkv} D={D} {dtype} "
                                 f"softcap={softcap} rows={rows}: {e}") from None
        if uncovered:
            assert torch.count_nonzero(dq[Tq - uncovered:]) == 0, f"case {case}"


def test_random_slice_fuzz():
    """1000 random small problems through the default kernels, odd lengths."""
    # One head dim keeps the number of kernel builds small (head dims 16-256 are
    # covered above and by the CPU tests).
    _grad_fuzz(1234, 1000, [1, 2, 17, 63, 64, 65], 300, [64])


def test_bitwise_rerun_permutation_padding():
    T = 8191
    rows = _docs(T, 37, 5) + [(100, 3000, 50, 2900, FULL), (4000, 8191, 4000, 8000, INV_CAUSAL)]
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, *_ ) = _three_way(T, T, 8, 2, 128, 128, rows, torch.bfloat16,
                                                                  seed=9, golden=False)
    shuffled, padded = shuffled_and_padded(rows, random.Random(3), 23)
    for variant in (rows, rows, shuffled, padded):
        qr, kr, mt = _ranges(variant)
        got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse)
        for a, b in zip((dq, dk, dv), got):
            assert torch.equal(a, b)


def _op_args(Tq=97, Tk=83, Hq=4, Hkv=2, D=64, dtype=torch.bfloat16):
    rows = [(0, 97, 0, 83, CAUSAL), (10, 40, 5, 60, FULL), (0, 0, 0, 0, FULL), (50, 97, 20, 83, BI_CAUSAL)]
    q, k, v, do, dlse = _inputs(Tq, Tk, Hq, Hkv, D, D, dtype, 0)
    qr, kr, mt = _ranges(rows)
    return q, k, v, do, dlse, qr, kr, mt


def test_opcheck_bwd_and_fwd_on_cuda():
    q, k, v, do, dlse, qr, kr, mt = _op_args()
    plan = list(torch.ops.flashrange.plan(qr, kr, mt, q.shape[0], k.shape[0]))
    torch.library.opcheck(torch.ops.flashrange.plan.default, (qr, kr, mt, q.shape[0], k.shape[0]))
    out, lse = torch.ops.flashrange.fwd(q, k, v, qr, kr, mt, plan, 0.125, 0.0)
    torch.library.opcheck(
        torch.ops.flashrange.bwd.default, (do, dlse, q, k, v, out, lse, qr, kr, mt, plan, 0.125, 0.0)
    )
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.flashrange.fwd.default, (qg, kg, vg, qr, kr, mt, plan, 0.125, 2.0))


def _loss(wq, wk, wv, x, qr, kr, mt, Hq, Hkv, D):
    T = x.shape[0]
    q = (x @ wq).view(T, Hq, D)
    k = (x @ wk).view(T, Hkv, D)
    v = (x @ wv).view(T, Hkv, D)
    out, lse = flashrange.range_attention(q, k, v, qr, kr, mt)
    return out.float().square().mean() + 1e-3 * torch.where(torch.isfinite(lse), lse, 0.0).mean()


def _train_step(wq, wk, wv, x, qr, kr, mt, Hq, Hkv, D, loss_fn=_loss):
    """Forward and backward (through ``flashrange::bwd``): gradients of the projection weights."""
    return torch.autograd.grad(loss_fn(wq, wk, wv, x, qr, kr, mt, Hq, Hkv, D), (wq, wk, wv))


def _train_setup(T=1000, C=256, Hq=4, Hkv=2, D=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, C, generator=g, device=DEV).bfloat16()
    ws = [(torch.randn(C, h * D, generator=g, device=DEV) / C ** 0.5).bfloat16().requires_grad_()
          for h in (Hq, Hkv, Hkv)]
    return x, ws


def _close(a, b):
    """Same kernels, different launch orders / graphs: equal up to float32 accumulation noise."""
    return (a.float() - b.float()).abs().max().item() <= 1e-2 * max(1e-6, b.float().abs().max().item())


def test_compiled_training_step_fullgraph():
    x, (wq, wk, wv) = _train_setup()
    qr, kr, mt = _ranges(_docs(1000, 7, 4) + [(0, 0, 0, 0, FULL)] * 3)
    eager = _train_step(wq, wk, wv, x, qr, kr, mt, 4, 2, 64)
    compiled_loss = torch.compile(_loss, fullgraph=True)
    compiled = _train_step(wq, wk, wv, x, qr, kr, mt, 4, 2, 64, loss_fn=compiled_loss)
    for a, b in zip(compiled, eager):
        assert _close(a, b)
    # New slice values, same count: new gradients from the same compiled graphs.
    qr2, kr2, mt2 = _ranges(_docs(1000, 10, 8))
    again = _train_step(wq, wk, wv, x, qr2, kr2, mt2, 4, 2, 64, loss_fn=compiled_loss)
    expected = _train_step(wq, wk, wv, x, qr2, kr2, mt2, 4, 2, 64)
    for a, b, old in zip(again, expected, eager):
        assert _close(a, b) and not _close(old, b)


def test_compiled_training_step_reduce_overhead():
    """``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graphs, no Python between the kernels): the
    forward and backward graphs are captured once and replayed for every mask of the same slice count, with
    the gradients of eager steps and no recompilation."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    x, (wq, wk, wv) = _train_setup(seed=5)
    masks = [_ranges(rows) for rows in (_docs(1000, 7, 21) + [(0, 0, 0, 0, FULL)] * 2, _docs(1000, 9, 22),
                                        _docs(1000, 3, 23) + [(0, 0, 0, 0, FULL)] * 6)]
    torch._dynamo.reset()
    counters.clear()
    compiled_loss = torch.compile(_loss, mode="reduce-overhead", fullgraph=True)
    got = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(6):
            torch.compiler.cudagraph_mark_step_begin()
            grads = _train_step(wq, wk, wv, x, *masks[step % 3], 4, 2, 64, loss_fn=compiled_loss)
            got.append([g.clone() for g in grads])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    expected = [_train_step(wq, wk, wv, x, *m, 4, 2, 64) for m in masks]
    for step, grads in enumerate(got):
        for a, b in zip(grads, expected[step % 3]):
            assert _close(a, b), step
    # The three masks give different gradients: each replay followed its own ranges.
    assert not _close(expected[0][0], expected[1][0]) and not _close(expected[1][0], expected[2][0])


def test_cuda_graph_training_step_replays_after_range_update():
    x, (wq, wk, wv) = _train_setup(seed=1)
    cap = 12
    rows_a = _docs(1000, 9, 11) + [(0, 0, 0, 0, FULL)] * 3
    rows_b = _docs(1000, 12, 12)
    qr, kr, mt = _ranges(rows_a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: compile the kernels outside the capture
            _train_step(wq, wk, wv, x, qr, kr, mt, 4, 2, 64)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = _train_step(wq, wk, wv, x, qr, kr, mt, 4, 2, 64)
    for rows in (rows_b, rows_a):
        assert len(rows) == cap
        new = _ranges(rows)
        for dst, src in zip((qr, kr, mt), new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expected = _train_step(wq, wk, wv, x, *new, 4, 2, 64)
        for a, b in zip(static_grads, expected):
            assert _close(a, b)
        if rows is rows_b:
            grads_b = [g.clone() for g in static_grads]
    # The two masks give different gradients, so the replays did follow the updated ranges.
    assert not all(_close(a, b) for a, b in zip(grads_b, static_grads))


def test_training_step_has_no_host_sync(monkeypatch):
    """A default forward + backward under ``set_sync_debug_mode("error")``: nothing switched off
    (``FLASHRANGE_STRICT`` unset, default arguments), only a first step before it to build the kernels."""
    monkeypatch.delenv("FLASHRANGE_STRICT", raising=False)
    x, (wq, wk, wv) = _train_setup(seed=2)
    qr, kr, mt = _ranges(_docs(1000, 6, 13) + [(0, 0, 0, 0, FULL)])
    _train_step(wq, wk, wv, x, qr, kr, mt, 4, 2, 64)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = _train_step(wq, wk, wv, x, qr, kr, mt, 4, 2, 64)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(g).all() for g in grads)
    # The same step outside the mode gives the same gradients (the mode changed nothing).
    again = _train_step(wq, wk, wv, x, qr, kr, mt, 4, 2, 64)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))


def test_offsets_past_int32_in_a_strided_view():
    """q, k, v views into a fused buffer whose rows are 2**21 + 64 elements apart: element offsets pass 2**31
    at row 1024 while each view holds a few MB. The backward (and forward) must use 64-bit row offsets: same
    bits as contiguous copies, three-way accurate (tests/test_kernel_backward.py has the CPU twin)."""
    from flashrange.kernels.common import needs_int64
    from flashrange.kernels.forward import range_attention_forward_triton

    T, Hq, Hkv, D = 1100, 4, 2, 64
    stride = 2**21 + 64
    buf = torch.empty(T, stride, dtype=torch.bfloat16, device=DEV)  # 4.6 GB
    g = torch.Generator(device=DEV).manual_seed(11)
    width = (Hq + 2 * Hkv) * D
    buf[:, :width] = torch.randn(T, width, generator=g, device=DEV).to(torch.bfloat16)
    q = buf[:, :Hq * D].view(T, Hq, D)
    k = buf[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
    v = buf[:, (Hq + Hkv) * D:width].view(T, Hkv, D)
    assert (T - 1) * q.stride(0) >= 2**31 and needs_int64(q)
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    rows = _docs(T, 5, 21) + [(0, T, 0, T, INV_CAUSAL), (1000, T, 0, 1050, FULL)]
    qr, kr, mt = _ranges(rows)
    do = torch.randn(T, Hq, D, generator=g, device=DEV).to(torch.bfloat16)
    dlse = torch.randn(T, Hq, generator=g, device=DEV)
    out, lse = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.125, 0.0)
    want = range_attention_forward_triton(qc, kc, vc, qr, kr, mt, 0.125, 0.0)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, 0.125, 0.0, dlse)
    torch.cuda.synchronize()
    want = range_attention_backward_triton(do, qc, kc, vc, out, lse, qr, kr, mt, 0.125, 0.0, dlse)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    f64 = [t.double() for t in (qc, kc, vc)]
    o64, l64 = reference.range_attention_forward(*f64, qr, kr, mt, 0.125, 0.0)
    gold = reference.range_attention_backward(do.double(), *f64, o64, l64, qr, kr, mt, 0.125, 0.0, dlse)
    ref = reference.range_attention_backward(do, qc, kc, vc, out, lse, qr, kr, mt, 0.125, 0.0, dlse)
    for name, g_, r, x in zip(("dq", "dk", "dv"), gold, ref, got):
        assert_three_way(name, x, r, g_)
    del buf


# ---------------------------------------------------------------------------------------------
# The Hopper (Gluon) dK/dV and dQ kernels: the default, its fallback, and the kernels forced.

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _gluon_config(D, Dv, dtype, persistent=False, dynamic=False, adaptive=False, row_intervals=False):
    import dataclasses

    from flashrange.kernels.backward import default_config

    return dataclasses.replace(default_config(D, Dv, dtype, torch.device(DEV)), kv_block_n=128, q_block_m=128,
                               gluon_dkdv=True, gluon_dq=True, persistent=persistent, dynamic=dynamic,
                               adaptive=adaptive, kv_head_chunks=1, row_intervals=row_intervals)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels are the default on compute capability 9 only")
@pytest.mark.parametrize("n_docs, want_short", [(16, True), (1, False)], ids=["doc16-32k", "causal-8k"])
def test_backward_launcher_asks_for_the_schedule_by_mean_slot_length(monkeypatch, n_docs, want_short):
    """A call without a config asks the default for short slices from its shapes
    (constants.has_short_slices); the gradients are bitwise those of the other schedule."""
    import dataclasses

    from flashrange.kernels import backward as kbwd

    T = 32768 if n_docs > 1 else 8192
    asked, chunked = [], []
    real, real_chunks = kbwd.default_config, kbwd.kv_head_chunks_for

    def spy(*args, **kwargs):
        asked.append(kwargs.get("short_slices"))
        return real(*args, **kwargs)

    def spy_chunks(*args):
        chunked.append(real_chunks(*args))
        return chunked[-1]

    rows = _docs(T, n_docs, 3) if n_docs > 1 else [(0, T, 0, T, CAUSAL)]
    q, k, v, do, dlse = _inputs(T, T, 2, 1, 128, 128, torch.bfloat16, 4, True)
    qr, kr, mt = _ranges(rows)
    out, lse = flashrange.range_attention(q, k, v, qr, kr, mt)
    monkeypatch.setattr(kbwd, "default_config", spy)
    monkeypatch.setattr(kbwd, "kv_head_chunks_for", spy_chunks)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse)
    monkeypatch.undo()
    assert asked == [want_short]
    # 64 key blocks of one KV head at 8k are fewer than the SMs: the call split the group of two query heads
    # for the dK/dV kernel, which changes dK/dV's float32 sums; the explicit config takes the same split.
    assert len(chunked) == 1 and chunked[0] == (2 if T == 8192 else 1)
    chosen = real(128, 128, torch.bfloat16, torch.device(DEV), short_slices=want_short)
    other = dataclasses.replace(chosen, dynamic=not chosen.dynamic, kv_head_chunks=chunked[0])
    want = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse, config=other)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels are the default on compute capability 9 only")
def test_gluon_backward_is_the_default_and_builds():
    """Head dims padded to 64 or 128 in 2-byte dtypes take both Gluon kernels by default, and they build
    (no warning)."""
    import dataclasses
    import warnings

    from flashrange.kernels.backward import default_config

    for D, Dv, dtype, want_dkdv, want_dq in (
            (128, 128, torch.bfloat16, True, True), (96, 96, torch.float16, True, True),
            (64, 128, torch.bfloat16, True, True), (64, 64, torch.bfloat16, True, True),
            (64, 64, torch.float16, True, True), (32, 32, torch.bfloat16, False, False),
            (128, 128, torch.float32, False, False), (64, 64, torch.float32, False, False),
            (256, 256, torch.bfloat16, False, False)):
        cfg = default_config(D, Dv, dtype, torch.device(DEV))
        assert (cfg.gluon_dkdv, cfg.gluon_dq) == (want_dkdv, want_dq), (D, Dv, dtype)
        # The Gluon kernels run on the persistent grid (docs/design.md, "The Hopper backward").
        assert cfg.persistent == (want_dkdv or want_dq), (D, Dv, dtype)
        # Short slots on average: the dynamic schedule of the Gluon kernels ("Schedules chosen by shape").
        short = default_config(D, Dv, dtype, torch.device(DEV), short_slices=True)
        assert short.dynamic == want_dkdv, (D, Dv, dtype)
        assert dataclasses.replace(short, dynamic=False) == cfg, (D, Dv, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        # With and without a softcap: at head dim 64 they take different dQ tiles.
        for D, softcap in ((128, 20.0), (64, 20.0), (64, 0.0)):
            _three_way(1031, 1031, 4, 2, D, D, [(0, 1031, 0, 1031, CAUSAL), (100, 700, 0, 300, FULL)],
                       torch.bfloat16, softcap=softcap, seed=3)


class _Unbuildable:
    """Stands in for a Gluon kernel: every launch fails the way a compiler error does."""

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            raise RuntimeError("PassManager::run failed (a stand-in for a Gluon build error)")

        return run


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels are the default on compute capability 9 only")
def test_gluon_backward_build_failure_falls_back_with_one_warning(monkeypatch):
    import warnings

    from flashrange.kernels import backward as bwd

    def clear():
        bwd._has_gluon_sm90.cache_clear()
        bwd._default_config.cache_clear()

    monkeypatch.setattr(bwd, "_GLUON_FAILURES", [])
    monkeypatch.setattr(bwd, "_gluon_kernel", lambda name: _Unbuildable())
    clear()
    try:
        rows = [(0, 777, 0, 777, CAUSAL)]
        with pytest.warns(RuntimeWarning, match="backward kernel \\(Gluon\\) did not build"):
            (dq, dk, dv), inputs = _three_way(777, 777, 2, 2, 128, 128, rows, torch.bfloat16, seed=4)
        assert len(bwd._GLUON_FAILURES) == 1
        assert not bwd.default_config(128, 128, torch.bfloat16, torch.device(DEV)).gluon_dkdv
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            (dq2, dk2, dv2), _ = _three_way(777, 777, 2, 2, 128, 128, rows, torch.bfloat16, seed=4)
        assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)
        # A config asking for the Gluon kernels is refused once they are known not to build.
        with pytest.raises(ValueError, match="compute-capability-9 GPU"):
            _three_way(777, 777, 2, 2, 128, 128, rows, torch.bfloat16, seed=4,
                       config=_gluon_config(128, 128, torch.bfloat16))
    finally:
        monkeypatch.undo()
        clear()


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("T,Hq,Hkv,D,build,dtype,softcap,golden", [p for p in REALISTIC if p.values[3] <= 128])
def test_gluon_backward_realistic_sizes(T, Hq, Hkv, D, build, dtype, softcap, golden):
    _three_way(T, T, Hq, Hkv, D, D, build(T), dtype, softcap=softcap, seed=T, golden=golden,
               config=_gluon_config(D, D, dtype))


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,n,D,dtype", [
    pytest.param(1000, 31, 2, 2, 9, 80, torch.float16, id="9-slices-Tk31-D80-fp16"),
    pytest.param(777, 203, 8, 2, 64, 128, torch.bfloat16, id="64-slices-Tk203-D128-g4"),
    pytest.param(1500, 2049, 4, 1, 200, 64, torch.bfloat16, id="200-slices-Tk2049-D64-g4"),
])
def test_gluon_backward_many_short_slices(Tq, Tk, Hq, Hkv, n, D, dtype):
    """Many short slices, each bounded at its own ends, through both Gluon kernels on both grids, 4 inputs each.

    Their producers build a descriptor per slice (and per query head for dK/dV)
    and must not rewrite one that loads are still reading (kernels/sm90_common.py).
    """
    for seed in range(4):
        rows = short_slice_rows(Tq, Tk, n, random.Random(seed))
        for persistent in (False, True):
            try:
                _three_way(Tq, Tk, Hq, Hkv, D, D, rows, dtype, seed=seed,
                           config=_gluon_config(D, D, dtype, persistent))
            except AssertionError as e:
                raise AssertionError(f"persistent={persistent} seed {seed}: rows={rows}: {e}") from None


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("persistent, dynamic", [(False, False), (True, False), (True, True)],
                         ids=["one-program-per-item", "persistent", "dynamic"])
def test_gluon_backward_fuzz(persistent, dynamic):
    """300 random problems forced through the Gluon kernels, at the head dims they serve."""
    _grad_fuzz(4321, 300, [1, 17, 64, 65], 700, [64, 128, 96],
               config_for=lambda D, dtype: _gluon_config(D, D, dtype, persistent, dynamic))


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
def test_gluon_backward_persistent_grid_is_bitwise_the_same():
    """One program per SM walking several work items gives the same bits as one program per item.

    8191 keys in 128-key blocks over 4 key/value heads (and 8191 rows over 8 query heads) are more
    work items than the H200's SMs, so programs take several, in both kernels.
    """
    T = 8191
    rows = _docs(T, 37, 5) + [(100, 3000, 50, 2900, FULL), (4000, 8191, 4000, 8000, INV_CAUSAL)]
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, *_) = _three_way(T, T, 8, 4, 128, 128, rows, torch.bfloat16,
                                                                 seed=5, golden=False,
                                                                 config=_gluon_config(128, 128, torch.bfloat16))
    qr, kr, mt = _ranges(rows)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse,
                                          config=_gluon_config(128, 128, torch.bfloat16, persistent=True))
    for a, b in zip((dq, dk, dv), got):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("adaptive", [False, True], ids=["dynamic", "adaptive"])
@pytest.mark.parametrize("kind", ["documents", "causal"])
@pytest.mark.parametrize("D", [128, 64], ids=["d128", "d64"])
def test_gluon_backward_dynamic_schedule_is_bitwise_the_same(D, kind, adaptive):
    """Programs that take their items from a counter give the bits of the fixed share, on every call (each
    call's counters start from zero: gradients left unwritten would keep the NaN put where they are
    allocated). The adaptive schedule takes the counter on the documents and the fixed share on causal."""
    T = 8191
    rows = _backward_schedule_rows(T, kind)
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, *_) = _three_way(
        T, T, 8, 4, D, D, rows, torch.bfloat16, seed=7, golden=False,
        config=_gluon_config(D, D, torch.bfloat16, persistent=True))
    qr, kr, mt = _ranges(rows)
    for _ in range(3):
        poison = [torch.full_like(t, float("nan")) for t in (dq, dk, dv)]
        del poison
        got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse,
                                              config=_gluon_config(D, D, torch.bfloat16, persistent=True,
                                                                   dynamic=True, adaptive=adaptive))
        for a, b in zip((dq, dk, dv), got):
            assert torch.equal(a, b)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("kind", ["documents", "causal", "short"])
@pytest.mark.parametrize("D, Dv, softcap", [(128, 128, 0.0), (64, 64, 0.0), (128, 128, 20.0), (64, 128, 0.0),
                                            (96, 96, 0.0)],
                         ids=["d128", "d64", "d128-softcap", "d64-dv128", "d96"])
def test_gluon_backward_row_intervals_are_bitwise_the_inequalities(D, Dv, softcap, kind):
    """Edge tiles masked by one interval per row or key (``BwdConfig.row_intervals``) give the bits of the four
    inequalities per cell, in both kernels and both dK/dV tile orientations (held by rows at head dims 64 and
    128, by keys at 96 and with Dv 128), on documents with every slice type, a causal mask and short slices."""
    T = 8191
    if kind == "short":
        rows = short_slice_rows(T, T, 300, random.Random(3))
    else:
        rows = _backward_schedule_rows(T, kind)
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, *_) = _three_way(
        T, T, 8, 4, D, Dv, rows, torch.bfloat16, softcap=softcap, seed=13, golden=False,
        config=_gluon_config(D, Dv, torch.bfloat16, persistent=True))
    qr, kr, mt = _ranges(rows)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, softcap, dlse,
                                          config=_gluon_config(D, Dv, torch.bfloat16, persistent=True,
                                                               row_intervals=True))
    for a, b in zip((dq, dk, dv), got):
        assert torch.equal(a, b)


def _backward_schedule_rows(T, kind):
    if kind == "causal":
        return [(0, T, 0, T, CAUSAL)]
    return _docs(T, 37, 7) + [(100, 3000, 50, 2900, FULL), (4000, 8191, 4000, 8000, INV_CAUSAL)]


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("lengths", [[8191], [4096] + [16] * 255 + [15], [2048, 3000, 3143], [6000, 2191],
                                     [300] * 27 + [91]],
                         ids=["causal", "long-and-short", "three-documents", "long-first", "doc-300"])
def test_gluon_backward_adaptive_schedule_takes_tickets_only_for_short_slices(monkeypatch, lengths):
    """Each kernel's choice, read from its counter after the call: every item plus one ticket past the list per
    program when the document where the heaviest block starts (128 rows for dQ, 128 keys for dK/dV) is at
    most BWD_DYNAMIC_MAX_LEN long, none otherwise. The heaviest blocks are found here from the causal rule,
    not from the plan."""
    from flashrange.constants import BWD_DYNAMIC_MAX_LEN
    from flashrange.kernels import backward as bwd

    T, Hq, Hkv = 8191, 8, 4
    (qr, kr, mt), docs = causal_documents(lengths)
    rows = [(a, e, a, e, CAUSAL) for a, e in docs]
    (_, _, _), (q, k, v, do, out, lse, dlse, *_) = _three_way(T, T, Hq, Hkv, 128, 128, rows, torch.bfloat16, seed=9,
                                                              golden=False,
                                                              config=_gluon_config(128, 128, torch.bfloat16))
    tickets = []
    make_tickets = bwd._tickets
    monkeypatch.setattr(bwd, "_tickets", lambda dev: tickets.append(make_tickets(dev)) or tickets[-1])
    range_attention_backward_triton(do, q, k, v, out, lse, qr.to(DEV), kr.to(DEV), mt.to(DEV), None, 0.0, dlse,
                                    config=_gluon_config(128, 128, torch.bfloat16, persistent=True, dynamic=True,
                                                         adaptive=True))
    torch.cuda.synchronize()
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for counter, heads, key_major, name in ((0, Hq, False, "dQ"), (1, Hkv, True, "dK/dV")):
        n_work = -(-T // 128) * heads
        a, e = heaviest_block_document(docs, T, key_major)
        is_ticketed = e - a <= BWD_DYNAMIC_MAX_LEN
        want = n_work + min(n_work, n_sms) if is_ticketed else 0
        assert tickets[-1][counter].item() == want, f"{name}: ticketed={is_ticketed}"


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("D, softcap", [(128, 0.0), (64, 0.0), (64, 20.0)], ids=["d128", "d64", "d64-softcap"])
def test_views_the_gluon_kernels_cannot_take_run_the_triton_default(D, softcap):
    """Under the default config, inputs the Gluon kernels cannot take (a view 2 bytes off a 16-byte boundary)
    run the Triton kernels with the Triton default's tiles, not the Gluon default's (which differ at D=128 and
    D=64): the bits of that config asked for by name."""
    from flashrange.kernels.backward import BwdConfig, _gluon_takes, default_config, kv_head_chunks_for

    T = 517
    rows = _docs(T, 5, 3) + [(0, 300, 0, 200, FULL)]
    (_, (q, k, v, do, out, lse, dlse, qr, kr, mt)) = _three_way(T, T, 4, 2, D, D, rows, torch.bfloat16,
                                                                softcap=softcap, seed=11, golden=False)
    shifted = []
    for t in (do, q, k, v):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        shifted.append(view)
    assert not _gluon_takes(shifted[1], shifted[2], shifted[3], shifted[0])
    gluon_default = default_config(D, D, torch.bfloat16, torch.device(DEV), softcap=softcap != 0)
    assert gluon_default.gluon_dkdv
    # With the GQA group split as a call without a config splits it (kv_head_chunks_for: 2 KV heads of 5 key
    # blocks each give fewer work items than SMs).
    chunks = kv_head_chunks_for(-(-T // 128) * 2, 2, torch.cuda.get_device_properties(0).multi_processor_count)
    triton_default = BwdConfig(32 if D == 128 else 64, 128, 8, 3, 128, 64, 8, 3, kv_head_chunks=chunks)
    got = range_attention_backward_triton(*shifted, out, lse, qr, kr, mt, None, softcap, dlse)
    want = range_attention_backward_triton(*shifted, out, lse, qr, kr, mt, None, softcap, dlse,
                                           config=triton_default)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize(
    "D, Dv, Hq, Hkv, softcap, layout",
    [
        pytest.param(128, 128, 8, 2, 0.0, "packed", id="d128-gqa"),
        pytest.param(128, 128, 4, 4, 20.0, "packed", id="d128-softcap"),
        pytest.param(128, 128, 4, 2, 0.0, "padded-heads", id="d128-per-head-descriptors"),
        pytest.param(96, 96, 4, 2, 0.0, "packed", id="d96"),
        pytest.param(64, 128, 4, 2, 0.0, "packed", id="d64-dv128"),
        pytest.param(128, 64, 4, 2, 0.0, "packed", id="d128-dv64"),
        pytest.param(80, 112, 6, 3, 15.0, "packed", id="d80-dv112-softcap"),
        pytest.param(64, 64, 8, 2, 0.0, "packed", id="d64-gqa"),
        pytest.param(64, 64, 4, 4, 20.0, "packed", id="d64-softcap"),
        pytest.param(64, 64, 4, 2, 0.0, "padded-heads", id="d64-per-head-descriptors"),
    ],
)
def test_gluon_dkdv_by_rows_is_bitwise_the_same(D, Dv, Hq, Hkv, softcap, layout):
    """The dK/dV kernel with its scores held by rows (P and dS through shared memory; 64-row tiles at padded
    head dim 128, 128-row tiles at 64) gives the bits of the tiles half as tall held by keys: per key, the same
    additions in the same order."""
    import dataclasses

    T = 3001
    rows = (_docs(T, 19, 8) + [(100, 2000, 50, 1900, FULL), (2000, 3001, 2000, 2900, INV_CAUSAL)]
            + short_slice_rows(T, T, 120, random.Random(8)))
    by_keys = 32 if max(D, Dv) > 64 else 64
    cfg = _gluon_config(D, Dv, torch.bfloat16, persistent=True)
    keys_cfg = dataclasses.replace(cfg, kv_block_m=by_keys)
    rows_cfg = dataclasses.replace(cfg, kv_block_m=2 * by_keys)
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, qr, kr, mt) = _three_way(
        T, T, Hq, Hkv, D, Dv, rows, torch.bfloat16, softcap=softcap, seed=9, golden=False, config=keys_cfg)
    args = [do, q, k, v]
    if layout == "padded-heads":
        args = [heads_padded_view(t) for t in args]
    got = range_attention_backward_triton(*args, out, lse, qr, kr, mt, None, softcap, dlse, config=rows_cfg)
    for a, b in zip((dq, dk, dv), got):
        assert torch.equal(a, b)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernels run on compute capability 9 only")
@pytest.mark.parametrize("kind", ["docs", "short"])
def test_gluon_backward_packed_heads_is_bitwise_the_same(kind):
    """Heads side by side in each row (one descriptor per tensor, bounded ones only where a slice's last
    tile runs past its end) give the bits of per-head descriptors bounded at every slice's end."""
    from flashrange.kernels.common import packed_heads

    T = 4099
    if kind == "docs":
        rows = _docs(T, 23, 4) + [(100, 3000, 50, 2900, FULL), (3000, 4099, 3000, 4000, INV_CAUSAL)]
    else:
        rows = short_slice_rows(T, T, 300, random.Random(4))
    cfg = _gluon_config(128, 128, torch.bfloat16, persistent=True)
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, qr, kr, mt) = _three_way(T, T, 8, 2, 128, 128, rows, torch.bfloat16,
                                                                         seed=6, golden=False, config=cfg)
    assert packed_heads(q, k, v, do)
    args = [heads_padded_view(t) for t in (do, q, k, v)]
    assert not packed_heads(*args)
    got = range_attention_backward_triton(*args, out, lse, qr, kr, mt, None, 0.0, dlse, config=cfg)
    for a, b in zip((dq, dk, dv), got):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# dQ accumulated in the key-major kernel (kernels/backward_fused.py): the turns under real concurrency

# (D, Dv, dK/dV tile rows, keys, warps, stages): shapes whose sm_90 builds spill little.
FUSED_GPU = [
    pytest.param(128, 128, (32, 64, 8, 2), id="d128"),
    pytest.param(64, 64, (64, 128, 8, 2), id="d64"),
    pytest.param(96, 64, (32, 64, 8, 2), id="d96-dv64"),
]


@pytest.mark.parametrize("D, Dv, tiles", FUSED_GPU)
def test_fused_dq_backward_on_the_gpu(D, Dv, tiles):
    """Hundreds of programs adding to the same query tiles at once: gradients within the three-way budget,
    every turn due (error flag 0), and five reruns bitwise equal (the adds' order does not depend on timing)."""
    from flashrange.kernels.backward import BwdConfig
    from flashrange.kernels.backward_fused import MAX_SPINS_GPU, fused_backward
    from flashrange.kernels.common import pad_dim

    config = BwdConfig(*tiles, 64, 64, 4, 2, fused_dq=True)
    T = 3001
    rows = (_docs(T, 19, 8) + [(100, 2000, 50, 1900, FULL), (2000, 3001, 2000, 2900, INV_CAUSAL),
                               (0, T, 0, T, CAUSAL)] + short_slice_rows(T, T, 60, random.Random(3)))
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, qr, kr, mt) = _three_way(
        T, T, 8, 2, D, Dv, rows, torch.bfloat16, softcap=0.0, seed=12, config=config)
    for _ in range(5):
        again = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse, config=config)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))
    plan = flashrange.plan_mask(qr, kr, mt, T, T)
    *_, error = fused_backward(do, q, k, v, out, lse, dlse, plan, D ** -0.5, 0.0, block_m=config.kv_block_m,
                               block_n=config.kv_block_n, num_warps=config.kv_warps, num_stages=config.kv_stages,
                               dot_precision="tf32", bf16_emulated=False, block_d=pad_dim(D), block_dv=pad_dim(Dv),
                               max_spins=MAX_SPINS_GPU)
    assert int(error) == 0


# ---------------------------------------------------------------------------------------------
# A GQA group's query heads split into chunks for the dK/dV kernel (BwdConfig.kv_head_chunks)


@pytest.mark.parametrize("chunks", [2, 4], ids=["2-chunks", "4-chunks"])
def test_split_query_heads_on_hopper(chunks):
    """The default (Gluon) kernels with one KV head's 8 query heads split for dK/dV: gradients within the
    three-way budget, dQ bitwise the unsplit call's, and bitwise reruns."""
    import dataclasses

    from flashrange.kernels.backward import default_config

    default = default_config(128, 128, torch.bfloat16, torch.device(DEV))
    if not default.gluon_dkdv:
        pytest.skip("needs the Hopper (Gluon) backward kernels")
    config = dataclasses.replace(default, kv_head_chunks=chunks)
    T = 3001
    rows = _docs(T, 7, 4) + [(100, 2000, 50, 1900, FULL), (0, T, 0, T, CAUSAL), (0, 0, 0, 0, FULL)]
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, qr, kr, mt) = _three_way(
        T, T, 8, 1, 128, 128, rows, torch.bfloat16, seed=14, config=config)
    unsplit = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse, config=default)
    assert torch.equal(dq, unsplit[0])
    for _ in range(3):
        again = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse, config=config)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))


def test_default_call_splits_few_kv_items_on_hopper():
    """One KV head of 8 query heads at 3001 tokens: fewer dK/dV work items than streaming multiprocessors, so a
    call without a config splits the group (as ``kv_head_chunks_for`` says): within the three-way budget,
    bitwise the config with those chunks, bitwise on reruns."""
    import dataclasses

    from flashrange.kernels.backward import default_config, kv_head_chunks_for

    default = default_config(128, 128, torch.bfloat16, torch.device(DEV))
    if not default.gluon_dkdv:
        pytest.skip("needs the Hopper (Gluon) backward kernels")
    T, Hq = 3001, 8
    n_items = -(-T // default.kv_block_n)  # one KV head: a work item per key block
    chunks = kv_head_chunks_for(n_items, Hq, torch.cuda.get_device_properties(0).multi_processor_count)
    assert chunks > 1
    rows = _docs(T, 5, 2) + [(0, T, 0, T, CAUSAL), (7, 7, 0, 0, FULL)]
    (dq, dk, dv), (q, k, v, do, out, lse, dlse, qr, kr, mt) = _three_way(
        T, T, Hq, 1, 128, 128, rows, torch.bfloat16, seed=21)
    split = dataclasses.replace(default, kv_head_chunks=chunks)
    for config in (split, None):
        again = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse, config=config)
        assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), again))
