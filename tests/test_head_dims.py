"""Wide value heads (``Dv`` up to 512 with ``D <= 64``) and DeepSeek's MLA shape (``D = 192``, ``Dv = 128``).

On the CPU the Triton kernels run under the interpreter at small, odd sizes
that still cross several tiles and reach masked and unmasked tiles; forward
and backward follow the three-way rule (docs/design.md §10) against
the float64 golden of ``tests/golden.py`` (``dense_attention`` over
``dense_counts``), with the reference in the same low precision as the
yardstick. The limits are checked on fake CUDA tensors (no GPU needed), and
the launch configurations chosen for these shapes are checked to exist and
to fit the register budget the forward filter uses.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashrange import reference
from flashrange.constants import (MAX_HEAD_DIM, MAX_HEAD_DIM_V, SHORT_SLICES_MEAN_LEN, WIDE_V_MAX_HEAD_DIM,
                                  has_short_slices, kernel_head_dims_ok)
from golden import assert_three_way, dense_attention, dense_counts, grad_inputs, random_slice_rows

triton = pytest.importorskip("triton")

from flashrange.kernels import backward as kbwd  # noqa: E402
from flashrange.kernels import forward as kfwd  # noqa: E402

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3


def _ranges(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _golden(q, k, v, counts, scale, dout, dlse):
    """Float64 ``(out, lse)`` and ``(dq, dk, dv)`` of the dense golden (autograd, uncovered rows out of the loss)."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    out, lse = dense_attention(q64, k64, v64, counts, scale)
    finite = torch.isfinite(lse)
    loss = (out * dout.double()).sum() + torch.where(finite, lse * dlse.double(), torch.zeros_like(lse)).sum()
    grads = torch.autograd.grad(loss, (q64, k64, v64), allow_unused=True)
    grads = tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q64, k64, v64)))
    return out.detach(), lse.detach(), grads


# (Tq, Tk, Hq, Hkv, D, Dv, dtype): FA3's d=64 / dv=512, a padded wide value (Dv=320 -> 512 lanes),
# DeepSeek MLA's D=192 / Dv=128 (D padded to 256 lanes inside the kernels).
SHAPES = [
    pytest.param(37, 45, 2, 1, 64, 512, torch.bfloat16, id="D64-Dv512-gqa2-bf16"),
    pytest.param(33, 29, 2, 2, 48, 320, torch.float16, id="D48-Dv320-mha-fp16"),
    pytest.param(41, 37, 4, 2, 192, 128, torch.bfloat16, id="D192-Dv128-gqa2-bf16"),
]


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D,Dv,dtype", SHAPES)
def test_forward_and_backward_three_way(Tq, Tk, Hq, Hkv, D, Dv, dtype):
    """Random masks (every type, overlaps, empty slices, uncovered rows), a non-zero dlse."""
    q, k, v, dout, dlse = grad_inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed=Tq * 13 + Dv)
    rows = random_slice_rows(Tq, Tk, 5, random.Random(D + Dv), n_empty=2, uncovered=3)
    qr, kr, mt = _ranges(rows)
    scale = D ** -0.5
    counts = dense_counts(qr, kr, mt, Tq, Tk)
    gold_out, gold_lse, gold_grads = _golden(q, k, v, counts, scale, dout, dlse)
    dlse = torch.where(torch.isfinite(gold_lse), dlse, torch.zeros_like(dlse))

    ref_out, ref_lse = reference.range_attention_forward(q, k, v, qr, kr, mt, scale)
    out, lse = kfwd.range_attention_forward_triton(q, k, v, qr, kr, mt, scale)
    assert out.shape == (Tq, Hq, Dv) and out.dtype == dtype
    assert_three_way("out", out, ref_out, gold_out)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(gold_lse))
    fin = torch.isfinite(gold_lse)
    err, err_ref = (lse[fin].double() - gold_lse[fin]).abs().max(), (ref_lse[fin].double() - gold_lse[fin]).abs().max()
    assert err <= 2 * err_ref + 1e-5, f"lse: {float(err):.3e} vs reference {float(err_ref):.3e}"

    ref_grads = reference.range_attention_backward(dout, q, k, v, ref_out, ref_lse, qr, kr, mt, scale, 0.0, dlse)
    grads = kbwd.range_attention_backward_triton(dout, q, k, v, out, lse, qr, kr, mt, scale, 0.0, dlse)
    for name, got, ref, gold in zip(("dq", "dk", "dv"), grads, ref_grads, gold_grads):
        assert got.shape == gold.shape
        assert_three_way(name, got, ref, gold)


