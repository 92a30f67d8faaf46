"""The Triton forward kernel on a CUDA GPU (``pytest -m gpu``; skipped cleanly without one).

Realistic sizes (T up to 32k), every head dim the kernel supports, a
1000-case random-slice fuzz, bitwise determinism, CUDA-graph replay with
range tensors updated in place, no host sync, ``opcheck``, ``torch.compile``
without recompiles, and every launch configuration forced one by one.
Same three-way tolerance rule as tests/test_kernel_forward.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

triton = pytest.importorskip("triton")

import flashrange  # noqa: E402
import flashrange.ops  # noqa: E402,F401
from flashrange.kernels.forward import (  # noqa: E402
    configs_for,
    default_config,
    range_attention_forward_triton,
)
from golden import (causal_documents, dense_counts, heads_padded_view, heaviest_block_document,  # noqa: E402
                    packed_document_rows, short_slice_rows)
from test_kernel_forward import (  # noqa: E402
    BI_CAUSAL,
    CAUSAL,
    FULL,
    INV_CAUSAL,
    check_three_way,
    make_qkv,
    random_slices,
)

DEV = "cuda"


def _doc_causal(T, n_docs, seed):
    """Causal documents of random lengths covering ``[0, T)``."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n_docs - 1))
    bounds = [0] + cuts + [T]
    r = torch.tensor([[a, b] for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.int32)
    return r, r.clone(), torch.full((n_docs,), CAUSAL, dtype=torch.int32)


def _sliding_window(T, W):
    """Causal sliding window: row i reads keys [i - W, i] (a causal square, then a band)."""
    qr = torch.tensor([[0, W], [W, T]], dtype=torch.int32)
    kr = torch.tensor([[0, W], [0, T]], dtype=torch.int32)
    return qr, kr, torch.tensor([CAUSAL, BI_CAUSAL], dtype=torch.int32)


def _short_mask(T, n, seed):
    """``n`` short slices of every type in ``T x T`` (``golden.short_slice_rows``), as CPU tensors."""
    rows = short_slice_rows(T, T, n, random.Random(seed))
    return (torch.tensor(x, dtype=torch.int32) for x in ([r[:2] for r in rows], [r[2:4] for r in rows],
                                                          [r[4] for r in rows]))


def _run(q, k, v, qr, kr, mt, scale, softcap=0.0, config=None):
    return range_attention_forward_triton(
        q, k, v, qr.to(DEV), kr.to(DEV), mt.to(DEV), scale, softcap, config=config
    )


# (T, Hq, Hkv, D, dtype, mask): realistic sizes, every head dim.
LARGE = [
    pytest.param(8192, 4, 4, 128, torch.bfloat16, "causal", id="T8k-D128-causal-bf16"),
    pytest.param(8191, 4, 2, 128, torch.float16, "full", id="T8191-D128-full-g2-fp16"),
    pytest.param(32768, 2, 1, 64, torch.bfloat16, "doc16", id="T32k-D64-doc16-g2-bf16"),
    pytest.param(32768, 2, 2, 128, torch.bfloat16, "window", id="T32k-D128-window2048-bf16"),
    pytest.param(4099, 4, 1, 32, torch.bfloat16, "random", id="T4099-D32-random-g4-bf16"),
    pytest.param(3001, 2, 1, 96, torch.float16, "random", id="T3001-D96-random-g2-fp16"),
    pytest.param(2053, 2, 2, 192, torch.bfloat16, "doc16", id="T2053-D192-doc16-bf16"),
    pytest.param(2053, 2, 1, 256, torch.float16, "random", id="T2053-D256-random-g2-fp16"),
    pytest.param(1999, 2, 2, 256, torch.bfloat16, "causal", id="T1999-D256-causal-bf16"),
    pytest.param(1025, 2, 1, 48, torch.float32, "random", id="T1025-D48-random-fp32"),
]


def _mask(kind, T, seed):
    if kind == "causal":
        r = torch.tensor([[0, T]], dtype=torch.int32)
        return r, r.clone(), torch.tensor([CAUSAL], dtype=torch.int32)
    if kind == "full":
        r = torch.tensor([[0, T]], dtype=torch.int32)
        return r, r.clone(), torch.tensor([FULL], dtype=torch.int32)
    if kind == "doc16":
        return _doc_causal(T, 16, seed)
    if kind == "window":
        return _sliding_window(T, 2048)
    return random_slices(T, T, 24, seed, n_empty=3)


@pytest.mark.parametrize("T,Hq,Hkv,D,dtype,kind", LARGE)
def test_large(T, Hq, Hkv, D, dtype, kind):
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, dtype, DEV, seed=T + D)
    qr, kr, mt = _mask(kind, T, seed=T)
    out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5)
    check_three_way(q, k, v, qr, kr, mt, D ** -0.5, 0.0, out, lse)


@pytest.mark.parametrize("D", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_head_dims_softcap(D, dtype):
    T, Hq, Hkv = 777, 4, 2
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, dtype, DEV, seed=D)
    q = q * 2
    qr, kr, mt = random_slices(T, T, 12, seed=D, n_empty=2)
    for softcap in (0.0, 7.0):
        out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap)
        check_three_way(q, k, v, qr, kr, mt, D ** -0.5, softcap, out, lse)


