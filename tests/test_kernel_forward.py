"""The Triton forward kernel against the reference, on the CPU (``TRITON_INTERPRET=1``).

Three-way rule (docs/design.md §10): golden = the reference on float64 inputs; the
reference in the test dtype has some error against it; the kernel's error
may be at most twice that, plus a floor of a few float32 ulps of the result's
magnitude (for results the reference gets exactly right).

Under the interpreter the launcher is called directly with CPU tensors. The
interpreter costs tens of milliseconds per key tile, so the shapes are small
and odd, and each random mask mixes all four types, overlaps, empty slices
and uncovered rows in one call.
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

from flashrange.kernels.forward import (  # noqa: E402
    FWD_CONFIGS,
    configs_for,
    range_attention_forward_triton,
)
from flashrange.kernels.common import merged_span  # noqa: E402
from flashrange.reference import range_attention_forward  # noqa: E402
from golden import dense_counts, packed_document_rows  # noqa: E402

FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------
# Helpers (also imported by tests/test_gpu_forward.py)


def random_slices(Tq, Tk, n, seed, *, garbage=False, n_empty=0):
    """``(q_ranges, k_ranges, mask_types)`` int32 on the CPU.

    Mixes the four types, overlapping q ranges, slices of length 1, slices
    touching the tensor edges, empty slices and (by leaving gaps) uncovered
    rows. ``garbage=True`` adds ranges outside the tensors, reversed ranges
    and unknown types, which every implementation clamps or drops.
    """
    rng = random.Random(seed)
    rows = []

    def span(T):
        kind = rng.random()
        if kind < 0.15:
            a = rng.randrange(T)
            return a, a + 1
        if kind < 0.3:
            return 0, rng.randint(1, T)
        if kind < 0.45:
            return rng.randrange(T), T
        a, b = sorted(rng.sample(range(T + 1), 2)) if T >= 1 else (0, 0)
        return a, b

    for _ in range(n):
        qs, qe = span(Tq)
        ks, ke = span(Tk)
        rows.append([qs, qe, ks, ke, rng.randrange(4)])
    for _ in range(n_empty):
        rows.insert(rng.randrange(len(rows) + 1), [0, 0, 0, 0, rng.randrange(4)])
    if garbage:
        big = max(Tq, Tk)
        rows.append([-5, Tq + 7, -3, 2, rng.randrange(4)])
        rows.append([Tq // 2, Tq // 3, 0, Tk, FULL])  # start after end
        rows.append([0, Tq, Tk + 1, Tk + 9, CAUSAL])  # entirely past the keys
        rows.append([-big - 3, -1, 0, Tk, FULL])  # entirely before the queries
        rows.append([0, Tq, 0, Tk, 7])  # unknown type
        rows.append([1, 2 ** 30, -(2 ** 30), 2 ** 30, BI_CAUSAL])
        rng.shuffle(rows)
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def make_qkv(Tq, Tk, Hq, Hkv, D, Dv, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, Hq, D, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(Tk, Hkv, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(Tk, Hkv, Dv, generator=g).to(device=device, dtype=dtype)
    return q, k, v


def check_three_way(q, k, v, qr, kr, mt, scale, softcap, out, lse):
    """Assert the kernel's ``(out, lse)`` obeys the three-way rule against the reference."""
    ref_out, ref_lse = range_attention_forward(q, k, v, qr, kr, mt, scale, softcap)
    gold_out, gold_lse = range_attention_forward(q.double(), k.double(), v.double(), qr, kr, mt, scale, softcap)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.isfinite(out).all(), "NaN/inf in out"
    # Uncovered rows: lse -inf exactly where the reference says so, out exactly 0 there.
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any()
    uncovered = torch.isneginf(ref_lse)
    assert (out[uncovered] == 0).all()
    eps32 = torch.finfo(torch.float32).eps
    for name, got, ref, gold in (
        ("out", out, ref_out, gold_out),
        ("lse", lse, ref_lse, gold_lse),
    ):
        fin = torch.isfinite(gold)
        gold_f = gold.to("cpu")[fin.cpu()]
        err_k = (got.double().cpu()[fin.cpu()] - gold_f).abs().max().item() if gold_f.numel() else 0.0
        err_r = (ref.double().cpu()[fin.cpu()] - gold_f).abs().max().item() if gold_f.numel() else 0.0
        floor = 8 * eps32 * max(1.0, gold_f.abs().max().item() if gold_f.numel() else 0.0)
        assert err_k <= 2 * err_r + floor, f"{name}: kernel err {err_k:.3e} > 2 x reference err {err_r:.3e} + {floor:.1e}"


def run_kernel(q, k, v, qr, kr, mt, scale, softcap=0.0, config=None):
    dev = q.device
    return range_attention_forward_triton(
        q, k, v, qr.to(dev), kr.to(dev), mt.to(dev), scale, softcap, config=config
    )


