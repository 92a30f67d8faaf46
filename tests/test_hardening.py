"""Inputs at the edges of the contract (docs/design.md §2): empty slices anywhere, reversed ranges, zero-length
tensors, and NaN/Inf in tokens that no slice covers.

- An empty slice (``start == end``) is padding wherever it lies, even outside
  ``[0, T]`` (``[5, 5)`` with ``Tq = 1``): accepted in every mode (default,
  strict, compiled) and no output bit changes, forward or backward.
- ``start > end`` is reported in strict mode and treated as empty otherwise.
- Zero-length token axes and empty slice lists work through the public
  function and its gradient.
- NaN/Inf in a query row, key or value that no slice covers never reaches a
  covered row (forward and backward), in the reference on the CPU and in the
  Triton kernels under the interpreter; NaN in a covered key reaches the rows
  that cover it.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashrange import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, RangeMask, range_attention
from golden import dense_counts

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

I32 = torch.int32

# NaN and Inf inputs are the point here: numpy warns about them inside the Triton interpreter.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _qkv(Tq, Tk, Hq=2, Hkv=1, D=16, Dv=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, Hq, D, generator=g).to(dtype)
    k = torch.randn(Tk, Hkv, D, generator=g).to(dtype)
    v = torch.randn(Tk, Hkv, Dv, generator=g).to(dtype)
    return q, k, v


def _run_with_grads(fn, q, k, v, mask_args, **kw):
    """``(out, lse, dq, dk, dv)`` of ``fn`` with fixed upstream gradients (lse's where finite)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, lse = fn(q, k, v, *mask_args, **kw)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return (out.detach(), lse.detach(), *grads)


def _mask(rows):
    t = torch.tensor(rows, dtype=I32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


# ----------------------------------------------------------------------------- empty slices anywhere


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("mode", ["default", "strict", "strict-env", "compiled"])
def test_empty_slice_outside_the_tensor_changes_nothing(mode, monkeypatch):
    """``[5, 5)`` with Tq = 1 (and an empty key range past Tk) is padding: accepted, no bit changes."""
    Tq, Tk = 1, 6
    q, k, v = _qkv(Tq, Tk, seed=2)
    base = _mask([(0, 1, 0, Tk, CAUSAL)])
    padded = _mask([(5, 5, 0, Tk, FULL), (0, 1, 0, Tk, CAUSAL), (0, 1, 9, 9, BI_CAUSAL), (-4, -4, 2, 3, FULL)])
    kw = {}
    fn = range_attention
    if mode == "strict":
        kw = {"strict": True}
    elif mode == "strict-env":
        monkeypatch.setenv("FLASHRANGE_STRICT", "1")
    elif mode == "compiled":
        fn = _compiled(range_attention)
    want = _run_with_grads(range_attention, q, k, v, base)
    got = _run_with_grads(fn, q, k, v, padded, **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    RangeMask(*padded).validate(Tq, Tk)  # the mask tool agrees


def test_reversed_range_reported_in_strict_mode_ignored_otherwise(monkeypatch):
    Tq, Tk = 9, 7
    q, k, v = _qkv(Tq, Tk, seed=3)
    base = _mask([(0, 9, 0, 7, CAUSAL), (2, 5, 1, 4, FULL)])
    with_reversed = _mask([(0, 9, 0, 7, CAUSAL), (6, 3, 0, 7, FULL), (2, 5, 1, 4, FULL), (1, 2, 5, 2, INV_CAUSAL)])
    with pytest.raises(ValueError, match=r"slice 1: start after end \(q_ranges\[1\] = \[6, 3\)"):
        range_attention(q, k, v, *with_reversed, strict=True)
    monkeypatch.setenv("FLASHRANGE_STRICT", "1")
    with pytest.raises(ValueError, match=r"slice 1: start after end"):
        range_attention(q, k, v, *with_reversed)
    with pytest.raises(ValueError, match=r"slice 1: start after end"):
        RangeMask(*with_reversed).validate(Tq, Tk)
    monkeypatch.delenv("FLASHRANGE_STRICT")
    want = _run_with_grads(range_attention, q, k, v, base)
    for fn in (range_attention, _compiled(range_attention)):
        got = _run_with_grads(fn, q, k, v, with_reversed)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------- zero-length tensors


@pytest.mark.parametrize(
    "Tq, Tk, S",
    [pytest.param(0, 5, 2, id="Tq0"), pytest.param(5, 0, 2, id="Tk0"), pytest.param(0, 0, 0, id="Tq0-Tk0-S0"),
     pytest.param(4, 6, 0, id="S0")],
)
def test_zero_length_through_range_attention(Tq, Tk, S):
    q, k, v = _qkv(Tq, Tk, Dv=8, seed=4)
    mask = _mask([(0, Tq, 0, Tk, CAUSAL), (0, min(2, Tq), min(1, Tk), min(3, Tk), FULL)][:S])
    out, lse, dq, dk, dv = _run_with_grads(range_attention, q, k, v, mask)
    assert out.shape == (Tq, 2, 8) and lse.shape == (Tq, 2) and lse.dtype == torch.float32
    assert (out == 0).all() and torch.isneginf(lse).all()
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and torch.count_nonzero(g) == 0
    strict = range_attention(q, k, v, *mask, strict=True)  # the value checks accept them too
    assert torch.equal(strict[0], out) and torch.equal(strict[1], lse)


# ----------------------------------------------------------------------------- NaN / Inf


# Rows 10, 11 (top of a CAUSAL slice with Lq > Lk), 25-27 and 34-39 are covered by nothing; keys 10, 11
# and 25-29 are read by nothing (the INV_CAUSAL slice with Lq < Lk reads all its keys).
T_NAN = 40
NAN_ROWS = [(0, 10, 0, 10, FULL), (10, 25, 12, 25, CAUSAL), (28, 34, 30, 40, INV_CAUSAL), (0, 0, 0, 0, FULL)]
POISON = {  # tensor -> {token: value}
    "q": {10: float("nan"), 26: float("inf"), 36: float("nan")},
    "k": {11: float("-inf"), 27: float("nan")},
    "v": {10: float("nan"), 28: float("inf")},
}


def _poison(q, k, v, which=("q", "k", "v")):
    q, k, v = q.clone(), k.clone(), v.clone()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if name in which:
            for token, value in POISON[name].items():
                t[token, :, 1] = value
    return q, k, v


def _covered():
    counts = dense_counts(*_mask(NAN_ROWS), T_NAN, T_NAN)
    return (counts > 0).any(1), (counts > 0).any(0)


def test_nan_mask_layout():
    """The poisoned tokens are exactly outside the mask's rows and keys (the premise of the tests below)."""
    rows, keys = _covered()
    for token in POISON["q"]:
        assert not rows[token]
    for token in list(POISON["k"]) + list(POISON["v"]):
        assert not keys[token]
    assert rows.sum() > 25 and keys.sum() > 25


def _assert_clean(got, want, name, *, skip=()):
    """Covered rows / keys bitwise as without the poison; uncovered ones zero (lse -inf), never NaN.

    ``skip``: labels whose uncovered part is checked elsewhere.
    """
    out, lse, dq, dk, dv = got
    rows, keys = _covered()
    for label, x, y, idx in (("out", out, want[0], rows), ("lse", lse, want[1], rows), ("dq", dq, want[2], rows),
                             ("dk", dk, want[3], keys), ("dv", dv, want[4], keys)):
        assert torch.equal(x[idx], y[idx]), f"{name}: {label} of covered tokens changed"
        if label in skip:
            continue
        if label == "lse":
            assert torch.isneginf(x[~idx]).all(), f"{name}: lse of uncovered rows"
        else:
            assert torch.count_nonzero(x[~idx]) == 0, f"{name}: {label} of uncovered tokens not zero"


@pytest.mark.parametrize("which", [pytest.param(w, id=w) for w in ("q", "k", "v", "qkv")])
def test_reference_uncovered_nan_inf_stay_out(which):
    q, k, v = _qkv(T_NAN, T_NAN, seed=5)
    mask = _mask(NAN_ROWS)
    want = _run_with_grads(range_attention, q, k, v, mask)
    got = _run_with_grads(range_attention, *_poison(q, k, v, tuple(which)), mask)
    _assert_clean(got, want, f"reference, poisoned {which}")


def _kernel_fwd_bwd(q, k, v, mask, dtype):
    """Triton forward then backward (interpreter on the CPU), with fixed upstream gradients."""
    from flashrange.kernels.backward import range_attention_backward_triton
    from flashrange.kernels.forward import range_attention_forward_triton

    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = range_attention_forward_triton(q, k, v, *mask, 0.25, 0.0)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    dlse = torch.randn(lse.shape, generator=g)
    return (out, lse, *range_attention_backward_triton(dout, q, k, v, out, lse, *mask, 0.25, 0.0, dlse))


@pytest.mark.parametrize("which", [pytest.param(w, id=w) for w in ("q", "k", "v", "qkv")])
def test_kernels_uncovered_nan_inf_stay_out(which):
    """Every covered output bit as without the poison; uncovered rows and keys zero (the dK of a poisoned
    uncovered key itself: ``test_kernels_dk_of_an_uncovered_key_with_nan_value``)."""
    pytest.importorskip("triton")
    q, k, v = _qkv(T_NAN, T_NAN, seed=6)
    mask = _mask(NAN_ROWS)
    want = _kernel_fwd_bwd(q, k, v, mask, torch.bfloat16)
    got = _kernel_fwd_bwd(*_poison(q, k, v, tuple(which)), mask, torch.bfloat16)
    _assert_clean(got, want, f"kernels, poisoned {which}", skip=("dk",))
    _, keys = _covered()
    unpoisoned = ~keys.clone()
    unpoisoned[list(POISON["v"])] = False
    assert torch.count_nonzero(got[3][unpoisoned]) == 0, "dk of uncovered keys with a finite value"


def test_kernels_dk_of_an_uncovered_key_with_nan_value():
    pytest.importorskip("triton")
    q, k, v = _qkv(T_NAN, T_NAN, seed=6)
    got = _kernel_fwd_bwd(*_poison(q, k, v, ("v",)), _mask(NAN_ROWS), torch.bfloat16)
    _, keys = _covered()
    assert torch.count_nonzero(got[3][~keys]) == 0


# A BI_CAUSAL slice with Lq > Lk covers no cell (docs/design.md §2: "empty when Lq > Lk"), so the keys of its
# rectangle that nothing else reads are uncovered tokens too; rows 0-19 are covered by the FULL slice.
EMPTY_BAND = [(0, 20, 0, 10, FULL), (0, 20, 10, 15, BI_CAUSAL)]
EMPTY_BAND_KEY = 12


def _band_run(run, which, seed):
    q, k, v = _qkv(20, 20, seed=seed)
    mask = _mask(EMPTY_BAND)
    want = run(q, k, v, mask)
    k2, v2 = k.clone(), v.clone()
    (k2 if which == "k" else v2)[EMPTY_BAND_KEY, :, 3] = float("nan")
    got = run(q, k2, v2, mask)
    counts = dense_counts(*mask, 20, 20)
    assert counts[:, EMPTY_BAND_KEY].sum() == 0 and (counts > 0).any(1).all()
    return got, want


@pytest.mark.parametrize("which", ["k", "v"])
def test_reference_nan_under_an_empty_band_stays_out(which):
    got, want = _band_run(lambda q, k, v, m: _run_with_grads(range_attention, q, k, v, m), which, seed=7)
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        rows = slice(None) if label != "dk" and label != "dv" else [j for j in range(20) if j != EMPTY_BAND_KEY]
        assert torch.equal(a[rows], b[rows]), label




@pytest.mark.parametrize(
    "which, part",
    [
        pytest.param("k", "fwd", id="k-forward"),
        pytest.param("v", "fwd", id="v-forward"),
        pytest.param("k", "bwd", id="k-backward"),
        pytest.param("v", "bwd", id="v-backward"),
    ],
)
def test_kernels_nan_under_an_empty_band_stays_out(which, part):
    pytest.importorskip("triton")
    got, want = _band_run(lambda q, k, v, m: _kernel_fwd_bwd(q, k, v, m, torch.bfloat16), which, seed=8)
    names = ("out", "lse") if part == "fwd" else ("dq", "dk", "dv")
    for label, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if label not in names:
            continue
        rows = [j for j in range(20) if j != EMPTY_BAND_KEY] if label in ("dk", "dv") else slice(None)
        assert torch.equal(a[rows], b[rows]), label


@pytest.mark.parametrize("impl", ["reference", "kernels"])
def test_nan_in_a_covered_key_reaches_its_rows(impl):
    """NaN in a key that rows 0-9 read (FULL slice) makes exactly those rows NaN (forward) and their dq NaN."""
    q, k, v = _qkv(T_NAN, T_NAN, seed=9)
    k[5, 0, 2] = float("nan")
    mask = _mask(NAN_ROWS)
    if impl == "reference":
        out, lse, dq, dk, dv = _run_with_grads(range_attention, q, k, v, mask)
    else:
        pytest.importorskip("triton")
        out, lse, dq, dk, dv = _kernel_fwd_bwd(q, k, v, mask, torch.bfloat16)
    nan_rows = torch.isnan(out).any(-1).any(-1)
    want = torch.zeros(T_NAN, dtype=torch.bool)
    want[0:10] = True
    assert torch.equal(nan_rows, want)
    assert torch.isnan(dq[0:10]).any(-1).all() and torch.isnan(dk[5]).any()
    if impl == "reference":
        assert torch.isnan(lse[0:10]).all() and not torch.isnan(lse[10:]).any()


def test_kernels_lse_of_a_nan_row_is_nan():
    pytest.importorskip("triton")
    q, k, v = _qkv(T_NAN, T_NAN, seed=9)
    k[5, 0, 2] = float("nan")
    out, lse, *_ = _kernel_fwd_bwd(q, k, v, _mask(NAN_ROWS), torch.bfloat16)
    assert torch.isnan(out[0:10]).any(-1).any(-1).all()
    assert torch.isnan(lse[0:10]).all()