def _fuzz(seed, n_cases, Tqs, Tks, head_dims, max_slices, config=None):
    """Random masks (garbage, overlapping, empty, edge and length-1 ranges) through the kernel, three-way checked."""
    rng = random.Random(seed)
    for case in range(n_cases):
        Tq, Tk = rng.choice(Tqs), rng.choice(Tks)
        G, Hkv = rng.choice([1, 2, 4]), rng.choice([1, 2])
        D, Dv = rng.choice(head_dims)
        dtype = rng.choice([torch.bfloat16, torch.float16])
        softcap = 5.0 if rng.random() < 0.1 else 0.0
        q, k, v = make_qkv(Tq, Tk, G * Hkv, Hkv, D, Dv, dtype, DEV, seed=case)
        qr, kr, mt = random_slices(
            Tq, Tk, rng.randint(1, max_slices), seed=case, garbage=rng.random() < 0.3, n_empty=rng.randint(0, 3)
        )
        out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap, config=config)
        try:
            check_three_way(q, k, v, qr, kr, mt, D ** -0.5, softcap, out, lse)
        except AssertionError as e:
            raise AssertionError(
                f"case {case}: Tq={Tq} Tk={Tk} G={G} Hkv={Hkv} D={D} Dv={Dv} {dtype} softcap={softcap}\n"
                f"q_ranges={qr.tolist()} k_ranges={kr.tolist()} types={mt.tolist()}\n{e}"
            ) from None


def test_fuzz_1000():
    """1000 random masks, small sizes, the default config."""
    _fuzz(1234, 1000, [1, 2, 15, 16, 17, 63, 64, 65, 127, 129, 200, 257], [1, 3, 16, 31, 64, 100, 128, 129, 255, 300],
          [(32, 32), (128, 128)], 12)


def test_bitwise_rerun_padding_permutation():
    T, Hq, Hkv, D = 8192, 4, 2, 128
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=7)
    qr, kr, mt = random_slices(T, T, 64, seed=8)
    base = _run(q, k, v, qr, kr, mt, 0.1)
    again = _run(q, k, v, qr, kr, mt, 0.1)
    perm = torch.randperm(qr.shape[0], generator=torch.Generator().manual_seed(9))
    permuted = _run(q, k, v, qr[perm], kr[perm], mt[perm], 0.1)
    zq = torch.zeros(37, 2, dtype=torch.int32)
    padded = _run(
        q, k, v, torch.cat([zq[:5], qr, zq[5:]]), torch.cat([zq[:5], kr, zq[5:]]),
        torch.cat([torch.full((5,), CAUSAL), mt, torch.full((32,), INV_CAUSAL)]).to(torch.int32), 0.1,
    )
    for other in (again, permuted, padded):
        assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])
    # Few long slices (on Hopper, the Gluon kernel's case): padding up to many slots
    # must not move the call to another kernel either.
    qr, kr, mt = _doc_causal(T, 3, seed=4)
    base = _run(q, k, v, qr, kr, mt, 0.1)
    padded = _run(q, k, v, torch.cat([qr, torch.zeros(61, 2, dtype=torch.int32)]),
                  torch.cat([kr, torch.zeros(61, 2, dtype=torch.int32)]),
                  torch.cat([mt, torch.full((61,), FULL, dtype=torch.int32)]), 0.1)
    assert torch.equal(base[0], padded[0]) and torch.equal(base[1], padded[1])


def test_cuda_graph_replay_after_in_place_update():
    T, Hq, Hkv, D = 4099, 4, 2, 64
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=17)
    qa, ka, ta = _doc_causal(T, 8, seed=1)
    qb, kb, tb = random_slices(T, T, 8, seed=2)
    qr, kr, mt = qa.to(DEV), ka.to(DEV), ta.to(DEV)
    range_attention_forward_triton(q, k, v, qr, kr, mt, 0.125, 0.0)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.125, 0.0)
    graph.replay()
    want_a = range_attention_forward_triton(q, k, v, qa.to(DEV), ka.to(DEV), ta.to(DEV), 0.125, 0.0)
    assert torch.equal(out, want_a[0]) and torch.equal(lse, want_a[1])
    qr.copy_(qb)
    kr.copy_(kb)
    mt.copy_(tb)
    graph.replay()
    want_b = range_attention_forward_triton(q, k, v, qb.to(DEV), kb.to(DEV), tb.to(DEV), 0.125, 0.0)
    assert torch.equal(out, want_b[0]) and torch.equal(lse, want_b[1])
    check_three_way(q, k, v, qb, kb, tb, 0.125, 0.0, out, lse)


def _front_end_calls(T=2049, Hq=4, Hkv=1, D=128, seed=3):
    """Default calls of every front-end on one problem: ``{name: zero-argument call}`` and the inputs."""
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, torch.float16, DEV, seed=seed)
    qr, kr, mt = (t.to(DEV) for t in random_slices(T, T, 10, seed=seed + 1))
    cu = torch.tensor([0, 700, 701, T], dtype=torch.int32, device=DEV)
    B = 3
    S = T // B
    q4, k4, v4 = (t[: B * S].view(B, S, t.shape[1], D) for t in (q, k, v))
    calls = {
        "range_attention": lambda: flashrange.range_attention(q, k, v, qr, kr, mt),
        "range_attention-plan": lambda: flashrange.range_attention(
            q, k, v, qr, kr, mt, plan=flashrange.plan_mask(qr, kr, mt, T, T)),
        "flex_flash_attn_func": lambda: flashrange.flex_flash_attn_func(q, k, v, qr, kr, mt),
        "flash_attn_func": lambda: flashrange.flash_attn_func(q4, k4, v4, causal=True, window_size=(100, 0)),
        "flash_attn_varlen_func": lambda: flashrange.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True),
    }
    return calls, (q, k, v, qr, kr, mt)