# ---------------------------------------------------------------------------------------------
# Tests

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (Tq, Tk, Hq, Hkv, D, dtype, n_slices): odd sizes, GQA ratios 1/2/4, D = 16, 64 and 24, 48.
GRID = [
    pytest.param(1, 1, 2, 2, 16, torch.bfloat16, 3, id="T1-D16-g1-bf16"),
    pytest.param(17, 17, 2, 1, 16, torch.float16, 5, id="T17-D16-g2-fp16"),
    pytest.param(63, 63, 4, 1, 64, torch.bfloat16, 6, id="T63-D64-g4-bf16"),
    pytest.param(130, 130, 2, 2, 24, torch.bfloat16, 7, id="T130-D24-g1-bf16"),
    pytest.param(130, 63, 4, 2, 48, torch.float16, 6, id="Tq130-Tk63-D48-g2-fp16"),
    pytest.param(17, 130, 4, 1, 64, torch.float16, 5, id="Tq17-Tk130-D64-g4-fp16"),
]


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D,dtype,n", GRID)
def test_random_masks(Tq, Tk, Hq, Hkv, D, dtype, n):
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, D, dtype, DEV, seed=Tq * 7 + D)
    qr, kr, mt = random_slices(Tq, Tk, n, seed=Tq + Tk + D, n_empty=2)
    out, lse = run_kernel(q, k, v, qr, kr, mt, D ** -0.5)
    check_three_way(q, k, v, qr, kr, mt, D ** -0.5, 0.0, out, lse)


@pytest.mark.parametrize(
    "mtype", [pytest.param(t, id=n) for t, n in ((0, "full"), (1, "causal"), (2, "inv_causal"), (3, "bi_causal"))]
)
def test_each_type_many_tiles(mtype):
    """One large slice per type with small tiles: masked edges and the unmasked middle.

    The slice is offset from the tensor edges and taller than wide (causal
    alignment bottom-right, inverse top-left; BI_CAUSAL, empty when taller than
    wide, gets a wide band instead), with a second, overlapping slice.
    """
    Tq, Tk, Hq, Hkv, D = 130, 121, 2, 1, 16
    q_range = (3, 35) if mtype == BI_CAUSAL else (3, 127)
    # Whole 16 x 32 tiles of cpu_m16_n32 inside the slice: the unmasked middle is reached.
    assert longest_full_run(q_range, (5, 118), mtype, Tq, Tk, 16) >= 2 * 32 - 1
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=mtype)
    qr = torch.tensor([q_range, [40, 90]], dtype=torch.int32)
    kr = torch.tensor([[5, 118], [0, 121]], dtype=torch.int32)
    mt = torch.tensor([mtype, (mtype + 1) % 4], dtype=torch.int32)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.3, config="cpu_m16_n32")
    check_three_way(q, k, v, qr, kr, mt, 0.3, 0.0, out, lse)


def test_aligned_causal_full_tiles():
    """Square causal from 0 with tiles dividing T: most tiles take the unmasked path."""
    T, Hq, Hkv, D = 128, 2, 1, 16
    assert longest_full_run((0, T), (0, T), CAUSAL, T, T, 32) >= 2 * 16 - 1
    q, k, v = make_qkv(T, T, Hq, Hkv, D, D, torch.float16, DEV, seed=5)
    qr = torch.tensor([[0, T]], dtype=torch.int32)
    mt = torch.tensor([CAUSAL], dtype=torch.int32)
    out, lse = run_kernel(q, k, v, qr, qr.clone(), mt, D ** -0.5, config="cpu_m32_n16")
    check_three_way(q, k, v, qr, qr, mt, D ** -0.5, 0.0, out, lse)


@pytest.mark.parametrize("softcap", [pytest.param(2.5, id="cap2.5"), pytest.param(30.0, id="cap30")])
def test_softcap(softcap):
    Tq, Tk, Hq, Hkv, D = 63, 63, 2, 1, 24
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=11)
    q = q * 3  # scores large enough for the cap to bite
    qr, kr, mt = random_slices(Tq, Tk, 5, seed=12, n_empty=1)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.5, softcap)
    check_three_way(q, k, v, qr, kr, mt, 0.5, softcap, out, lse)


def test_empty_rows_and_overlaps():
    """Rows covered by nothing (out 0, lse -inf) next to rows covered twice by the same cells."""
    Tq, Tk, Hq, Hkv, D = 63, 17, 2, 2, 16
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, D, torch.float16, DEV, seed=3)
    qr = torch.tensor([[0, 10], [5, 20], [5, 20], [40, 41], [0, 0]], dtype=torch.int32)
    kr = torch.tensor([[0, 17], [3, 9], [3, 9], [16, 17], [0, 0]], dtype=torch.int32)
    mt = torch.tensor([FULL, CAUSAL, CAUSAL, BI_CAUSAL, FULL], dtype=torch.int32)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.25)
    check_three_way(q, k, v, qr, kr, mt, 0.25, 0.0, out, lse)
    assert torch.isneginf(lse[20:40]).all() and (out[20:40] == 0).all()