def test_wide_value_unmasked_tiles():
    """One large causal slice with the interpreter's small tiles: whole tiles inside the slice (no element
    mask) next to masked diagonal tiles, at Dv = 512."""
    T, D, Dv = 70, 16, 512
    q, k, v, dout, dlse = grad_inputs(T, T, 2, 1, D, Dv, torch.bfloat16, seed=5)
    qr, kr, mt = _ranges([(0, T, 0, T, CAUSAL), (5, 40, 0, 20, FULL)])
    counts = dense_counts(qr, kr, mt, T, T)
    gold_out, _, gold_grads = _golden(q, k, v, counts, 0.25, dout, dlse)
    ref_out, ref_lse = reference.range_attention_forward(q, k, v, qr, kr, mt, 0.25)
    out, lse = kfwd.range_attention_forward_triton(q, k, v, qr, kr, mt, 0.25, config="cpu_m16_n32")
    assert_three_way("out", out, ref_out, gold_out)
    ref_grads = reference.range_attention_backward(dout, q, k, v, ref_out, ref_lse, qr, kr, mt, 0.25, 0.0, dlse)
    grads = kbwd.range_attention_backward_triton(
        dout, q, k, v, out, lse, qr, kr, mt, 0.25, 0.0, dlse, config=kbwd.BwdConfig(16, 16, 4, 1, 16, 16, 4, 1)
    )
    for name, got, ref, gold in zip(("dq", "dk", "dv"), grads, ref_grads, gold_grads):
        assert_three_way(name, got, ref, gold)


# ---------------------------------------------------------------------------------------------
# Limits and launch configurations


@pytest.mark.parametrize(
    "D, Dv, ok",
    [
        (1, 1, True), (64, 512, True), (64, 257, True), (192, 128, True), (256, 256, True), (16, 512, True),
        (65, 512, False), (64, 513, False), (257, 64, False), (128, 384, False), (0, 64, False), (512, 64, False),
    ],
)
def test_supported_head_dims(D, Dv, ok):
    assert kernel_head_dims_ok(D, Dv) is ok
    assert MAX_HEAD_DIM == 256 and MAX_HEAD_DIM_V == 512 and WIDE_V_MAX_HEAD_DIM == 64