FRONT_ENDS = ["range_attention", "range_attention-plan", "flex_flash_attn_func", "flash_attn_func",
              "flash_attn_varlen_func"]


@pytest.mark.parametrize("name", FRONT_ENDS)
def test_no_host_sync(name, monkeypatch):
    """The default call of every front-end under ``set_sync_debug_mode("error")``: nothing else switched off
    (no ``strict=False``, ``FLASHRANGE_STRICT`` unset), only a first call before it to build the kernels."""
    monkeypatch.delenv("FLASHRANGE_STRICT", raising=False)
    calls, (q, k, v, qr, kr, mt) = _front_end_calls()
    call = calls[name]
    warm = call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(got if isinstance(got, tuple) else (got,), warm if isinstance(warm, tuple) else (warm,)):
        assert torch.equal(a, b)
    if name.startswith("range_attention"):
        check_three_way(q, k, v, qr, kr, mt, q.shape[-1] ** -0.5, 0.0, *got)


@pytest.mark.parametrize("name", FRONT_ENDS)
def test_default_call_does_not_wait_for_the_gpu(name, monkeypatch):
    """Independent of the sync debug mode: a default call returns while earlier GPU work still runs.

    A spin kernel keeps the stream busy; if the call read anything on the host it would wait for the
    spin to finish, and the spin's event would be complete when the call returns.
    """
    monkeypatch.delenv("FLASHRANGE_STRICT", raising=False)
    calls, _ = _front_end_calls()
    call = calls[name]
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
    spun = torch.cuda.Event()
    spun.record()
    call()
    still_spinning = not spun.query()
    torch.cuda.synchronize()
    assert still_spinning, f"{name} waited for the GPU (a host read of a device value)"


def test_sync_debug_mode_switches_no_check_off():
    """Strict mode still checks values while the sync debug mode is on ("warn": it reports the one
    host read strict mode makes); it used to skip them silently."""
    T = 64
    q, k, v = make_qkv(T, T, 2, 1, 64, 64, torch.bfloat16, DEV, seed=5)
    qr = torch.tensor([[0, T], [3, T + 9]], dtype=torch.int32, device=DEV)
    mt = torch.tensor([CAUSAL, FULL], dtype=torch.int32, device=DEV)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.raises(ValueError, match=r"slice 1: q_ranges\[1\] = \[3, 73\) lies outside \[0, Tq=64\]"):
            flashrange.range_attention(q, k, v, qr, qr.clone(), mt, strict=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_opcheck_fwd_cuda():
    T, Hq, Hkv, D = 129, 4, 2, 64
    q, k, v = make_qkv(T, 65, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=5)
    qr, kr, mt = (t.to(DEV) for t in random_slices(T, 65, 6, seed=6, n_empty=2))
    plan = list(torch.ops.flashrange.plan(qr, kr, mt, T, 65))
    torch.library.opcheck(torch.ops.flashrange.fwd.default, (q, k, v, qr, kr, mt, plan, 0.125, 0.0))
    torch.library.opcheck(torch.ops.flashrange.fwd.default, (q, k, v, qr, kr, mt, plan, 0.125, 3.0))


def test_compile_no_recompile_on_mask_change():
    import torch._dynamo

    T, Hq, Hkv, D, CAP = 1031, 4, 2, 64, 16
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=9)

    def padded(seed, n):
        qr, kr, mt = random_slices(T, T, n, seed=seed)
        z = torch.zeros(CAP - n, 2, dtype=torch.int32)
        return (torch.cat([qr, z]).to(DEV), torch.cat([kr, z]).to(DEV),
                torch.cat([mt, torch.zeros(CAP - n, dtype=torch.int32)]).to(DEV))

    def f(q, k, v, qr, kr, mt):
        # Nothing fused around the op: the compiled result must match eager bit for bit.
        return flashrange.range_attention(q, k, v, qr, kr, mt)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)
    masks = [padded(s, n) for s, n in ((1, 3), (2, 9), (3, 16), (4, 1))]
    cf(q, k, v, *masks[0])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for m in masks:
            got = cf(q, k, v, *m)
            want = f(q, k, v, *m)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _forced_config_cases():
    cases = []
    for D, dtype in ((128, torch.bfloat16), (64, torch.bfloat16), (256, torch.bfloat16), (96, torch.float16)):
        for cfg in configs_for(D, D, dtype):
            cases.append(pytest.param(D, dtype, cfg.name, id=f"D{D}-{str(dtype)[6:]}-{cfg.name}"))
    return cases


@pytest.mark.parametrize("D,dtype,name", _forced_config_cases())
def test_every_config(D, dtype, name):
    """Every configuration the launcher may pick, forced: no NaN, three-way accurate, all mask shapes."""
    T, Hq, Hkv = 1537, 4, 2
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, dtype, DEV, seed=D)
    for kind, seed in (("causal", 0), ("full", 0), ("random", 5), ("doc16", 6)):
        qr, kr, mt = _mask(kind, T, seed)
        out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5, config=name)
        check_three_way(q, k, v, qr, kr, mt, D ** -0.5, 0.0, out, lse)


def test_default_configs_listed():
    for D in (32, 64, 96, 128, 192, 256):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert default_config(D, D, dtype) in configs_for(D, D, dtype)


