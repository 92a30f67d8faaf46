"""GPU tests of learnable sinks, max logits and wide value heads (marked ``gpu``; skipped without a GPU).

The kernels path at realistic sizes against float64 goldens (the goldens of
``tests/test_sinks.py`` and ``tests/test_max_logits.py``, ``golden.dense_attention``)
with the three-way rule, the reference on the GPU in the same low precision
as the yardstick; the eager path against the ops bit for bit; sinks under
``torch.compile``, CUDA-graph replay after in-place range updates and the
sync-debug mode; max logits for several launch configurations; every
forward configuration that serves ``D = 64 / Dv = 512`` and ``D = 192 / Dv = 128``; masks converted
from dense masks, mask_mods and ``BlockMask``s on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import flashrange
from flashrange import ops, reference
from flashrange.interface import merge_sink
from golden import assert_sink_three_way, assert_three_way, dense_attention, dense_counts, grad_inputs
from test_max_logits import golden_max_logits
from test_sinks import golden_sink_attention, replay_function

pytestmark = pytest.mark.gpu
DEV = "cuda"
FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _ranges(rows, device=DEV):
    t = torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _docs(T, n, seed, uncovered=0):
    """``n`` causal documents over ``[0, T - uncovered)``, random lengths; rows past them uncovered."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(T - uncovered - 1, generator=g)[: n - 1].add(1).tolist())
    bounds = [0] + cuts + [T - uncovered]
    return [(a, b, a, b, CAUSAL) for a, b in zip(bounds[:-1], bounds[1:])]


def _inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse=True):
    return grad_inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed, with_dlse, device=DEV)


# The reference backward on given forward outputs (the kernels'): the yardstick of the gradients.
_RefReplay = replay_function(reference.range_attention_backward)


def _grads(fn, leaves, dout, dlse):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out, lse = fn(*leaves)
    loss = (out.float() * dout.float()).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)


# ---------------------------------------------------------------------------------------------
# Sinks


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_kernels_three_way(dtype):
    """Packed causal documents, a sliding band over them, uncovered rows; two sinks per head; GQA 4.

    The reference's gradients come from its backward on the kernels' forward outputs (``replay_function``;
    why: :func:`golden.assert_sink_three_way`), its out and lse from its own forward.
    """
    T, Hq, Hkv, D = 1536, 8, 2, 128
    q, k, v, dout, dlse = _inputs(T, T, Hq, Hkv, D, D, dtype, seed=1)
    sink = torch.randn(2, Hq, device=DEV, generator=torch.Generator(device=DEV).manual_seed(2)) * 2
    # The band: keys [i - 50, i + 50] of rows 200..899 (BI_CAUSAL needs Lk >= Lq, or it covers nothing).
    rows = _docs(T, 5, seed=3, uncovered=100) + [(200, 900, 150, 1000, BI_CAUSAL), (0, 0, 0, 0, FULL)]
    qr, kr, mt = _ranges(rows)
    scale = D ** -0.5
    counts = dense_counts(qr.cpu(), kr.cpu(), mt.cpu(), T, T).to(DEV)
    assert int(counts.max()) == 2 and not counts[T - 100:].any()  # overlaps, uncovered rows

    def golden(q, k, v, s):
        return golden_sink_attention(q, k, v, counts, s, scale)

    gold = _grads(golden, [t.double() for t in (q, k, v, sink)], dout, dlse)
    got = _grads(
        lambda q, k, v, s: flashrange.range_attention(q, k, v, qr, kr, mt, softmax_scale=scale, sink=s),
        (q, k, v, sink), dout, dlse,
    )
    with torch.no_grad():
        out_k, lse_k = flashrange.range_attention(q, k, v, qr, kr, mt, softmax_scale=scale)  # the same forward
        merged = merge_sink(out_k, lse_k, sink)
        assert torch.equal(merged[0], got[0]) and torch.equal(merged[1], got[1])
        ref_out, ref_lse = merge_sink(*reference.range_attention_forward(q, k, v, qr, kr, mt, scale), sink)
    ref_grads = _grads(
        lambda q, k, v, s: merge_sink(*_RefReplay.apply(q, k, v, out_k, lse_k, qr, kr, mt, scale), s),
        (q, k, v, sink), dout, dlse,
    )[2]
    assert torch.isfinite(got[1]).all()
    assert_sink_three_way(got, (ref_out, ref_lse, ref_grads), gold, dsink_atol=1e-4)