def test_no_slices_and_all_empty():
    T, H, D = 17, 2, 16
    q, k, v = make_qkv(T, T, H, H, D, D, torch.bfloat16, DEV, seed=1)
    for S in (0, 3):
        z = torch.zeros(S, 2, dtype=torch.int32)
        out, lse = run_kernel(q, k, v, z, z.clone(), torch.zeros(S, dtype=torch.int32), 0.25)
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_garbage_ranges_clamped():
    Tq, Tk, Hq, Hkv, D = 63, 17, 2, 1, 16
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=21)
    qr, kr, mt = random_slices(Tq, Tk, 4, seed=22, garbage=True)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.25)
    check_three_way(q, k, v, qr, kr, mt, 0.25, 0.0, out, lse)


def test_padding_and_permutation_bitwise():
    Tq, Tk, Hq, Hkv, D = 130, 63, 2, 1, 16
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, D, torch.bfloat16, DEV, seed=31)
    qr, kr, mt = random_slices(Tq, Tk, 6, seed=32)
    base = run_kernel(q, k, v, qr, kr, mt, 0.25)
    g = torch.Generator().manual_seed(33)
    perm = torch.randperm(qr.shape[0], generator=g)
    permuted = run_kernel(q, k, v, qr[perm], kr[perm], mt[perm], 0.25)
    # Empty slices of every kind of emptiness, scattered through the list.
    empties_q = torch.tensor([[0, 0], [9, 9], [5, 30], [70, 60]], dtype=torch.int32)
    empties_k = torch.tensor([[0, 0], [0, 10], [4, 4], [0, 63]], dtype=torch.int32)
    empties_t = torch.tensor([FULL, CAUSAL, BI_CAUSAL, INV_CAUSAL], dtype=torch.int32)
    pq = torch.cat([empties_q[:2], qr, empties_q[2:]])
    pk = torch.cat([empties_k[:2], kr, empties_k[2:]])
    pt = torch.cat([empties_t[:2], mt, empties_t[2:]])
    padded = run_kernel(q, k, v, pq, pk, pt, 0.25)
    for other in (permuted, padded):
        assert torch.equal(base[0], other[0]) and torch.equal(base[1], other[1])
    rerun = run_kernel(q, k, v, qr, kr, mt, 0.25)
    assert torch.equal(base[0], rerun[0]) and torch.equal(base[1], rerun[1])


def test_fp32_and_dv_differs():
    """float32 inputs (exact fp32 products) and a value head dim other than D."""
    Tq, Tk, Hq, Hkv, D, Dv = 17, 63, 2, 1, 24, 40
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, Dv, torch.float32, DEV, seed=41)
    qr, kr, mt = random_slices(Tq, Tk, 4, seed=42)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.2)
    check_three_way(q, k, v, qr, kr, mt, 0.2, 0.0, out, lse)


def test_interpreter_configs():
    """Every configuration the interpreter may run gives the same answer quality."""
    Tq, Tk, Hq, Hkv, D = 63, 63, 2, 1, 16
    q, k, v = make_qkv(Tq, Tk, Hq, Hkv, D, D, torch.float16, DEV, seed=51)
    qr, kr, mt = random_slices(Tq, Tk, 4, seed=52)
    cfgs = configs_for(D, D, torch.float16, device_type="cpu")
    assert {c.name for c in cfgs} >= {"cpu_m64_n64", "cpu_m32_n16", "cpu_m16_n32"}
    assert all(c in FWD_CONFIGS for c in cfgs)
    for cfg in cfgs:
        if not cfg.name.startswith("cpu_"):
            continue
        out, lse = run_kernel(q, k, v, qr, kr, mt, 0.25, config=cfg)
        check_three_way(q, k, v, qr, kr, mt, 0.25, 0.0, out, lse)


def test_strided_views():
    """q, k, v as views into one packed tensor (head-dim stride 1, odd offsets): same answer."""
    from flashrange.kernels.common import tma_aligned

    Tq, H, D = 63, 2, 16
    g = torch.Generator().manual_seed(61)
    packed = torch.randn(Tq, 3 * H * D + 1, generator=g).to(DEV, torch.float16)
    # One element in: views whose base is 2 bytes off a 16-byte boundary.
    q = packed[:, 1 : 1 + H * D].view(Tq, H, D)
    k = packed[:, 1 + H * D : 1 + 2 * H * D].view(Tq, H, D)
    v = packed[:, 1 + 2 * H * D : 1 + 3 * H * D].view(Tq, H, D)
    assert not tma_aligned(q) and tma_aligned(torch.empty(4, H, D, dtype=torch.float16, device=DEV))
    qr, kr, mt = random_slices(Tq, Tq, 4, seed=62)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.25)
    want = run_kernel(q.contiguous(), k.contiguous(), v.contiguous(), qr, kr, mt, 0.25)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    check_three_way(q, k, v, qr, kr, mt, 0.25, 0.0, out, lse)


