"""The eager CUDA path (ops.fwd_eager / ops.plan_eager) equals the torch.library ops bit for bit.

Eager calls on plain CUDA tensors skip the dispatcher (docs/design.md §4);
traced calls use the ops. Both must run the same kernels on the same plan.
"""

import pytest
import torch

import flashrange
from flashrange import ops

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(Tq, Tk, Hq, Hkv, D, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(Tq, Hq, D, device=DEV, dtype=dtype, generator=g)
    k = torch.randn(Tk, Hkv, D, device=DEV, dtype=dtype, generator=g)
    v = torch.randn(Tk, Hkv, D, device=DEV, dtype=dtype, generator=g)
    qr = torch.tensor([[0, 700], [300, Tq], [5, 5], [100, 900]], dtype=torch.int32, device=DEV)
    kr = torch.tensor([[0, 800], [200, Tk], [0, 0], [50, 777]], dtype=torch.int32, device=DEV)
    mt = torch.tensor([1, 3, 0, 2], dtype=torch.int32, device=DEV)
    return q, k, v, qr, kr, mt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_eager_path_equals_ops_bitwise(dtype):
    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 128, dtype, 3)
    assert ops.eager_cuda(q, k, v, qr, kr, mt)
    plan = flashrange.plan_mask(qr, kr, mt, q.shape[0], k.shape[0])
    plan_op = torch.ops.flashrange.plan(qr, kr, mt, q.shape[0], k.shape[0])
    for a, b in zip(plan, plan_op):
        assert torch.equal(a, b)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flashrange.range_attention(*leaves, qr, kr, mt, plan=plan)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum() + lse.nan_to_num(neginf=0.0).sum(), leaves)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    out2, lse2 = torch.ops.flashrange.fwd(*leaves2, qr, kr, mt, list(plan_op), 128 ** -0.5, 0.0)
    grads2 = torch.autograd.grad((out2 * dout).sum() + lse2.nan_to_num(neginf=0.0).sum(), leaves2)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)


def test_eager_default_call_never_syncs():
    """Default settings, nothing switched off: the whole eager step runs under sync-debug "error"."""
    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 64, torch.bfloat16, 4)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = flashrange.range_attention(*leaves, qr, kr, mt)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert all(t.grad is not None for t in leaves)


def test_eager_call_in_cuda_graph_follows_in_place_range_updates():
    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 64, torch.bfloat16, 5)
    static = [t.clone() for t in (qr, kr, mt)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flashrange.range_attention(q, k, v, *static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flashrange.range_attention(q, k, v, *static)
    new = (torch.tensor([[0, 1031], [0, 0], [0, 0], [0, 0]], dtype=torch.int32, device=DEV),
           torch.tensor([[0, 1101], [0, 0], [0, 0], [0, 0]], dtype=torch.int32, device=DEV),
           torch.tensor([1, 0, 0, 0], dtype=torch.int32, device=DEV))
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    want_out, want_lse = flashrange.range_attention(q, k, v, *new)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_repeated_calls_take_the_recorded_launch_and_match_bitwise():
    """A second call with the same signature runs the recorded launch; same bits as the first (JIT) call."""
    from flashrange.kernels import forward as fwd_mod

    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 128, torch.bfloat16, 5)
    plan = flashrange.plan_mask(qr, kr, mt, q.shape[0], k.shape[0])
    fwd_mod._RECIPES.clear()
    first = flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan)
    assert len(fwd_mod._RECIPES) == 1
    second = flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan)
    # Built in the call (no plan given): the JIT path, never recorded.
    third = flashrange.range_attention(q, k, v, qr, kr, mt)
    assert len(fwd_mod._RECIPES) == 1
    for a, b, c in zip(first, second, third):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("offset", [1, 8], ids=["misaligned-2B", "misaligned-16B"])