def test_sinks_eager_path_equals_ops_bitwise():
    T, Hq, Hkv, D = 1031, 8, 2, 64
    q, k, v, dout, dlse = _inputs(T, T, Hq, Hkv, D, D, torch.bfloat16, seed=4)
    sink = torch.randn(1, Hq, device=DEV)
    qr, kr, mt = _ranges(_docs(T, 4, seed=5, uncovered=31))
    plan = flashrange.plan_mask(qr, kr, mt, T, T)
    assert ops.eager_cuda(q, k, v, qr, kr, mt)
    eager = _grads(lambda q, k, v, s: flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan, sink=s),
                   (q, k, v, sink), dout, dlse)
    op = _grads(lambda q, k, v, s: merge_sink(*ops.fwd(q, k, v, qr, kr, mt, list(plan), D ** -0.5, 0.0), s),
                (q, k, v, sink), dout, dlse)
    assert torch.equal(eager[0], op[0]) and torch.equal(eager[1], op[1])
    for a, b in zip(eager[2], op[2]):
        assert torch.equal(a, b)


def _sink_step(wq, wk, wv, sink, x, qr, kr, mt, Hq=4, Hkv=2, D=64):
    T = x.shape[0]
    out, lse = flashrange.range_attention(
        (x @ wq).view(T, Hq, D), (x @ wk).view(T, Hkv, D), (x @ wv).view(T, Hkv, D), qr, kr, mt, sink=sink
    )
    loss = out.float().square().mean() + 1e-3 * lse.mean()
    return torch.autograd.grad(loss, (wq, wk, wv, sink))


def _sink_setup(T=1000, C=256, Hq=4, Hkv=2, D=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, C, generator=g, device=DEV).bfloat16()
    ws = [(torch.randn(C, h * D, generator=g, device=DEV) / C ** 0.5).bfloat16().requires_grad_()
          for h in (Hq, Hkv, Hkv)]
    sink = torch.randn(1, Hq, generator=g, device=DEV).requires_grad_()
    return x, ws, sink


def _close(a, b, rtol=1e-2):
    return (a.float() - b.float()).abs().max().item() <= rtol * max(1e-6, b.float().abs().max().item())


def test_sinks_cuda_graph_training_step_replays_after_range_update():
    x, (wq, wk, wv), sink = _sink_setup(seed=6)
    rows_a = _docs(1000, 6, seed=7, uncovered=40) + [(0, 0, 0, 0, FULL)] * 2
    rows_b = _docs(1000, 8, seed=8)
    qr, kr, mt = _ranges(rows_a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # build the kernels outside the capture
            _sink_step(wq, wk, wv, sink, x, qr, kr, mt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _sink_step(wq, wk, wv, sink, x, qr, kr, mt)
    results = []
    for rows in (rows_b, rows_a):
        new = _ranges(rows)
        for dst, src in zip((qr, kr, mt), new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = _sink_step(wq, wk, wv, sink, x, *new)
        for a, b in zip(static, want):
            assert _close(a, b)
        results.append([g.clone() for g in static])
    assert not _close(results[0][3], results[1][3])  # the replays followed the ranges (dsink too)


def test_sinks_compiled_step_and_no_sync():
    x, (wq, wk, wv), sink = _sink_setup(seed=9)
    qr, kr, mt = _ranges(_docs(1000, 5, seed=10) + [(0, 0, 0, 0, FULL)])
    eager = _sink_step(wq, wk, wv, sink, x, qr, kr, mt)

    def loss_fn(wq, wk, wv, sink, x, qr, kr, mt):
        T = x.shape[0]
        out, lse = flashrange.range_attention(
            (x @ wq).view(T, 4, 64), (x @ wk).view(T, 2, 64), (x @ wv).view(T, 2, 64), qr, kr, mt, sink=sink
        )
        return out.float().square().mean() + 1e-3 * lse.mean()

    compiled = torch.compile(loss_fn, fullgraph=True)
    grads = torch.autograd.grad(compiled(wq, wk, wv, sink, x, qr, kr, mt), (wq, wk, wv, sink))
    for a, b in zip(grads, eager):
        assert _close(a, b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _sink_step(wq, wk, wv, sink, x, qr, kr, mt)
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ---------------------------------------------------------------------------------------------
# Max logits


@pytest.mark.parametrize("softcap", [pytest.param(0.0, id="plain"), pytest.param(20.0, id="softcap")])
@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(torch.float32, id="fp32")])
def test_max_logits_against_golden(dtype, softcap):
    T, Hq, Hkv, D = 2053, 8, 2, 128
    q, k, v, _, _ = _inputs(T, T, Hq, Hkv, D, D, dtype, seed=11)
    q = q * 2
    rows = _docs(T, 6, seed=12, uncovered=53) + [(100, 700, 1200, 1900, INV_CAUSAL), (0, 0, 0, 0, FULL)]
    qr, kr, mt = _ranges(rows)
    counts = dense_counts(qr.cpu(), kr.cpu(), mt.cpu(), T, T).to(DEV)
    gold = golden_max_logits(q, k, counts, D ** -0.5, softcap)
    out, lse, ml = flashrange.range_attention(q, k, v, qr, kr, mt, softcap=softcap, return_max_logits=True)
    assert ml.dtype == torch.float32 and ml.shape == (Hq,)
    assert (ml.double() - gold).abs().max() <= 1e-5 * (1 + gold.abs().max())
    out0, lse0 = flashrange.range_attention(q, k, v, qr, kr, mt, softcap=softcap)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    # The op path (traced calls) gives the same bits.
    plan = flashrange.plan_mask(qr, kr, mt, T, T)
    op = ops.fwd_max_logits(q, k, v, qr, kr, mt, list(plan), D ** -0.5, softcap)
    assert torch.equal(op[2], ml) and torch.equal(op[0], out)


def test_max_logits_across_configs():
    """A few launch configurations (pointer, TMA, warp-specialized where built): the same statistic."""
    from flashrange.kernels.forward import configs_for, range_attention_forward_triton

    T, Hq, Hkv, D = 1111, 4, 2, 128
    q, k, v, _, _ = _inputs(T, T, Hq, Hkv, D, D, torch.bfloat16, seed=13)
    qr, kr, mt = _ranges(_docs(T, 3, seed=14, uncovered=11))
    gold = golden_max_logits(q, k, dense_counts(qr.cpu(), kr.cpu(), mt.cpu(), T, T).to(DEV), 0.1)
    picked = {}
    for c in configs_for(D, D, torch.bfloat16):
        kind = "ws" if c.warp_spec else ("tma" if c.use_tma else "ptr")
        picked.setdefault(kind, c)
    for c in picked.values():
        out, lse, ml = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.1, config=c, return_max_logits=True)
        assert (ml.double() - gold).abs().max() <= 1e-5 * (1 + gold.abs().max()), c.name
        out0, lse0 = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.1, config=c)
        assert torch.equal(out, out0) and torch.equal(lse, lse0), c.name