@pytest.mark.parametrize(
    "shape,view,packed",
    [
        pytest.param((5, 3, 128), None, True, id="contiguous-d128"),
        pytest.param((5, 3, 64), None, True, id="contiguous-d64"),
        pytest.param((5, 1, 128), None, True, id="one-head"),
        pytest.param((5, 3, 96), None, False, id="d96-padded-tile"),
        pytest.param((5, 3, 192), "first-128", False, id="heads-padded-in-row"),
        pytest.param((5, 3 * 3, 128), "q-of-qkv", True, id="q-of-fused-qkv"),
        pytest.param((5, 3, 128), "head-major", False, id="head-major"),
    ],
)
def test_packed_heads(shape, view, packed):
    """Which layouts the Hopper kernels read through one descriptor over ``(T, H * D)``: each row holds the
    heads side by side, ``D`` wide, with ``D`` a tile width."""
    from flashrange.kernels.common import packed_heads

    t = torch.empty(shape, dtype=torch.bfloat16)
    if view == "first-128":
        t = t[..., :128]
    elif view == "q-of-qkv":
        t = t[:, :3]  # rows of 3 * H heads: q's heads are side by side, the row stride is 3 * H * D
    elif view == "head-major":
        t = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert packed_heads(t) is packed
    assert packed_heads(torch.empty(5, 3, 128, dtype=torch.bfloat16), t) is packed


# ---------------------------------------------------------------------------------------------
# The unmasked fast path, zero-length inputs, the many-slice plan


def longest_full_run(q_range, k_range, mtype, Tq, Tk, block, *, by_keys=False):
    """Longest run of minor positions that one slice covers for *every* row (or key) of an aligned block.

    Blocks of ``block`` rows (``by_keys``: keys) start at multiples of ``block``,
    as the kernels lay them out; a run of at least ``2 * tile - 1`` positions
    holds a whole tile of ``tile`` positions wherever the kernel starts its
    tiles, i.e. a tile that takes the unmasked fast path. From the dense golden,
    not from the kernels' own geometry.
    """
    cells = dense_counts([q_range], [k_range], [mtype], Tq, Tk) > 0
    if by_keys:
        cells = cells.t()
    best = 0
    for b0 in range(0, cells.shape[0] - block + 1, block):
        full = cells[b0:b0 + block].all(dim=0).tolist()
        run = 0
        for c in full:
            run = run + 1 if c else 0
            best = max(best, run)
    return best


# One slice per type, large enough that whole tiles of the interpreter's defaults fall inside it:
# type -> (q_range, k_range, Tq, Tk) for the forward (64 x 64 tiles, cpu_m64_n64) and for the backward
# (32 x 32 tiles, along both of its walks).
FAST_PATH_SLICES = {
    "full": (FULL, ((3, 250), (5, 240), 253, 247), ((3, 100), (5, 95), 103, 97)),
    "causal": (CAUSAL, ((0, 259), (0, 259), 259, 259), ((0, 131), (0, 131), 131, 131)),
    "inv_causal": (INV_CAUSAL, ((0, 259), (0, 259), 259, 259), ((0, 131), (0, 131), 131, 131)),
    "bi_causal": (BI_CAUSAL, ((0, 128), (0, 320), 131, 321), ((0, 64), (0, 160), 67, 161)),
}


def fast_path_params(direction):
    """``FAST_PATH_SLICES`` of ``direction`` ("forward" or "backward") as ``(q_range, k_range, mtype, Tq, Tk)``."""
    i = {"forward": 1, "backward": 2}[direction]
    return [pytest.param(c[i][0], c[i][1], c[0], c[i][2], c[i][3], id=name) for name, c in FAST_PATH_SLICES.items()]


@pytest.mark.parametrize("q_range, k_range, mtype, Tq, Tk", fast_path_params("forward"))
def test_fast_path_every_type(q_range, k_range, mtype, Tq, Tk):
    """Default interpreter tiles, one big slice per type (plus an overlapping small one): the unmasked
    middle tiles and the masked edges together, Dv != D."""
    from flashrange.kernels.forward import default_config

    cfg = default_config(16, 32, torch.bfloat16, device_type="cpu")
    assert longest_full_run(q_range, k_range, mtype, Tq, Tk, cfg.BLOCK_M) >= 2 * cfg.BLOCK_N - 1
    q, k, v = make_qkv(Tq, Tk, 2, 1, 16, 32, torch.bfloat16, DEV, seed=mtype + 70)
    qr = torch.tensor([q_range, (7, 30)], dtype=torch.int32)
    kr = torch.tensor([k_range, (0, 9)], dtype=torch.int32)
    mt = torch.tensor([mtype, FULL], dtype=torch.int32)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.25)
    check_three_way(q, k, v, qr, kr, mt, 0.25, 0.0, out, lse)