def _fake_cuda(*shape, dtype=torch.bfloat16):
    """A CUDA tensor without a GPU: fake tensors carry a device and a shape, no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(*shape, dtype=dtype, device="cuda")


def test_gpu_limit_message_names_the_supported_set():
    from flashrange.validation import check_qkv

    check_qkv(_fake_cuda(3, 2, 64), _fake_cuda(3, 2, 64), _fake_cuda(3, 2, 512))
    check_qkv(_fake_cuda(3, 2, 192), _fake_cuda(3, 2, 192), _fake_cuda(3, 2, 128))
    with pytest.raises(ValueError, match=r"got D=128, Dv=512; .*Dv up to 512 when D <= 64 \(e\.g\. D=64, Dv=512\)"):
        check_qkv(_fake_cuda(3, 2, 128), _fake_cuda(3, 2, 128), _fake_cuda(3, 2, 512))
    # The CPU (and float64 anywhere) runs the reference, whatever the head dims.
    check_qkv(torch.empty(3, 2, 128), torch.empty(3, 2, 128), torch.empty(3, 2, 640))


def test_backward_launcher_rejects_unsupported_dims():
    q = torch.zeros(4, 1, 128)
    v = torch.zeros(4, 1, 512)
    qr = torch.tensor([[0, 4]], dtype=torch.int32)
    mt = torch.tensor([FULL], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"Dv up to 512 with D <= 64.*got D=128, Dv=512"):
        kbwd.range_attention_backward_triton(v, q, q, v, v, torch.zeros(4, 1), qr, qr, mt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D, Dv", [(64, 512), (32, 384), (192, 128), (64, 256)])
def test_gpu_configs_exist_and_fit(D, Dv, dtype):
    """The GPU default (asked for a CUDA device without one: no TMA, no shared-memory query) exists, is among the
    allowed configurations, and its accumulator and score tile fit the per-thread register budget."""
    cfg = kfwd._default_config(D, Dv, dtype, "cuda", False, -1)
    allowed = kfwd._configs_for(D, Dv, dtype, "cuda", False, -1)
    assert cfg in allowed and not cfg.name.startswith("cpu_")
    bdv = kfwd.pad_dim(Dv)
    assert (cfg.BLOCK_M * bdv + cfg.BLOCK_M * cfg.BLOCK_N) // (32 * cfg.num_warps) <= 256
    bc = kbwd.default_config(D, Dv, dtype, torch.device("cuda"))
    if Dv > 256:
        # dV (kv_block_n x Dv, float32) and a dO tile per program over the threads of the program.
        assert bc.kv_block_n * bdv // (32 * bc.kv_warps) <= 64
        assert bc.q_block_m * bdv // (32 * bc.q_warps) <= 64


def test_default_paths_unchanged_for_existing_head_dims():
    """The defaults of head dims that worked before stay what they were (bitwise-stable results)."""
    assert kfwd._default_config(64, 64, torch.float32, "cuda", False, -1).name == "ptr_m64_n32_w4_s2"
    assert kfwd._default_config(256, 256, torch.float16, "cuda", False, -1).name == "ptr_m128_n64_w8_s2"
    cuda = torch.device("cuda")
    assert kbwd.default_config(128, 128, torch.bfloat16, cuda) == kbwd.BwdConfig(32, 128, 8, 3, 128, 64, 8, 3)
    assert kbwd.default_config(256, 256, torch.bfloat16, cuda) == kbwd.BwdConfig(16, 64, 8, 2, 64, 32, 8, 2)


@pytest.mark.parametrize("D, Dv", [(128, 128), (96, 96), (64, 128), (128, 64), (80, 112)],
                         ids=["d128", "d96", "d64-dv128", "d128-dv64", "d80-dv112"])
def test_hopper_backward_default_at_head_dim_128(D, Dv):
    """On Hopper (asked without one), head dims padded to 128 take both Gluon kernels, the dK/dV one walking
    64-row tiles (held by rows); elsewhere the Triton kernels and their 32-row tiles."""
    hopper = kbwd._default_config(D, Dv, torch.bfloat16, True, True)
    assert hopper == kbwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True)
    assert kbwd._default_config(D, Dv, torch.bfloat16, True, False) == kbwd.BwdConfig(32, 128, 8, 3, 128, 64, 8, 3)
    assert kbwd._default_config(D, Dv, torch.float32, True, True).gluon_dkdv is False


@pytest.mark.parametrize("D, Dv", [(128, 128), (96, 96), (64, 128)], ids=["d128", "d96", "d64-dv128"])
def test_hopper_backward_short_slices_take_the_dynamic_schedule(D, Dv):
    """Short slots on average change only the schedule of the Hopper kernels at head dim 128 (the counter's
    order, the same tiles and bits); the Triton kernels and float32 keep their defaults."""
    hopper = kbwd._default_config(D, Dv, torch.bfloat16, True, True, False, True)
    assert hopper == kbwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                                    dynamic=True)
    assert not hopper.adaptive
    for args in ((D, Dv, torch.bfloat16, True, False), (D, Dv, torch.float32, True, True)):
        assert kbwd._default_config(*args, False, True) == kbwd._default_config(*args, False, False), args


def test_hopper_forward_short_slice_default_is_the_same_tiles():
    """The forward's short-slice default at head dim 128 differs from the default only in its schedule (split
    key and value barriers, two stages): same tiles and plan block, so the same bits and the same plan; other
    head dims have no short-slice default."""
    base = kfwd._BY_NAME[kfwd._SM90_DEFAULTS[128]]
    short = kfwd._BY_NAME[kfwd._SM90_SHORT_SLICES[128]]
    assert base.adaptive and short.adaptive and short.split_kv and not base.split_kv
    assert (short.BLOCK_M, short.BLOCK_N, short.num_warps) == (base.BLOCK_M, base.BLOCK_N, base.num_warps)
    assert short.gluon and short.persistent and short.merge and short.dynamic
    assert set(kfwd._SM90_SHORT_SLICES) == {128}


def test_hopper_forward_default_at_head_dim_64_is_adaptive():
    """Head dim 64's Hopper default is the adaptive schedule over the merged-tile kernel's tiles and ring
    (the same bits as the fixed share, sm90pppm), for long and short slots alike."""
    d64 = kfwd._BY_NAME[kfwd._SM90_DEFAULTS[64]]
    fixed = kfwd._BY_NAME["sm90pppm_m128_n128_w4_s3"]
    assert d64.adaptive and d64.dynamic and not d64.split_kv
    assert (d64.BLOCK_M, d64.BLOCK_N, d64.num_warps, d64.num_stages) == (
        fixed.BLOCK_M, fixed.BLOCK_N, fixed.num_warps, fixed.num_stages)
    assert d64.gluon and d64.persistent and d64.merge and d64.pingpong


def test_hopper_forward_default_by_slot_length(monkeypatch):
    """With the Gluon configs allowed (as on Hopper), short slots take the short-slice default, long ones the
    default; a short-slice config the device cannot run (shared memory) leaves the default, not the Triton
    kernel; other dtypes and head dims are untouched."""
    base = kfwd._BY_NAME[kfwd._SM90_DEFAULTS[128]]
    short = kfwd._BY_NAME[kfwd._SM90_SHORT_SLICES[128]]
    pick = kfwd._default_config.__wrapped__
    monkeypatch.setattr(kfwd, "_configs_for", lambda *args: list(kfwd.FWD_CONFIGS))
    assert pick(128, 128, torch.bfloat16, "cuda", False, 0, True) is short
    assert pick(128, 128, torch.bfloat16, "cuda", False, 0, False) is base
    assert pick(96, 128, torch.float16, "cuda", False, 0, True) is short
    assert pick(64, 64, torch.bfloat16, "cuda", False, 0, True) is kfwd._BY_NAME[kfwd._SM90_DEFAULTS[64]]
    assert not pick(128, 128, torch.float32, "cuda", False, 0, True).gluon
    monkeypatch.setattr(kfwd, "_configs_for", lambda *args: [c for c in kfwd.FWD_CONFIGS if c is not short])
    assert pick(128, 128, torch.bfloat16, "cuda", False, 0, True) is base


@pytest.mark.parametrize("Tq, Tk, n_slots, want", [
    (32768, 32768, 16, True),      # documents of 2048 tokens
    (32768, 32768, 8, True),       # exactly SHORT_SLICES_MEAN_LEN on average
    (32768, 32768, 7, False),
    (8192, 8192, 1, False),        # one slice of 8192 tokens
    (4095, 4095, 1, True),
    (1000, 9000, 2, False),        # the longer axis counts
    (9000, 9000, 0, False),        # no slot
], ids=["doc16-32k", "mean-4096", "mean-4681", "causal-8k", "one-short", "cross-long-keys", "no-slots"])
def test_has_short_slices(Tq, Tk, n_slots, want):
    assert has_short_slices(Tq, Tk, n_slots) is want
    assert SHORT_SLICES_MEAN_LEN == 4096


@pytest.mark.parametrize("softcap", [False, True], ids=["no-softcap", "softcap"])
def test_hopper_backward_default_at_head_dim_64(softcap):
    """On Hopper (asked without one), head dim 64 takes both Gluon kernels; the dQ kernel walks 128-key tiles
    except with a softcap (64-key tiles, the same bits); short slots on average take the dynamic schedule of
    the same tiles, as at head dim 128; elsewhere the Triton kernels' 64-key tiles, whatever the slots."""
    want_n = 64 if softcap else 128
    for short in (False, True):
        hopper = kbwd._default_config(64, 64, torch.bfloat16, True, True, softcap, short)
        assert hopper == kbwd.BwdConfig(64, 128, 8, 3, 128, want_n, 8, 3, gluon_dkdv=True, gluon_dq=True,
                                        persistent=True, dynamic=short)
        assert not hopper.adaptive
        other = kbwd._default_config(64, 64, torch.bfloat16, True, False, softcap, short)
        assert other == kbwd.BwdConfig(64, 128, 8, 3, 128, 64, 8, 3)