def test_recorded_launch_follows_alignment_and_strides(offset):
    """Views with another base alignment or row stride get their own launch (never the aligned one's)."""
    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 128, torch.bfloat16, 6)
    plan = flashrange.plan_mask(qr, kr, mt, q.shape[0], k.shape[0])
    ref = flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan)
    flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan)  # recorded
    # The same values at an offset inside a larger buffer, and with a padded row stride.
    buf = torch.zeros(q.numel() + 64, device=DEV, dtype=q.dtype)
    q_off = buf[offset:offset + q.numel()].view_as(q).copy_(q)
    wide = torch.zeros(q.shape[0], q.shape[1], 136, device=DEV, dtype=q.dtype)
    q_wide = wide[:, :, :128].copy_(q)
    for variant in (q_off, q_wide):
        # The first call goes through the JIT (and records), the second takes the record:
        # the same kernel, so the same bits. A handle reused from the aligned input would
        # read misaligned tiles through TMA: far from the values, or a fault.
        first, second = (flashrange.range_attention(variant, k, v, qr, kr, mt, plan=plan) for _ in range(2))
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
        # Pointer tiles instead of TMA ones may round differently, never by more than bf16 noise.
        torch.testing.assert_close(first[0].float(), ref[0].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(first[1], ref[1], atol=1e-3, rtol=1e-3)


def test_recorded_launch_with_max_logits_and_softcap_match_jit_path():
    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 64, torch.float16, 7)
    plan = flashrange.plan_mask(qr, kr, mt, q.shape[0], k.shape[0])
    for kwargs in ({"return_max_logits": True}, {"softcap": 5.0}, {"softmax_scale": 0.3}):
        results = [flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan, **kwargs) for _ in range(3)]
        unplanned = flashrange.range_attention(q, k, v, qr, kr, mt, **kwargs)
        for r in results[1:] + [unplanned]:
            for a, b in zip(results[0], r):
                assert torch.equal(a, b), kwargs


def _in_new_thread(fn):
    """``fn()`` run in a fresh thread (its own context variables); its result, or its exception raised here."""
    import threading

    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=target)
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_forward_in_another_thread_jit_and_recorded():
    """Triton keeps its scratch allocator per thread (a context variable): the TMA forward, first and recorded
    launch, must work in a thread that never launched it before, with the same bits as the main thread."""
    from flashrange.kernels import forward as fwd_mod

    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 128, torch.bfloat16, 8)
    plan = flashrange.plan_mask(qr, kr, mt, q.shape[0], k.shape[0])
    want = flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan)  # main thread: JIT, records
    assert len(fwd_mod._RECIPES) >= 1
    recorded = _in_new_thread(lambda: flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan))
    jit = _in_new_thread(lambda: flashrange.range_attention(q, k, v, qr, kr, mt))
    for got in (recorded, jit):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_activation_checkpointing_reruns_the_forward_in_the_backward():
    """torch.utils.checkpoint runs the forward again inside the backward, on the autograd engine's thread:
    same gradients, bit for bit, as the plain training step."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 128, torch.bfloat16, 9)
    plan = flashrange.plan_mask(qr, kr, mt, q.shape[0], k.shape[0])
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[2], device=DEV, dtype=q.dtype)

    def step(use_checkpoint):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def attn(q, k, v):
            return flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan)[0]

        out = checkpoint(attn, *leaves, use_reentrant=False) if use_checkpoint else attn(*leaves)
        return out.detach(), torch.autograd.grad((out * dout).sum(), leaves)

    plain, ckpt = step(False), step(True)
    assert torch.equal(plain[0], ckpt[0])
    for a, b in zip(plain[1], ckpt[1]):
        assert torch.equal(a, b)


def test_eager_planning_skips_the_op(monkeypatch):
    """plan_mask and a call that plans inside take the eager path (no dispatcher) and give the op's plan."""
    q, k, v, qr, kr, mt = _inputs(1031, 1101, 8, 2, 64, torch.bfloat16, 5)
    plan_op = torch.ops.flashrange.plan(qr, kr, mt, q.shape[0], k.shape[0])
    ref = flashrange.range_attention(q, k, v, qr, kr, mt, plan=flashrange.RangePlan(*plan_op))

    def no_op(*args, **kwargs):
        raise AssertionError("an eager call went through the flashrange::plan op")

    monkeypatch.setattr(ops, "plan", no_op)
    plan = flashrange.plan_mask(qr, kr, mt, q.shape[0], k.shape[0])
    for a, b in zip(plan, plan_op):
        assert torch.equal(a, b)
    out, lse = flashrange.range_attention(q, k, v, qr, kr, mt)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