@pytest.mark.parametrize(
    "Tq, Tk, S",
    [pytest.param(0, 5, 2, id="Tq0"), pytest.param(5, 0, 2, id="Tk0"), pytest.param(0, 0, 2, id="Tq0-Tk0"),
     pytest.param(5, 7, 0, id="S0"), pytest.param(0, 0, 0, id="all0")],
)
def test_zero_length_inputs(Tq, Tk, S):
    """Empty token axes and empty slice lists: right shapes, out 0 and lse -inf, no launch on nothing."""
    q, k, v = make_qkv(Tq, Tk, 2, 1, 16, 8, torch.bfloat16, DEV, seed=3)
    qr = torch.tensor([[0, Tq], [0, 3]][:S], dtype=torch.int32).reshape(S, 2)
    kr = torch.tensor([[0, Tk], [1, 2]][:S], dtype=torch.int32).reshape(S, 2)
    mt = torch.tensor([CAUSAL, FULL][:S], dtype=torch.int32)
    out, lse = run_kernel(q, k, v, qr, kr, mt, 0.25)
    assert out.shape == (Tq, 2, 8) and out.dtype == torch.bfloat16
    assert lse.shape == (Tq, 2) and lse.dtype == torch.float32
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_many_slice_plan_path():
    """Many slots (far past the plan's single-launch limit; mostly empty, as the transformers backend makes
    them): the Triton plan partitions and merges them, equals the torch plan, and the forward on it is right."""
    from flashrange.kernels.plan import build_plan

    T, H, D = 97, 2, 16
    S = 8192 + 101
    rng = random.Random(5)
    rows = [[0, 0, 0, 0, FULL]] * S
    # A causal document [0, 64) as one slice, then one row-slice per token of a second document
    # [64, T), scattered through the list; garbage (unknown types, reversed ranges) in between.
    slots = rng.sample(range(S), T - 64 + 6)
    rows[slots[0]] = [0, 64, 0, 64, CAUSAL]
    for t, slot in zip(range(64, T), slots[1:]):
        rows[slot] = [t, t + 1, 64, t + 1, CAUSAL if t % 2 else FULL]
    for slot in slots[T - 64 + 1:]:
        rows[slot] = [rng.randrange(-9, T), rng.randrange(-9, T + 9), rng.randrange(T), T + 40, rng.choice([5, -1])]
    t = torch.tensor(rows, dtype=torch.int32)
    qr, kr, mt = t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()
    plan = build_plan(qr, kr, mt, T, T, backend="triton")
    want = build_plan(qr, kr, mt, T, T, backend="torch")
    for name, x, y in zip(plan._fields, plan, want):
        assert torch.equal(x, y), name
    assert int((plan.q_slices[:, 4] >= 0).sum()) == 1 + T - 64
    q, k, v = make_qkv(T, T, H, H, D, D, torch.float16, DEV, seed=9)
    out, lse = range_attention_forward_triton(q, k, v, qr, kr, mt, 0.25, plan=plan)
    check_three_way(q, k, v, qr, kr, mt, 0.25, 0.0, out, lse)
    assert torch.isfinite(lse).all()
    # The oracle itself: the slot list means two causal documents.
    docs = torch.tensor([[0, 64], [64, T]], dtype=torch.int32)
    two_docs = range_attention_forward(q, k, v, docs, docs.clone(), torch.full((2,), CAUSAL, dtype=torch.int32), 0.25)
    ref = range_attention_forward(q, k, v, qr, kr, mt, 0.25)
    assert torch.equal(ref[0], two_docs[0]) and torch.equal(ref[1], two_docs[1])


@pytest.mark.parametrize("max_logits", [False, True], ids=["plain", "max-logits"])
def test_recorded_launch_passes_the_recorded_call_arguments(monkeypatch, max_logits):
    """A repeated call (docs/design.md §6) launches with exactly the arguments of the call it recorded.

    The recording only happens on a GPU outside the interpreter, so the dispatcher is stood in for:
    ``_launch`` records through ``jit_launch``, and ``_recorded_args`` (what the repeated call passes
    to the compiled kernel) must rebuild the same argument list for the same tensors.
    """
    import flashrange
    from flashrange.kernels import forward as fwd_mod

    launched = []

    def fake_jit_launch(kernel, grid, args, num_warps, num_stages, maxnreg=None):
        launched.append((grid, args))
        return "compiled-kernel"

    monkeypatch.setattr(fwd_mod, "jit_launch", fake_jit_launch)
    monkeypatch.setattr(fwd_mod, "_RECIPES", {})
    q = torch.randn(70, 4, 32)
    k = torch.randn(90, 2, 32)
    v = torch.randn(90, 2, 48)
    qr = torch.tensor([[0, 70], [10, 10]], dtype=torch.int32)
    kr = torch.tensor([[0, 90], [3, 3]], dtype=torch.int32)
    mt = torch.tensor([1, 0], dtype=torch.int32)
    plan = flashrange.plan_mask(qr, kr, mt, 70, 90)
    out = torch.empty(70, 4, 48)
    lse = torch.empty(70, 4)
    rowmax = torch.empty(70, 4) if max_logits else None
    config = fwd_mod._BY_NAME["cpu_m32_n16"]
    fwd_mod._launch(q, k, v, out, lse, rowmax, plan, 0.3, 2.0, config, fwd_mod.plan_split(config.BLOCK_M),
                    False, False, "the-signature")
    (grid, args), = launched
    recipe = fwd_mod._RECIPES["the-signature"]
    assert recipe.handle == "compiled-kernel" and recipe.grid == grid
    assert recipe.uses_tma is False  # the pointer tiles: a repeated call needs no scratch allocator
    again = fwd_mod._recorded_args(recipe, q, k, v, out, lse, rowmax, plan)
    assert len(again) == len(args)
    for a, b in zip(again, args):
        assert a is b if isinstance(a, torch.Tensor) else (type(a) is type(b) and a == b)