def test_max_logits_cuda_graph_and_grad():
    T, Hq, Hkv, D = 1031, 8, 2, 64
    q, k, v, dout, _ = _inputs(T, T, Hq, Hkv, D, D, torch.bfloat16, seed=15)
    static = list(_ranges(_docs(T, 4, seed=16) + [(0, 0, 0, 0, FULL)]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashrange.range_attention(q, k, v, *static, return_max_logits=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, _, ml = flashrange.range_attention(q, k, v, *static, return_max_logits=True)
    new = _ranges([(0, 500, 600, 1031, FULL), (0, 0, 0, 0, FULL), (0, 0, 0, 0, FULL), (0, 0, 0, 0, FULL),
                   (0, 0, 0, 0, FULL)])
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    assert torch.equal(ml, flashrange.range_attention(q, k, v, *new, return_max_logits=True)[2])
    # With gradients: max logits are not differentiable, the rest is bitwise the plain call.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, ml2 = flashrange.range_attention(*leaves, *new, return_max_logits=True)
    assert not ml2.requires_grad
    g1 = torch.autograd.grad((out * dout).sum(), leaves)
    leaves0 = [t.clone().requires_grad_() for t in (q, k, v)]
    out0, _ = flashrange.range_attention(*leaves0, *new)
    g0 = torch.autograd.grad((out0 * dout).sum(), leaves0)
    for a, b in zip(g1, g0):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Wide value heads and the MLA shape


HEAD_DIMS = [pytest.param(64, 512, id="D64-Dv512"), pytest.param(192, 128, id="D192-Dv128"),
             pytest.param(32, 384, id="D32-Dv384")]


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("D, Dv", HEAD_DIMS)
def test_head_dims_forward_backward(D, Dv, dtype):
    T, Hq, Hkv = 1200, 4, 2
    q, k, v, dout, dlse = _inputs(T, T, Hq, Hkv, D, Dv, dtype, seed=D + Dv)
    rows = _docs(T, 4, seed=17, uncovered=20) + [(300, 800, 0, 600, FULL)]
    qr, kr, mt = _ranges(rows)
    scale = D ** -0.5
    counts = dense_counts(qr.cpu(), kr.cpu(), mt.cpu(), T, T)
    gold_out, gold_lse, gold_grads = _grads(
        lambda q, k, v: dense_attention(q, k, v, counts, scale),
        [t.double().cpu() for t in (q, k, v)], dout.cpu(), dlse.cpu(),
    )
    out, lse, grads = _grads(lambda q, k, v: flashrange.range_attention(q, k, v, qr, kr, mt, softmax_scale=scale),
                             (q, k, v), dout, dlse)
    ref_out, _ = reference.range_attention_forward(q, k, v, qr, kr, mt, scale)
    # The reference's gradients from its backward on the kernels' forward outputs (docs/design.md §10): the
    # documents' first rows read one to three keys, where the kernels' out (P rounded before P @ V) carries
    # several times the reference's error into dq through delta, with a correct backward.
    ref_grads = _grads(lambda q, k, v: _RefReplay.apply(q, k, v, out, lse, qr, kr, mt, scale),
                       (q, k, v), dout, dlse)[2]
    assert out.shape == (T, Hq, Dv)
    assert_three_way("out", out.cpu(), ref_out.cpu(), gold_out)
    for name, got, ref, gold in zip(("dq", "dk", "dv"), grads, ref_grads, gold_grads):
        assert_three_way(name, got.cpu(), ref.cpu(), gold)


@pytest.mark.parametrize("D, Dv", HEAD_DIMS[:2])
def test_head_dims_every_forward_config(D, Dv):
    from flashrange.kernels.forward import configs_for, default_config, range_attention_forward_triton

    T, Hq, Hkv = 1100, 4, 1
    q, k, v, _, _ = _inputs(T, T, Hq, Hkv, D, Dv, torch.bfloat16, seed=18)
    qr, kr, mt = _ranges(_docs(T, 3, seed=19) + [(0, 400, 500, 1100, FULL)])
    counts = dense_counts(qr.cpu(), kr.cpu(), mt.cpu(), T, T)
    gold_out, _ = dense_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), counts, 0.1)
    ref_out, _ = reference.range_attention_forward(q, k, v, qr, kr, mt, 0.1)
    cfgs = configs_for(D, Dv, torch.bfloat16)
    assert default_config(D, Dv, torch.bfloat16) in cfgs
    for c in cfgs:
        out, lse = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.1, config=c)
        assert_three_way(f"out[{c.name}]", out.cpu(), ref_out.cpu(), gold_out)