def test_plan_triton_equals_torch_on_cuda():
    """The plan the kernel uses on CUDA (Triton) equals the plain-PyTorch plan, bit for bit."""
    from flashrange.kernels.plan import build_block_plan as build_plan

    # The general plan; the one-program plan at its slot limit with the block launches after it (256 blocks),
    # with 100 garbage slots over 64 and 33 blocks of 128, and with everything in one launch.
    cases = [(131072, 131072, 4096, False), (32768, 30011, 300, True), (32768, 32768, 128, False),
             (8191, 4099, 100, True), (1031, 2053, 64, True), (17, 5, 9, True)]
    for Tq, Tk, S, garbage in cases:
        if garbage:
            qr, kr, mt = random_slices(Tq, Tk, S, seed=S, garbage=True, n_empty=3)
        else:
            bounds = [0] + sorted(random.Random(S).sample(range(1, Tq), S - 1)) + [Tq]
            qr = torch.tensor([[a, b] for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.int32)
            kr, mt = qr.clone(), torch.full((S,), CAUSAL, dtype=torch.int32)
        qr, kr, mt = qr.to(DEV), kr.to(DEV), mt.to(DEV)
        for transpose in (False, True):
            for block in (64, 128):
                a = build_plan(qr, kr, mt, Tq, Tk, block, transpose=transpose, backend="torch")
                b = build_plan(qr, kr, mt, Tq, Tk, block, transpose=transpose, backend="triton")
                for name, x, y in zip(a._fields, a, b):
                    assert torch.equal(x, y), (Tq, Tk, S, transpose, block, name)


def test_packed_and_misaligned_views():
    """Views into a packed qkv tensor: aligned ones may take TMA, a 2-byte offset falls back to pointers."""
    T, H, D = 1031, 4, 64
    g = torch.Generator(device=DEV).manual_seed(71)
    for off in (0, 1):
        packed = torch.randn(T, 3 * H * D + 8, generator=g, device=DEV).to(torch.bfloat16)
        q, k, v = (packed[:, off + i * H * D: off + (i + 1) * H * D].view(T, H, D) for i in range(3))
        qr, kr, mt = random_slices(T, T, 12, seed=72 + off)
        out, lse = _run(q, k, v, qr, kr, mt, 0.125)
        want = _run(q.contiguous(), k.contiguous(), v.contiguous(), qr, kr, mt, 0.125)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
        check_three_way(q, k, v, qr, kr, mt, 0.125, 0.0, out, lse)


@pytest.mark.parametrize("D", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize(
    "mask",
    [
        # One slice ending short of the tensor (the one-slice kernel): the last key tile
        # [960, 1024) runs past the slice's end at 1000.
        pytest.param(([[0, 1000]], [[0, 1000]], [CAUSAL]), id="one-causal-slice"),
        # Documents with a gap and padding after the last one (the per-slice value descriptors).
        pytest.param(([[0, 301], [301, 650], [700, 1000]], [[0, 301], [301, 650], [700, 1000]],
                      [CAUSAL, CAUSAL, FULL]), id="documents-gap-padding"),
    ],
)
def test_nan_in_uncovered_keys_does_not_reach_covered_rows(D, mask):
    """NaN/Inf in keys and values no slice covers leave every covered row bitwise as with zeros there.

    Run with the default config, so that on Hopper the TMA path (value
    descriptors ending at each slice's last key) is the one checked.
    """
    T, H = 1024, 2
    qr, kr, mt = (torch.tensor(x, dtype=torch.int32) for x in mask)
    q, k, v = make_qkv(T, T, H, H, D, D, torch.bfloat16, DEV, 91)
    covered_keys = torch.zeros(T, dtype=torch.bool, device=DEV)
    for ks, ke in kr.tolist():
        covered_keys[ks:ke] = True
    k_clean, v_clean = k.clone(), v.clone()
    k_clean[~covered_keys] = 0
    v_clean[~covered_keys] = 0
    k_bad, v_bad = k_clean.clone(), v_clean.clone()
    k_bad[~covered_keys] = float("nan")
    v_bad[~covered_keys] = float("inf")
    v_bad[~covered_keys, :, 0] = float("nan")
    out_clean, lse_clean = _run(q, k_clean, v_clean, qr, kr, mt, D ** -0.5)
    out_bad, lse_bad = _run(q, k_bad, v_bad, qr, kr, mt, D ** -0.5)
    rows = torch.zeros(T, dtype=torch.bool, device=DEV)
    for qs, qe in qr.tolist():
        rows[qs:qe] = True
    assert bool(torch.isfinite(out_bad[rows]).all())
    assert torch.equal(out_bad[rows], out_clean[rows]) and torch.equal(lse_bad[rows], lse_clean[rows])


_HOPPER = torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel is the default on compute capability 9 only")
def test_hopper_kernel_is_the_default_and_builds():
    """On Hopper, 2-byte dtypes at head dims up to 128 take the Gluon kernel, and it builds: no fallback
    warning."""
    import warnings

    for D, Dv in ((128, 128), (96, 96), (64, 128), (64, 64), (48, 40)):
        for dtype in (torch.bfloat16, torch.float16):
            assert default_config(D, Dv, dtype).gluon, (D, Dv, dtype)
    assert not default_config(128, 128, torch.float32).gluon
    assert not default_config(256, 256, torch.bfloat16).gluon
    T = 4099
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for D, dtype, kind, softcap in ((128, torch.bfloat16, "causal", 0.0), (96, torch.float16, "full", 20.0),
                                        (128, torch.float16, "window", 0.0), (64, torch.bfloat16, "causal", 30.0)):
            q, k, v = make_qkv(T, T, 4, 2, D, D, dtype, DEV, seed=D + 1)
            qr, kr, mt = _mask(kind, T, 3)
            out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap)
            check_three_way(q, k, v, qr, kr, mt, D ** -0.5, softcap, out, lse)
    assert default_config(128, 128, torch.bfloat16).gluon
    # One program per SM walks the work items (docs/design.md, "The Hopper forward").
    assert default_config(128, 128, torch.bfloat16).persistent
    # Short documents side by side walk merged tiles (docs/design.md, "Merged tiles").
    assert default_config(128, 128, torch.bfloat16).merge
    assert default_config(64, 64, torch.bfloat16).merge and default_config(64, 64, torch.bfloat16).persistent
    # Head dims 128 and 64: the adaptive schedule; split barriers where the slots are short on average at
    # head dim 128 only (docs/design.md, "Schedules chosen by shape").
    assert default_config(128, 128, torch.bfloat16).adaptive
    assert not default_config(128, 128, torch.bfloat16).split_kv
    assert default_config(128, 128, torch.bfloat16, short_slices=True).split_kv
    assert default_config(64, 64, torch.bfloat16).adaptive and not default_config(64, 64, torch.bfloat16).split_kv
    assert default_config(64, 64, torch.bfloat16, short_slices=True) == default_config(64, 64, torch.bfloat16)


@pytest.mark.parametrize("kind, T, want_split", [("doc16", 32768, True), ("causal", 8192, False),
                                                  ("random", 4099, True)],
                         ids=["doc16-32k", "causal-8k", "random-24-slices"])
def test_launcher_picks_the_schedule_by_mean_slot_length(monkeypatch, kind, T, want_split):
    """The launcher asks constants.has_short_slices of the call's shapes and launches that default; the
    result equals the other schedule's bits."""
    import flashrange.kernels.forward as kfwd

    seen = []
    real = kfwd._launch

    def spy(*args, **kwargs):
        seen.append(args[9])  # the config
        return real(*args, **kwargs)

    q, k, v = make_qkv(T, T, 2, 2, 128, 128, torch.bfloat16, DEV, seed=T)
    qr, kr, mt = _mask(kind, T, 5)
    monkeypatch.setattr(kfwd, "_launch", spy)
    out, lse = _run(q, k, v, qr, kr, mt, 128 ** -0.5)
    monkeypatch.undo()
    assert len(seen) == 1 and seen[0].split_kv is want_split and seen[0].adaptive, seen
    other = default_config(128, 128, torch.bfloat16, short_slices=not want_split)
    out2, lse2 = _run(q, k, v, qr, kr, mt, 128 ** -0.5, config=other)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


class _Unbuildable:
    """Stands in for the Gluon kernel: every launch fails the way a compiler error does."""

    params = ()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            raise RuntimeError("PassManager::run failed (a stand-in for a Gluon build error)")

        return run


@pytest.fixture
def gluon_state(monkeypatch):
    from flashrange.kernels import forward as fwd

    def clear():
        for cached in (fwd._has_gluon_sm90, fwd._configs_for, fwd._default_config):
            cached.cache_clear()
        fwd._RECIPES.clear()

    monkeypatch.setattr(fwd, "_GLUON_FAILURES", [])
    clear()
    yield fwd, monkeypatch
    monkeypatch.undo()
    clear()


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel is the default on compute capability 9 only")
def test_gluon_build_failure_falls_back_with_one_warning(gluon_state):
    import warnings

    fwd, monkeypatch = gluon_state
    monkeypatch.setattr(fwd, "_gluon_kernel", lambda: _Unbuildable())
    T, D = 1100, 128
    q, k, v = make_qkv(T, T, 2, 2, D, D, torch.bfloat16, DEV, seed=5)
    qr, kr, mt = _mask("causal", T, 2)
    with pytest.warns(RuntimeWarning, match="did not build"):
        out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5)
    check_three_way(q, k, v, qr, kr, mt, D ** -0.5, 0.0, out, lse)
    assert not default_config(D, D, torch.bfloat16).gluon
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out2, lse2 = _run(q, k, v, qr, kr, mt, D ** -0.5)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # A Gluon config asked for by name is refused once the kernel is known not to build.
    with pytest.raises(ValueError, match="Hopper"):
        _run(q, k, v, qr, kr, mt, D ** -0.5, config="sm90ws_m128_n128_w4_s2")


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("Tq,Tk,n,D,dtype,softcap", [
    pytest.param(1000, 31, 9, 80, torch.float16, 5.0, id="fuzz-case-Tk31-D80-softcap"),
    pytest.param(777, 203, 64, 128, torch.bfloat16, 0.0, id="64-slices-Tk203-D128"),
    pytest.param(2049, 1000, 200, 64, torch.bfloat16, 0.0, id="200-slices-Tk1000-D64"),
])
def test_hopper_kernel_many_short_slices(Tq, Tk, n, D, dtype, softcap):
    """Many short slices, each bounded at its own last key, through the Hopper kernel, 8 inputs each.

    A fuzz case of this shape came out wrong before the producer stopped
    rewriting a value descriptor that loads were still reading (kernels/sm90_common.py).
    """
    for seed in range(8):
        rows = short_slice_rows(Tq, Tk, n, random.Random(seed))
        if seed == 0 and n == 9:  # the fuzz case itself
            rows = [(296, 971, 1, 5, 2), (542, 1000, 23, 31, 1), (0, 0, 0, 0, 1), (0, 15, 0, 15, 0),
                    (727, 728, 1, 27, 2), (210, 801, 11, 12, 1), (752, 994, 24, 31, 2), (288, 676, 5, 30, 1),
                    (604, 810, 20, 31, 1)]
        qr, kr, mt = (torch.tensor(x, dtype=torch.int32) for x in ([r[:2] for r in rows], [r[2:4] for r in rows],
                                                                    [r[4] for r in rows]))
        q, k, v = make_qkv(Tq, Tk, 4, 2, D, D, dtype, DEV, seed=seed)
        for config in ("sm90pp_m128_n128_w4_s3", "sm90ppp_m128_n128_w4_s3", "sm90pppm_m128_n128_w4_s3",
                       "sm90pppmd_m128_n128_w4_s3", "sm90pppmk_m128_n128_w4_s2", "sm90pppmkq_m128_n128_w4_s2"):
            out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap, config=config)
            try:
                check_three_way(q, k, v, qr, kr, mt, D ** -0.5, softcap, out, lse)
            except AssertionError as e:
                raise AssertionError(f"{config} seed {seed}: rows={rows}\n{e}") from None


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("config", ["sm90pp_m128_n128_w4_s3", "sm90ppp_m128_n128_w4_s3", "sm90pppm_m128_n128_w4_s3",
                                    "sm90pppmd_m128_n128_w4_s3", "sm90pppma_m128_n128_w4_s3",
                                    "sm90pppmk_m128_n128_w4_s2",
                                    "sm90pppmkq_m128_n128_w4_s2", "sm90pppmax1_m128_n128_w4_s3",
                                    "sm90pppmax2_m128_n128_w4_s3"])