@pytest.mark.parametrize("config_name", ["sm90pppm_m128_n128_w4_s3", "sm90pppmd_m128_n128_w4_s3",
                                         "sm90pppma_m128_n128_w4_s3", "sm90pppmkq_m128_n128_w4_s2",
                                         "sm90pppmax1_m128_n128_w4_s3", "sm90pppmax2_m128_n128_w4_s3",
                                         "sm90pppmakr_m128_n128_w4_s2"],
                         ids=["fixed-share", "dynamic", "adaptive", "split-kv-two-query-blocks",
                              "adaptive-poly-quarter", "adaptive-poly-half", "adaptive-split-kv-row-intervals"])
def test_recorded_gluon_launch_takes_this_calls_ticket(monkeypatch, config_name):
    """The Hopper kernel's last argument is its work counter: under a dynamic schedule each launch, the recorded
    ones too, gets a fresh zeroed counter (a reused one would start past the list and skip every item);
    otherwise a tensor of this call stands in (the kernel never touches it), so no recording holds on to an
    earlier call's memory. Every other argument is the recorded call's (dispatcher stood in for, as above)."""
    pytest.importorskip("triton.experimental.gluon")
    import flashrange
    from flashrange.kernels import forward as fwd_mod

    launched = []
    monkeypatch.setattr(fwd_mod, "jit_launch", lambda kernel, grid, args, *a: launched.append(args) or "compiled")
    monkeypatch.setattr(fwd_mod, "_RECIPES", {})
    T, H, D = 300, 2, 128
    q, k, v = (torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(3))
    qr = torch.tensor([[0, 150], [150, 300]], dtype=torch.int32)
    mt = torch.tensor([1, 1], dtype=torch.int32)
    plan = flashrange.plan_mask(qr, qr, mt, T, T)
    config = fwd_mod._BY_NAME[config_name]
    out, lse = torch.empty(T, H, D, dtype=torch.bfloat16), torch.empty(T, H)
    fwd_mod._launch(q, k, v, out, lse, None, plan, D ** -0.5, 0.0, config, fwd_mod.plan_split(config.BLOCK_M),
                    True, False, "the-signature")
    (args,), recipe = launched, fwd_mod._RECIPES["the-signature"]
    # IS_DYNAMIC, IS_ADAPTIVE, IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS, IS_ROW_INTERVAL
    assert args[-7] is config.dynamic and args[-6] is config.adaptive and args[-5] is config.split_kv
    assert args[-4] == config.q_buffers and args[-3] == config.poly_exp2 and args[-2] is config.row_intervals
    # A repeated call: new outputs, the recorded tail, this call's counter.
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    again = fwd_mod._recorded_args(recipe, q, k, v, out2, lse2, None, plan)
    assert len(again) == len(args)
    assert again[3] is out2 and again[4] is lse2 and again[5] is lse2  # lse stands in for the row maxima
    for a, b in zip(again[6:-1], args[6:-1]):
        assert (a is b) if isinstance(a, torch.Tensor) else (type(a) is type(b) and a == b)
    if config.dynamic:
        for ticket in (args[-1], again[-1]):
            assert ticket.dtype == torch.int32 and ticket.tolist() == [0]
        assert again[-1] is not args[-1]
        assert fwd_mod._recorded_args(recipe, q, k, v, out2, lse2, None, plan)[-1] is not again[-1]
    else:
        assert args[-1] is lse and again[-1] is lse2


def test_recorded_launches_are_bounded(monkeypatch):
    """The record of call signatures is cleared when full: shapes that change every step cannot grow it forever."""
    import flashrange
    from flashrange.kernels import forward as fwd_mod

    monkeypatch.setattr(fwd_mod, "jit_launch", lambda *a: "compiled-kernel")
    monkeypatch.setattr(fwd_mod, "_RECIPES", {})
    monkeypatch.setattr(fwd_mod, "_MAX_RECIPES", 3)
    config = fwd_mod._BY_NAME["cpu_m32_n16"]
    for T in range(17, 27):
        q = torch.randn(T, 1, 16)
        qr = torch.tensor([[0, T]], dtype=torch.int32)
        mt = torch.tensor([0], dtype=torch.int32)
        plan = flashrange.plan_mask(qr, qr, mt, T, T)
        fwd_mod._launch(q, q, q, torch.empty_like(q), torch.empty(T, 1), None, plan, 0.25, 0.0, config,
                        fwd_mod.plan_split(config.BLOCK_M), False, False, ("sig", T))
        assert 1 <= len(fwd_mod._RECIPES) <= 3
        assert ("sig", T) in fwd_mod._RECIPES


