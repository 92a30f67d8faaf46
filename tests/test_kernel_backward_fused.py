"""The backward that accumulates dQ inside its key-major kernel (``BwdConfig(fused_dq=True)``), on the interpreter.

Three-way accuracy as in ``test_kernel_backward.py`` (golden: the reference on float64 inputs; budget: the
reference in the test dtype), bitwise reruns and invariance to slice order and empty slices (the turns fix
the order of dQ's adds), and the turn counters: every wait due on time, and a plan whose query-major windows
miss slices caught by the error flag instead of hanging. Small tiles (16 rows, 32 keys), so that several key
tiles add to the same query tile.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashrange import plan_mask, reference
from flashrange.constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL
from flashrange.kernels.backward import BwdConfig, range_attention_backward_triton
from flashrange.kernels.backward_fused import fused_backward
from golden import assert_three_way, grad_inputs, random_slice_rows

FUSED = BwdConfig(16, 32, 4, 1, 32, 32, 4, 1, fused_dq=True)


def _ranges(rows):
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def _docs(T, n, seed):
    """``n`` causal documents tiling ``[0, T)`` (seeded cuts)."""
    cuts = sorted(random.Random(seed).sample(range(1, T), n - 1))
    b = [0] + cuts + [T]
    return [(b[i], b[i + 1], b[i], b[i + 1], CAUSAL) for i in range(n)]


CASES = [
    pytest.param(203, 203, 4, 2, 40, 40, lambda T, _: _docs(T, 9, 1), torch.bfloat16, 0.0, False,
                 id="documents-gqa2-d40-bf16"),
    pytest.param(130, 130, 2, 2, 16, 16,
                 lambda T, _: random_slice_rows(T, T, 9, random.Random(2), n_empty=3, uncovered=7, random_types=True),
                 torch.float16, 0.0, True, id="every-type-overlaps-empties-uncovered-fp16-dlse"),
    pytest.param(97, 150, 4, 1, 32, 16,
                 lambda Tq, Tk: [(0, 97, 0, 150, CAUSAL), (10, 60, 20, 140, INV_CAUSAL), (40, 97, 30, 120, BI_CAUSAL),
                                 (5, 9, 140, 150, FULL)],
                 torch.bfloat16, 20.0, True, id="cross-gqa4-dv16-softcap-dlse-bf16"),
    pytest.param(63, 63, 3, 3, 16, 24, lambda T, _: [(0, 63, 0, 63, FULL), (0, 63, 0, 63, CAUSAL)], torch.float32,
                 0.0, False, id="full-and-causal-on-the-same-cells-fp32"),
    pytest.param(77, 77, 6, 2, 16, 40, lambda T, _: _docs(T, 4, 5) + [(30, 77, 0, 20, FULL)], torch.bfloat16, 0.0,
                 True, id="gqa3-dv40-documents-and-a-prefix-bf16"),
]


@pytest.mark.parametrize("Tq, Tk, Hq, Hkv, D, Dv, rows_of, dtype, softcap, with_dlse", CASES)
def test_fused_three_way(Tq, Tk, Hq, Hkv, D, Dv, rows_of, dtype, softcap, with_dlse):
    q, k, v, do, dlse = grad_inputs(Tq, Tk, Hq, Hkv, D, Dv, dtype, seed=Tq + D)
    dlse = dlse if with_dlse else None
    qr, kr, mt = _ranges(rows_of(Tq, Tk))
    f64 = [t.double() for t in (q, k, v)]
    out64, lse64 = reference.range_attention_forward(*f64, qr, kr, mt, None, softcap)
    golden = reference.range_attention_backward(do.double(), *f64, out64, lse64, qr, kr, mt, None, softcap, dlse)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, None, softcap)
    ref = reference.range_attention_backward(do, q, k, v, out, lse, qr, kr, mt, None, softcap, dlse)
    got = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, softcap, dlse, config=FUSED)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, ref, golden):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_three_way(name, a, b, c)


def _fused_call(rows, seed=5, T=150, Hq=4, Hkv=2, D=16):
    q, k, v, do, dlse = grad_inputs(T, T, Hq, Hkv, D, D, torch.bfloat16, seed)
    qr, kr, mt = _ranges(rows)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, None, 0.0)
    return range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse, config=FUSED)


def test_fused_bitwise_rerun_permutation_and_empty_slices():
    """dQ's adds follow key tiles and the plan's canonical slice order: the list's order and empty slices
    in it change no bit, and neither does running again."""
    rows = random_slice_rows(150, 150, 10, random.Random(7), random_types=True)
    first = _fused_call(rows)
    again = _fused_call(rows)
    shuffled = list(rows)
    random.Random(8).shuffle(shuffled)
    padded = shuffled[:4] + [(0, 0, 0, 0, FULL), (30, 30, 5, 90, CAUSAL)] + shuffled[4:] + [(60, 90, 70, 70, FULL)]
    other = _fused_call(padded)
    for a, b, c in zip(first, again, other):
        assert torch.equal(a, b) and torch.equal(a, c)


def _direct(rows, T, plan=None, Hq=2, Hkv=1, D=16):
    """:func:`fused_backward` itself (its error flag is not returned by the public path)."""
    q, k, v, do, _ = grad_inputs(T, T, Hq, Hkv, D, D, torch.bfloat16, 11)
    qr, kr, mt = _ranges(rows)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, None, 0.0)
    plan = plan_mask(qr, kr, mt, T, T) if plan is None else plan
    return fused_backward(do, q, k, v, out, lse, None, plan, D ** -0.5, 0.0, block_m=16, block_n=32, num_warps=4,
                          num_stages=1, dot_precision="ieee", bf16_emulated=True, block_d=D, block_dv=D, max_spins=1)


def test_fused_turns_are_due_and_a_wrong_window_is_flagged():
    """Every wait finds its turn due (error 0) on a mask where many key tiles add to each query tile; a plan
    whose query-major windows were emptied makes the turns disagree, which the flag reports (no hang)."""
    T = 190
    rows = [(0, T, 0, T, CAUSAL), (20, 150, 0, 170, FULL), (100, 190, 40, 60, INV_CAUSAL)]
    *_, error = _direct(rows, T)
    assert int(error) == 0
    plan = plan_mask(*_ranges(rows), T, T)
    broken = plan._replace(q_block_hi=plan.q_block_lo.clone())
    *_, error = _direct(rows, T, plan=broken)
    assert int(error) == 1


def test_fused_config_checks():
    with pytest.raises(ValueError, match="fused_dq runs a Triton kernel"):
        BwdConfig(64, 128, 8, 2, 128, 64, 8, 2, gluon_dkdv=True, fused_dq=True)
    with pytest.raises(ValueError, match="fused_dq must be a bool"):
        BwdConfig(16, 32, 4, 1, 32, 32, 4, 1, fused_dq=1)


@pytest.mark.parametrize(
    "Tq, Tk, rows",
    [
        pytest.param(150, 150, _docs(150, 6, 3) + [(0, 150, 0, 40, FULL)], id="documents-and-a-prefix"),
        pytest.param(1, 1, [(0, 1, 0, 1, CAUSAL)], id="one-token"),
        pytest.param(19, 5, [(0, 0, 0, 0, FULL), (7, 7, 0, 5, CAUSAL), (3, 9, 2, 2, FULL)], id="only-empty-slices"),
        pytest.param(40, 17, [(-4, 60, -9, 30, FULL), (30, 20, 0, 17, CAUSAL), (5, 25, 3, 12, 9)],
                     id="garbage-ranges-clamped-or-ignored"),
    ],
)
def test_fused_equals_the_two_kernel_backward(Tq, Tk, rows):
    """The same gradients as the two-kernel backward up to rounding (only the grouping of the sums differs),
    on documents and on edges the plan resolves (a single token, slices that cover nothing, ranges past the
    tensors, an unknown type code), zeros where nothing is covered."""
    q, k, v, do, dlse = grad_inputs(Tq, Tk, 4, 2, 16, 16, torch.float32, 6)
    qr, kr, mt = _ranges(rows)
    out, lse = reference.range_attention_forward(q, k, v, qr, kr, mt, None, 0.0)
    fused = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse, config=FUSED)
    split = range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, None, 0.0, dlse,
                                            config=BwdConfig(16, 32, 4, 1, 32, 32, 4, 1))
    for a, b in zip(fused, split):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    if all(qe <= qs or ke <= ks for qs, qe, ks, ke, _ in rows):
        assert not any(g.any() for g in fused)