def test_fuzz_hopper_kernel(config):
    """300 random masks forced through the Hopper kernel, at the head dims it serves.

    The 1000-case fuzz takes the default config, and its sizes rarely reach the
    Gluon kernel's full tiles; this one forces that kernel on larger shapes.
    """
    _fuzz(4321, 300, [1, 17, 64, 129, 300, 513, 1000], [1, 31, 128, 255, 640, 1001],
          [(64, 64), (128, 128), (96, 96), (64, 128), (80, 80)], 8, config=config)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("config", ["sm90pppmax1_m128_n128_w4_s3", "sm90pppmax2_m128_n128_w4_s3"],
                         ids=["poly-quarter", "poly-half"])
@pytest.mark.parametrize("D", [64, 128])
def test_hopper_poly_exp2_keeps_nan_where_it_is_read(config, D):
    """With part of the exponentials by the polynomial, NaN in keys that a slice reads makes exactly that slice's
    rows NaN, as MUFU's exp2 does; masked cells (``-inf``) stay out of the other slice's rows.

    Keys 0-15 are NaN and rows 0-99 read them, so every register position of the split (column pairs,
    rows 8 apart) meets a NaN; rows 100-299 read keys 100-299 causally (each at least its own key, the cells
    past the diagonal masked) and must stay finite.
    """
    T = 300
    q, k, v = make_qkv(T, T, 2, 1, D, D, torch.bfloat16, DEV, seed=5)
    k[:16] = float("nan")
    qr = torch.tensor([[0, 100], [100, 300]], dtype=torch.int32)
    kr = torch.tensor([[0, 128], [100, 300]], dtype=torch.int32)
    mt = torch.tensor([FULL, CAUSAL], dtype=torch.int32)
    out, lse = _run(q, k, v, qr, kr, mt, D ** -0.5, config=config)
    assert bool(torch.isnan(out[:100]).all()) and bool(torch.isnan(lse[:100]).all())
    assert bool(torch.isfinite(out[100:]).all()) and bool(torch.isfinite(lse[100:]).all())


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("kind", ["causal", "doc16", "window", "random"])
def test_hopper_persistent_grid_is_bitwise_the_same(kind):
    """One program per SM walking several work items gives the same bits as one program per item.

    8191 rows in 128-row blocks over 8 query heads are more work items than the H200's SMs, so each
    program of the persistent grid takes several, in the zig-zag order.
    """
    T = 8191
    q, k, v = make_qkv(T, T, 8, 2, 128, 128, torch.bfloat16, DEV, seed=11)
    qr, kr, mt = _mask(kind, T, 4)
    one, lse_one = _run(q, k, v, qr, kr, mt, 128 ** -0.5, config="sm90pp_m128_n128_w4_s3")
    many, lse_many = _run(q, k, v, qr, kr, mt, 128 ** -0.5, config="sm90ppp_m128_n128_w4_s3")
    assert torch.equal(one, many) and torch.equal(lse_one, lse_many)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("config, D", [("sm90pppmd_m128_n128_w4_s3", 128), ("sm90pppma_m128_n128_w4_s3", 128),
                                       ("sm90pppmak_m128_n128_w4_s2", 128), ("sm90pppma_m128_n128_w4_s3", 64)],
                         ids=["dynamic", "adaptive", "adaptive-split-kv", "adaptive-d64"])