def test_tma_scratch_allocator_is_set_on_every_call_in_every_thread(monkeypatch):
    """Triton keeps its allocator per thread (a context variable): the forward and the Hopper backward set it on each launch that builds
    tensor descriptors, in whatever thread that is (the autograd engine's, under activation checkpointing),
    never behind a process-wide "done" flag (docs/design.md §6; the GPU twin is in tests/test_gpu_eager.py)."""
    import threading

    import triton

    from flashrange.kernels.common import ensure_tma_allocator, tma_scratch

    calls = []
    monkeypatch.setattr(triton, "set_allocator", lambda alloc: calls.append((threading.get_ident(), alloc)))
    ensure_tma_allocator()
    ensure_tma_allocator()
    th = threading.Thread(target=ensure_tma_allocator)
    th.start()
    th.join()
    assert len(calls) == 3 and all(alloc is tma_scratch for _, alloc in calls)
    assert calls[0][0] == calls[1][0] != calls[2][0]


def test_hopper_config_refused_off_hopper():
    """The Gluon configs are never picked here, and one asked for by name says what it needs."""
    from flashrange.kernels.forward import configs_for, default_config

    for D in (64, 128):
        assert not default_config(D, D, torch.bfloat16, device_type="cpu").gluon
        assert not any(c.gluon for c in configs_for(D, D, torch.bfloat16, device_type="cpu"))
    q, k, v = make_qkv(40, 40, 2, 1, 64, 64, torch.bfloat16, DEV, seed=1)
    r = torch.tensor([[0, 40]], dtype=torch.int32)
    with pytest.raises(ValueError, match="compute-capability-9 GPU"):
        run_kernel(q, k, v, r, r.clone(), torch.tensor([CAUSAL], dtype=torch.int32), 0.125,
                   config="sm90ws_m128_n128_w4_s2")


def _jit_parameters(kernel):
    """``[(name, is_constexpr)]`` and the unspecialized names of a jitted kernel, interpreted or not."""
    import inspect

    fn = getattr(kernel, "fn", kernel)
    params = [(name, "constexpr" in str(p.annotation)) for name, p in inspect.signature(fn).parameters.items()]
    options = getattr(kernel, "kwargs", None) or {}
    unspecialized = options.get("do_not_specialize")
    if unspecialized is None:
        unspecialized = [p.name for p in kernel.params if p.do_not_specialize]
    return params, sorted(unspecialized)


def test_hopper_kernel_takes_the_triton_kernels_arguments():
    """The launcher passes one argument list to either kernel: the Gluon kernel's parameters are the Triton
    kernel's, in order, then its own eleven (the last, the dynamic schedule's counter, a pointer); both leave the
    same sizes unspecialized."""
    pytest.importorskip("triton.experimental.gluon")
    from flashrange.kernels import forward as fwd
    from flashrange.kernels.forward_sm90 import range_attn_fwd_sm90_ws_kernel as gluon_kernel

    triton_params, triton_free = _jit_parameters(fwd._range_attn_fwd_kernel)
    gluon_params, gluon_free = _jit_parameters(gluon_kernel)
    assert gluon_params == triton_params + [("STAGES", True), ("NUM_WARPS", True), ("IS_PINGPONG", True),
                                            ("HAS_PACKED_HEADS", True), ("IS_DYNAMIC", True), ("IS_ADAPTIVE", True),
                                            ("IS_KV_SPLIT", True),
                                            ("Q_BUFS", True), ("POLY_QUARTERS", True), ("IS_ROW_INTERVAL", True),
                                            ("ticket_ptr", False)]
    assert gluon_free == triton_free == ["GROUP", "Tk", "Tq"]


# ---------------------------------------------------------------------------------------------
# Merged tiles: a query block's short slices walked as one run of key tiles