# ---------------------------------------------------------------------------------------------
# Masks from other libraries, converted on the GPU


def _cuda_mask_mods(T):
    """FlexAttention-style mask_mods closing over CUDA tensors: packed causal documents, a causal window, prefix-LM."""
    cuts = sorted(torch.randperm(T - 1, generator=torch.Generator().manual_seed(21))[:6].add(1).tolist())
    document_id = torch.repeat_interleave(torch.arange(7), torch.tensor([0] + cuts + [T]).diff()).to(DEV)

    def document_causal(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx > q_idx - 300)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < 411) | (q_idx >= kv_idx)

    return {"document-causal": document_causal, "sliding-window": sliding_window, "prefix-lm": prefix_lm}


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ("document-causal", "sliding-window", "prefix-lm")])
def test_masks_converted_on_the_gpu(name):
    """``from_dense``, ``from_mask_mod`` and a CUDA ``BlockMask`` convert on the GPU to the CPU's slices, and the
    converted mask through the kernels matches a golden built from the dense mask itself."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    T, Hq, Hkv, D = 2053, 4, 2, 64
    mask_mod = _cuda_mask_mods(T)[name]
    idx = torch.arange(T, device=DEV)
    dense = mask_mod(0, 0, idx[:, None], idx[None, :])
    assert dense.is_cuda and dense.dtype == torch.bool

    on_gpu = flashrange.RangeMask.from_dense(dense)
    on_cpu = flashrange.RangeMask.from_dense(dense.cpu())
    assert all(t.is_cuda for t in on_gpu.tensors())
    for a, b in zip(on_gpu.tensors(), on_cpu.tensors()):
        assert torch.equal(a.cpu(), b)
    assert torch.equal(on_gpu.to_dense(T, T), dense)
    for other in (flashrange.RangeMask.from_mask_mod(mask_mod, T, device=DEV),
                  flashrange.RangeMask.from_mask_mod(flex.create_block_mask(mask_mod, None, None, T, T, device=DEV))):
        for a, b in zip(other.tensors(), on_gpu.tensors()):
            assert a.is_cuda and torch.equal(a, b)

    q, k, v, _, _ = _inputs(T, T, Hq, Hkv, D, D, torch.bfloat16, seed=22)
    qr, kr, mt = on_gpu.tensors()
    gold_out, _ = dense_attention(q.cpu(), k.cpu(), v.cpu(), dense.cpu().int())
    ref_out, _ = reference.range_attention_forward(q, k, v, qr, kr, mt, D ** -0.5)
    out, _ = flashrange.range_attention(q, k, v, qr, kr, mt)
    assert_three_way("out", out.cpu(), ref_out.cpu(), gold_out)