@pytest.mark.parametrize("kind", ["causal", "doc16", "window", "random", "short"])
def test_hopper_dynamic_schedule_is_bitwise_the_same(kind, config, D):
    """Programs that take their items from a shared counter give the bits of the fixed zig-zag share, on
    every launch: each launch's counter starts from zero, so later launches (through the recorded fast
    path, with a plan given) cover every row again; rows left unwritten would keep the NaN put there. The
    adaptive schedule takes one or the other per launch (both occur among these masks); it is the default
    at head dims 128 and 64."""
    from flashrange.kernels.forward import range_attention_forward_triton

    T = 8191
    q, k, v = make_qkv(T, T, 8, 2, D, D, torch.bfloat16, DEV, seed=19)
    qr, kr, mt = _short_mask(T, 700, 5) if kind == "short" else _mask(kind, T, 4)
    fixed = _run(q, k, v, qr, kr, mt, D ** -0.5, config="sm90pppm_m128_n128_w4_s3")
    qr, kr, mt = qr.to(DEV), kr.to(DEV), mt.to(DEV)
    plan = flashrange.plan_mask(qr, kr, mt, T, T)
    for _ in range(3):
        # NaN where the outputs will be allocated (the caching allocator hands freed blocks back).
        poison = (torch.full((T, 8, D), float("nan"), dtype=torch.bfloat16, device=DEV),
                  torch.full((T, 8), float("nan"), device=DEV))
        del poison
        out, lse = range_attention_forward_triton(q, k, v, qr, kr, mt, D ** -0.5, plan=plan, config=config)
        assert torch.equal(out, fixed[0]) and torch.equal(lse, fixed[1])


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("config, base", [("sm90pppmar_m128_n128_w4_s3", "sm90pppma_m128_n128_w4_s3"),
                                          ("sm90pppmakr_m128_n128_w4_s2", "sm90pppmak_m128_n128_w4_s2")],
                         ids=["adaptive", "adaptive-split-kv"])