def _rows_tensors(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


@triton.jit
def _merge_decisions_kernel(slices_ptr, block_lo_ptr, block_hi_ptr, out_ptr, Tq, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    r0 = pid * BLOCK_M
    is_merged, k_lo, n_tiles, k_end = merged_span(slices_ptr, tl.load(block_lo_ptr + pid),
                                                  tl.load(block_hi_ptr + pid), r0, tl.minimum(r0 + BLOCK_M, Tq),
                                                  BLOCK_N)
    tl.store(out_ptr + pid * 4 + 0, is_merged.to(tl.int32))
    tl.store(out_ptr + pid * 4 + 1, k_lo)
    tl.store(out_ptr + pid * 4 + 2, n_tiles)
    tl.store(out_ptr + pid * 4 + 3, k_end)


def _merge_decisions(rows, Tq, Tk, block_n=64):
    """Per plan block of the query-major plan: ``(is_merged, k_lo, n_tiles, k_end)`` of ``common.merged_span``."""
    from flashrange import plan_mask
    from flashrange.constants import PLAN_BLOCK

    qr, kr, mt = (t.to(DEV) for t in _rows_tensors(rows))
    plan = plan_mask(qr, kr, mt, Tq, Tk)
    n_blocks = plan.q_block_lo.shape[0]
    out = torch.full((n_blocks, 4), -7, dtype=torch.int32, device=DEV)
    _merge_decisions_kernel[(n_blocks,)](plan.q_slices, plan.q_block_lo, plan.q_block_hi, out, Tq, PLAN_BLOCK,
                                         block_n)
    return out.cpu().tolist()


@pytest.mark.parametrize(
    "rows,T,want",
    [
        # Three documents in block 0 (tiles of 64 keys: 1 + 1 + 2 one by one, 2 as one run); one long after.
        pytest.param([(0, 20, 0, 20, CAUSAL), (20, 50, 20, 50, CAUSAL), (50, 128, 50, 128, CAUSAL),
                      (128, 300, 128, 300, CAUSAL)], 300, [[1, 0, 2, 128], [0], [0]], id="documents"),
        pytest.param([(0, 100, 0, 100, CAUSAL), (100, 128, 100, 128, FULL)], 128, [[1, 0, 2, 128]],
                     id="two-documents"),
        pytest.param([(0, 128, 0, 128, FULL), (10, 20, 0, 10, FULL)], 128, [[0]], id="rows-overlap"),
        pytest.param([(0, 30, 0, 30, FULL), (29, 128, 30, 128, CAUSAL)], 128, [[0]], id="one-row-in-two"),
        pytest.param([(0, 30, 0, 30, FULL), (30, 128, 30, 128, CAUSAL)], 128, [[1, 0, 2, 128]], id="rows-touch"),
        pytest.param([(0, 40, 0, 40, CAUSAL), (40, 128, 50, 128, CAUSAL)], 128, [[0]], id="keys-gap"),
        # Rows 896..1000 reach 1000 keys: one run of 16 tiles, over MERGE_MAX_TILES.
        pytest.param([(0, 1000, 0, 1000, CAUSAL), (1000, 1100, 1000, 1100, CAUSAL)], 1100,
                     [[0]] * 9, id="long-then-short"),
        pytest.param([(0, 64, 0, 64, FULL), (64, 128, 64, 128, FULL)], 128, [[0]], id="no-tile-saved"),
        pytest.param([(0, 128, 0, 128, CAUSAL)], 128, [[0]], id="one-slice"),
    ],
)
def test_merged_span_decisions(rows, T, want):
    """When a query block walks its slices as one run of tiles, from the definition: rows split between
    slices, keys one interval, fewer tiles, at most ``MERGE_MAX_TILES``."""
    got = _merge_decisions(rows, T, T)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[: len(w)] == w, (got, want)


@pytest.mark.parametrize("kind", ["tiny", "mixed", "cross", "gapped", "holes"])
def test_merged_tiles_three_way(kind):
    """Packed short documents, with and without merged tiles: both obey the three-way rule, and a NaN in
    keys no slice covers reaches no output."""
    import dataclasses

    from flashrange.kernels.forward import _BY_NAME

    rng = random.Random(len(kind))
    Tq, Tk = 333, (290 if kind == "cross" else 333)
    rows = packed_document_rows(kind, Tq, Tk, rng)
    if kind == "tiny":
        # The path under test runs: some block of 128 rows merges (tiles of 64 keys).
        assert any(d[0] == 1 for d in _merge_decisions(rows, Tq, Tk))
    qr, kr, mt = _rows_tensors(rows)
    q, k, v = make_qkv(Tq, Tk, 4, 2, 32, 32, torch.float16, DEV, seed=len(rows))
    uncovered = dense_counts(qr, kr, mt, Tq, Tk).sum(0) == 0
    k[uncovered.to(k.device)] = float("nan")
    v[uncovered.to(v.device)] = float("nan")
    merged = _BY_NAME["cpu_m64_n64"]
    assert merged.merge
    for cfg in (merged, dataclasses.replace(merged, merge=False)):
        out, lse = run_kernel(q, k, v, qr, kr, mt, 0.3, config=cfg)
        check_three_way(q, k, v, qr, kr, mt, 0.3, 0.0, out, lse)


def test_merged_tiles_bitwise_invariant():
    """Merged tiles keep the bits under reruns, slice permutations and inserted empty slices."""
    rows = packed_document_rows("mixed", 401, 401, random.Random(9))
    qr, kr, mt = _rows_tensors(rows)
    q, k, v = make_qkv(401, 401, 2, 1, 32, 32, torch.bfloat16, DEV, seed=4)
    base = run_kernel(q, k, v, qr, kr, mt, 0.25)
    perm = torch.randperm(qr.shape[0], generator=torch.Generator().manual_seed(5))
    pad = torch.tensor([[0, 0], [7, 7], [0, 0]], dtype=torch.int32)
    qr2, kr2 = torch.cat([qr[perm], pad]), torch.cat([kr[perm], pad])
    mt2 = torch.cat([mt[perm], torch.tensor([FULL, CAUSAL, BI_CAUSAL], dtype=torch.int32)])
    for args in ((qr, kr, mt), (qr2, kr2, mt2)):
        out, lse = run_kernel(q, k, v, *args, 0.25)
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