@pytest.mark.parametrize("D, softcap", [(64, 0.0), (128, 0.0), (128, 20.0)], ids=["d64", "d128", "d128-softcap"])
@pytest.mark.parametrize("kind", ["causal", "doc16", "window", "random", "short"])
def test_hopper_row_intervals_are_bitwise_the_inequalities(kind, config, base, D, softcap):
    """An edge tile's mask as one key interval per row (``FwdConfig.row_intervals``) selects exactly the cells
    of the four inequalities per cell: the same bits on every mask kind, merged tiles ("short") and every
    slice type ("random") included, and 300 random masks with garbage and empty slices at odd sizes."""
    T = 8191
    q, k, v = make_qkv(T, T, 8, 2, D, D, torch.bfloat16, DEV, seed=23)
    qr, kr, mt = _short_mask(T, 700, 5) if kind == "short" else _mask(kind, T, 4)
    want = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap, config=base)
    got = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap, config=config)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if kind == "random" and softcap == 0.0:
        rng = random.Random(D)
        for case in range(300):
            Tq, Tk = rng.choice([1, 17, 129, 300, 1000]), rng.choice([1, 31, 255, 640, 1001])
            q, k, v = make_qkv(Tq, Tk, 4, 2, D, D, torch.float16, DEV, seed=case)
            qr, kr, mt = random_slices(Tq, Tk, rng.randint(1, 9), seed=case, garbage=rng.random() < 0.3,
                                       n_empty=rng.randint(0, 3))
            want = _run(q, k, v, qr, kr, mt, D ** -0.5, config=base)
            got = _run(q, k, v, qr, kr, mt, D ** -0.5, config=config)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (
                f"case {case}: Tq={Tq} Tk={Tk} q_ranges={qr.tolist()} k_ranges={kr.tolist()} types={mt.tolist()}")


# Causal documents whose heaviest block lies in a long document, or in short ones (T = 8191).
_SCHEDULE_DOCS = {
    "causal": [8191],
    "doc16": [377, 512, 511, 700, 300, 640, 480, 512, 355, 600, 420, 611, 500, 433, 520, 720],
    "long-and-short": [4096] + [16] * 255 + [15],
    "short": [128] * 63 + [127],
    "doc-300": [300] * 27 + [91],
}


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("kind", list(_SCHEDULE_DOCS))
def test_hopper_adaptive_schedule_takes_tickets_only_for_long_slices(monkeypatch, kind):
    """The adaptive schedule's choice, read from its counter after the launch: every item and one ticket past
    the list per program when the document where the heaviest 128-row block starts is FWD_DYNAMIC_MIN_LEN
    rows or longer (then the counter's order), none otherwise (the fixed share's). The heaviest block is
    found here from the causal rule, not from the plan."""
    from flashrange.constants import FWD_DYNAMIC_MIN_LEN
    from flashrange.kernels import forward as fwd

    T, Hq = 8191, 8
    (qr, kr, mt), docs = causal_documents(_SCHEDULE_DOCS[kind])
    assert docs[-1][1] == T
    q, k, v = make_qkv(T, T, Hq, 2, 128, 128, torch.bfloat16, DEV, seed=23)
    tickets = []
    make_ticket = fwd._ticket
    monkeypatch.setattr(fwd, "_ticket", lambda dynamic, lse: tickets.append(make_ticket(dynamic, lse)) or tickets[-1])
    _run(q, k, v, qr, kr, mt, 128 ** -0.5, config="sm90pppma_m128_n128_w4_s3")
    torch.cuda.synchronize()
    n_work = -(-T // 128) * Hq
    n_prog = min(n_work, torch.cuda.get_device_properties(0).multi_processor_count)
    a, e = heaviest_block_document(docs, T)
    is_ticketed = e - a >= FWD_DYNAMIC_MIN_LEN
    assert tickets[-1].item() == (n_work + n_prog if is_ticketed else 0), f"{kind}: ticketed={is_ticketed}"


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("config", ["sm90pppmk_m128_n128_w4_s2", "sm90pppmk_m128_n128_w4_s3",
                                    "sm90pppmkq_m128_n128_w4_s2"],
                         ids=["two-slots", "three-slots", "two-query-blocks"])
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("D", [128, 64], ids=["d128", "d64"])
@pytest.mark.parametrize("kind", ["causal", "doc16", "window", "random", "short"])
def test_hopper_split_kv_is_bitwise_the_same(kind, D, layout, config):
    """Key and value tiles on barriers of their own (each key tile loaded ahead of the value tile before it)
    change when tiles land and are released, not the arithmetic, and so does a second query block (the next
    item's queries loaded during this one's): the bits of the shared barriers, with heads packed in each row
    and with per-head descriptors (a padded view), softcap on the window masks."""
    T = 4099
    q, k, v = make_qkv(T, T, 8, 2, D, D, torch.bfloat16, DEV, seed=29)
    if layout == "padded":
        q, k, v = heads_padded_view(q), heads_padded_view(k), heads_padded_view(v)
    qr, kr, mt = _short_mask(T, 300, 3) if kind == "short" else _mask(kind, T, 5)
    softcap = 30.0 if kind == "window" else 0.0
    shared = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap, config="sm90pppm_m128_n128_w4_s3")
    split = _run(q, k, v, qr, kr, mt, D ** -0.5, softcap, config=config)
    assert torch.equal(split[0], shared[0]) and torch.equal(split[1], shared[1])
    check_three_way(q, k, v, qr.to(DEV), kr.to(DEV), mt.to(DEV), D ** -0.5, softcap, split[0], split[1])


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("kind", ["causal", "doc16", "window", "random", "short"])
def test_hopper_packed_heads_is_bitwise_the_same(kind):
    """Heads side by side in each row (one descriptor per tensor, bounded ones only where a slice's last
    tile runs past its end) give the bits of per-head descriptors bounded at every slice's end."""
    from flashrange.kernels.common import packed_heads

    T = 4099
    q, k, v = make_qkv(T, T, 8, 2, 128, 128, torch.bfloat16, DEV, seed=13)
    qr, kr, mt = _short_mask(T, 300, 3) if kind == "short" else _mask(kind, T, 5)
    qu, ku, vu = heads_padded_view(q), heads_padded_view(k), heads_padded_view(v)
    assert packed_heads(q, k, v) and not packed_heads(qu, ku, vu)
    out, lse = _run(q, k, v, qr, kr, mt, 128 ** -0.5)
    out_u, lse_u = _run(qu, ku, vu, qr, kr, mt, 128 ** -0.5)
    assert torch.equal(out, out_u) and torch.equal(lse, lse_u)
    check_three_way(q, k, v, qr.to(DEV), kr.to(DEV), mt.to(DEV), 128 ** -0.5, 0.0, out, lse)


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("kind", ["tiny", "mixed", "cross", "gapped", "holes"])
def test_hopper_merged_tiles(kind):
    """Packed short documents through the Hopper kernel with merged tiles (and without): the three-way rule,
    no NaN from keys no slice covers, the same bits under slice permutations and empty slices; with tiny
    documents the merged run changes the bits (the path ran)."""
    rng = random.Random(len(kind) + 1)
    Tq, Tk = 4099, (3001 if kind == "cross" else 4099)
    rows = packed_document_rows(kind, Tq, Tk, rng)
    qr, kr, mt = (torch.tensor(x, dtype=torch.int32) for x in ([r[:2] for r in rows], [r[2:4] for r in rows],
                                                                [r[4] for r in rows]))
    q, k, v = make_qkv(Tq, Tk, 8, 2, 128, 128, torch.bfloat16, DEV, seed=len(rows))
    uncovered = (dense_counts(qr, kr, mt, Tq, Tk).sum(0) == 0).to(DEV)
    k[uncovered] = float("nan")
    v[uncovered] = float("nan")
    outs = {}
    for config in ("sm90ppp_m128_n128_w4_s3", "sm90pppm_m128_n128_w4_s3"):
        outs[config] = _run(q, k, v, qr, kr, mt, 128 ** -0.5, config=config)
        check_three_way(q, k, v, qr.to(DEV), kr.to(DEV), mt.to(DEV), 128 ** -0.5, 0.0, *outs[config])
    merged = outs["sm90pppm_m128_n128_w4_s3"]
    if kind == "tiny":
        assert not torch.equal(merged[0], outs["sm90ppp_m128_n128_w4_s3"][0])
    perm = torch.randperm(qr.shape[0], generator=torch.Generator().manual_seed(2))
    pad = torch.tensor([[0, 0], [5, 5]], dtype=torch.int32)
    again = _run(q, k, v, torch.cat([qr[perm], pad]), torch.cat([kr[perm], pad]),
                 torch.cat([mt[perm], torch.tensor([CAUSAL, FULL], dtype=torch.int32)]), 128 ** -0.5,
                 config="sm90pppm_m128_n128_w4_s3")
    assert torch.equal(again[0], merged[0]) and torch.equal(again[1], merged[1])


@pytest.mark.skipif(not _HOPPER, reason="the Gluon kernel runs on compute capability 9 only")
@pytest.mark.parametrize("kind", ["causal", "doc3", "window"])
def test_hopper_merging_keeps_the_bits_where_no_block_merges(kind):
    """Long slices never merge (a run would pass ``MERGE_MAX_TILES``): with merging compiled in, each slice
    walks the same tiles with its bounds as columns, and the bits are those of the config without it."""
    T = 4099
    q, k, v = make_qkv(T, T, 8, 2, 128, 128, torch.bfloat16, DEV, seed=17)
    qr, kr, mt = _doc_causal(T, 3, 4) if kind == "doc3" else _mask(kind, T, 4)
    plain = _run(q, k, v, qr, kr, mt, 128 ** -0.5, config="sm90ppp_m128_n128_w4_s3")
    merging = _run(q, k, v, qr, kr, mt, 128 ** -0.5, config="sm90pppm_m128_n128_w4_s3")
    assert torch.equal(plain[0], merging[0]) and torch.equal(plain[1], merging[1])
