"""Every error path of the mask tools and front-ends says what is wrong.

Each case builds a bad input and asserts both the exception type and that
the message names the problem (and, where there is one, the slice).
"""

from __future__ import annotations

import builtins
import sys

import pytest
import torch

from flashrange import (
    CAUSAL,
    FULL,
    RangeMask,
    flash_attn_func,
    flash_attn_varlen_func,
    flex_flash_attn_func,
    range_attention,
)

from golden import dense_attention, dense_counts, max_err

I32 = torch.int32


def _t(x, dtype=I32):
    return torch.tensor(x, dtype=dtype)


CONSTRUCTOR_ERRORS = [
    pytest.param(lambda: RangeMask(_t([[0, 1]], torch.int64), _t([[0, 1]]), _t([0])), r"q_ranges must be int32, got torch\.int64", id="q-int64"),
    pytest.param(lambda: RangeMask(_t([[0, 1]]), _t([[0.0, 1.0]], torch.float32), _t([0])), r"k_ranges must be int32, got torch\.float32", id="k-float"),
    pytest.param(lambda: RangeMask(_t([[0, 1]]), _t([[0, 1]]), _t([0], torch.int64)), r"mask_types must be int32", id="types-int64"),
    pytest.param(lambda: RangeMask(_t([[0, 1, 2]]), _t([[0, 1]]), _t([0])), r"q_ranges must have shape \(S, 2\).*\(1, 3\)", id="q-shape"),
    pytest.param(lambda: RangeMask(_t([[0, 1]]), _t([0, 1]), _t([0])), r"k_ranges must have shape \(S, 2\).*\(2,\)", id="k-1d"),
    pytest.param(lambda: RangeMask(_t([[0, 1]]), _t([[0, 1]]), _t([[0]])), r"mask_types must have shape \(S,\)", id="types-2d"),
    pytest.param(lambda: RangeMask(_t([[0, 1], [1, 2]]), _t([[0, 1]]), _t([0])), r"same number of slices, got 2, 1, 1", id="count-mismatch"),
    pytest.param(lambda: RangeMask(_t([[0, 1]]), _t([[0, 1]]).to("meta"), _t([0])), r"one device.*mask\.to\(device\)", id="device-mismatch"),
    pytest.param(lambda: RangeMask([[0, "a"]], [[0, 1]]), r"q_ranges must be a tensor or a nested list of ints", id="list-garbage"),
]


@pytest.mark.parametrize("build, message", CONSTRUCTOR_ERRORS)
def test_constructor_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_validate_rechecks_static_properties_after_reassignment():
    m = RangeMask.causal(5)
    m.mask_types = m.mask_types.long()
    with pytest.raises(ValueError, match=r"mask_types must be int32, got torch\.int64; convert with mask_types\.to"):
        m.validate(5, 5)


# ``{types}``: the caller's name of the types tensor (mask_types, or attn_type_map for flex_flash_attn_func).
VALUE_ERRORS = [
    pytest.param([[0, 5], [2, 9]], [[0, 5], [0, 5]], [FULL, FULL], r"slice 1: q_ranges\[1\] = \[2, 9\) lies outside \[0, Tq=8\]", id="q-past-end"),
    pytest.param([[0, 5]], [[-1, 5]], [FULL], r"slice 0: k_ranges\[0\] = \[-1, 5\) lies outside \[0, Tk=6\]", id="k-negative"),
    pytest.param([[0, 5]], [[0, 7]], [CAUSAL], r"slice 0: k_ranges\[0\] = \[0, 7\) lies outside \[0, Tk=6\]", id="k-past-end"),
    pytest.param([[0, 0], [4, 2]], [[0, 0], [0, 3]], [FULL, FULL], r"slice 1: start after end.*use \[0, 0\) for a padding slice", id="q-reversed"),
    pytest.param([[0, 2]], [[5, 3]], [FULL], r"slice 0: start after end", id="k-reversed"),
    pytest.param([[0, 2], [0, 2]], [[0, 2], [0, 2]], [FULL, 4], r"slice 1: unknown mask type {types}\[1\] = 4; valid types are 0 \(FULL\)", id="type-4"),
    pytest.param([[0, 2]], [[0, 2]], [-1], r"slice 0: unknown mask type {types}\[0\] = -1", id="type-negative"),
]


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_validate_value_errors(q_ranges, k_ranges, types, message):
    m = RangeMask(q_ranges, k_ranges, types)
    with pytest.raises(ValueError, match=message.format(types="mask_types")):
        m.validate(8, 6)


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_range_attention_and_ffa_raise_the_same(q_ranges, k_ranges, types, message):
    """Same slice and problem named by both; each names its own parameter (mask_types / attn_type_map)."""
    q = torch.randn(8, 2, 8)
    k = torch.randn(6, 1, 8)
    m = RangeMask(q_ranges, k_ranges, types)
    with pytest.raises(ValueError, match=message.format(types="mask_types")):
        range_attention(q, k, k, *m.tensors(), strict=True)
    with pytest.raises(ValueError, match=message.format(types="attn_type_map")):
        flex_flash_attn_func(q, k, k, m.q_ranges, m.k_ranges, m.mask_types, strict=True)
    with pytest.raises(ValueError, match=message.format(types="attn_type_map")):
        flex_flash_attn_func(q, k, k, m.q_ranges, m.k_ranges, m.mask_types.tolist(), strict=True)


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_strict_mode_from_the_environment(q_ranges, k_ranges, types, message, monkeypatch):
    q = torch.randn(8, 2, 8)
    k = torch.randn(6, 1, 8)
    m = RangeMask(q_ranges, k_ranges, types)
    default = range_attention(q, k, k, *m.tensors())
    monkeypatch.setenv("FLASHRANGE_STRICT", "1")
    with pytest.raises(ValueError, match=message.format(types="mask_types")):
        range_attention(q, k, k, *m.tensors())
    # An explicit argument wins over the environment: the default call's result.
    out, lse = range_attention(q, k, k, *m.tensors(), strict=False)
    assert torch.equal(out, default[0]) and torch.equal(lse, default[1])


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_default_calls_clamp_instead_of_reading_values(q_ranges, k_ranges, types, message):
    """Without strict mode no value is read on the host: bad slices are clamped or dropped (as the golden
    mask does), never a fault."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(6, 1, 8, generator=g, dtype=torch.float64)
    m = RangeMask(q_ranges, k_ranges, types)
    out, lse = range_attention(q, k, k, *m.tensors())
    gold_out, gold_lse = dense_attention(q, k, k, dense_counts(*m.tensors(), 8, 6))
    assert max_err(out, gold_out) < 1e-10 and max_err(lse, gold_lse) < 1e-10


def test_validate_strict_reports_overlap_with_a_cell():
    m = RangeMask([[0, 9], [0, 0], [4, 9]], [[0, 9], [0, 0], [2, 4]], [CAUSAL, FULL, FULL])
    assert m.validate(9, 9) is m  # overlaps are legal by default (they count twice)
    with pytest.raises(ValueError, match=r"slices 0 and 2 overlap: both cover cell \(query 4, key 2\).*count twice"):
        m.validate(9, 9, strict=True)


def test_validate_accepts_good_masks_and_padding():
    m = RangeMask.varlen([0, 3, 10], causal=True, window_size=(2, 0)).pad_to(8)
    assert m.validate(10, 10, strict=True) is m


def test_pad_to_below_count():
    m = RangeMask.block_causal(9, 2)
    with pytest.raises(ValueError, match=r"cannot pad 5 slices to a capacity of 3.*>= the slice count"):
        m.pad_to(3)


BUILDER_ERRORS = [
    pytest.param(lambda: RangeMask.full(-1), r"lengths must be >= 0, got Tq=-1", id="full-negative"),
    pytest.param(lambda: RangeMask.causal(3, -2), r"lengths must be >= 0, got Tq=3, Tk=-2", id="causal-negative"),
    pytest.param(lambda: RangeMask.varlen([1, 4]), r"cu_seqlens_q must start at 0", id="cu-not-zero"),
    pytest.param(lambda: RangeMask.varlen([0, 4, 3]), r"cu_seqlens_q must be non-decreasing", id="cu-decreasing"),
    pytest.param(lambda: RangeMask.varlen([]), r"cu_seqlens_q must hold at least one value", id="cu-empty"),
    pytest.param(lambda: RangeMask.varlen([0, 4], [0, 4, 6]), r"same number of documents, got 1 and 2", id="cu-mismatch"),
    pytest.param(lambda: RangeMask.varlen([0, 4], [0, 5, 3]), r"cu_seqlens_k must be non-decreasing", id="cu-k-decreasing"),
    pytest.param(lambda: RangeMask.varlen([0, 4], window_size=(-2, 0)), r"window_size sides must be >= 0, or -1", id="window-negative"),
    pytest.param(lambda: RangeMask.varlen([0, 4], window_size=3), r"window_size must be a pair \(left, right\)", id="window-not-pair"),
    pytest.param(lambda: RangeMask.sliding_window(9, 0), r"window must be >= 1", id="sliding-zero"),
    pytest.param(lambda: RangeMask.prefix_lm(5, 6), r"prefix_len must be in \[0, T=5\], got 6", id="prefix-too-long"),
    pytest.param(lambda: RangeMask.block_causal(9, 0), r"block_size must be >= 1, got 0", id="block-zero"),
    pytest.param(lambda: RangeMask.chunked_causal(9, -3), r"chunk_size must be >= 1, got -3", id="chunk-negative"),
    pytest.param(lambda: RangeMask.shared_question(-1, [2]), r"question_len must be >= 0", id="question-negative"),
    pytest.param(lambda: RangeMask.shared_question(3, [2, -1]), r"answer_lens must be >= 0", id="answer-negative"),
    pytest.param(lambda: RangeMask.block_sparse([(0, 3)], 4, 9, 12), r"block \(0, 3\) is outside the 3 x 3 grid", id="block-outside"),
    pytest.param(lambda: RangeMask.block_sparse([(0, 1, 2)], 4, 9), r"pairs of ints, got \(0, 1, 2\)", id="block-not-pair"),
    pytest.param(lambda: RangeMask.block_sparse([(0, 0)], 0, 9), r"block_size must be >= 1", id="block-sparse-zero"),
]


@pytest.mark.parametrize("build, message", BUILDER_ERRORS)
def test_builder_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_bucket_capacity_negative():
    from flashrange import bucket_capacity

    with pytest.raises(ValueError, match=r"slice count must be >= 0, got -1"):
        bucket_capacity(-1)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        RangeMask.causal(5).plot(tmp_path / "x.png")


def _bshd(B=2, S=5, H=2, D=8):
    return torch.randn(B, S, H, D)


FA_ERRORS = [
    pytest.param(lambda: flash_attn_func(torch.randn(10, 2, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)),
                 ValueError, r"q must be \(batch, seqlen, heads, head_dim\).*use flash_attn_varlen_func", id="fa-3d"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(B=3), _bshd(B=3)), ValueError, r"share the batch size, got 2, 3, 3", id="fa-batch"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(S=6)), ValueError, r"k and v must share the sequence length, got 5 and 6", id="fa-kv-len"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(), window_size=(-3, 0)), ValueError, r"window_size sides must be >= 0, or -1", id="fa-window"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(), window_size=None), ValueError, r"window_size must be a pair", id="fa-window-none"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(), softcap=-1.0), ValueError, r"softcap must be a finite number >= 0", id="fa-softcap"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(H=3), _bshd(H=3)), ValueError, r"multiple of the number of key/value heads", id="fa-heads"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(), qv=_bshd()), NotImplementedError, r"does not implement FA3's qv", id="fa-qv"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(), attention_chunk=4), NotImplementedError, r"attention_chunk.*RangeMask\.chunked_causal", id="fa-chunk"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(), dropout_p=0.1), NotImplementedError, r"dropout", id="fa-dropout"),
    pytest.param(lambda: flash_attn_func(_bshd(), _bshd(), _bshd(), windowsize=(1, 1)), TypeError, r"unexpected keyword arguments \['windowsize'\]", id="fa-typo"),
]


@pytest.mark.parametrize("call, exc, message", FA_ERRORS)
def test_flash_attn_func_errors(call, exc, message):
    with pytest.raises(exc, match=message):
        call()


def _packed(T=10, H=2, D=8):
    return torch.randn(T, H, D)


CU = _t([0, 4, 10])

VARLEN_ERRORS = [
    pytest.param(lambda: flash_attn_varlen_func(_packed(), _packed(), _packed(), [0, 4, 10], CU, 6, 6),
                 r"cu_seqlens_q must be a 1-D int32 tensor", id="cu-list"),
    pytest.param(lambda: flash_attn_varlen_func(_packed(), _packed(), _packed(), CU, CU.float(), 6, 6),
                 r"cu_seqlens_k must be int32, got torch\.float32", id="cu-float"),
    pytest.param(lambda: flash_attn_varlen_func(_packed(), _packed(), _packed(), CU, CU.to("meta"), 6, 6),
                 r"cu_seqlens_k is on meta but q is on cpu", id="cu-device"),
    pytest.param(lambda: flash_attn_varlen_func(_packed(), _packed(), _packed(), CU, _t([0, 10]), 6, 6),
                 r"same length \(B \+ 1\), got 3 and 2", id="cu-mismatch"),
    pytest.param(lambda: flash_attn_varlen_func(_packed(), _packed(), _packed(), CU, CU, 6, 6, seqused_q=_t([1, 2, 3])),
                 r"seqused_q must be a \(B,\) = \(2,\) int32 tensor", id="seqused-shape"),
    pytest.param(lambda: flash_attn_varlen_func(_packed(), _packed(), _packed(), _t([0, 4, 12]), CU, 6, 6, strict=True),
                 r"cu_seqlens_q\[-1\] = 12 is more than the 10 tokens", id="cu-past-end"),
    pytest.param(lambda: flash_attn_varlen_func(_packed(), _packed(), _packed(), CU, CU, 6, 6, window_size=(1, -5)),
                 r"window_size sides must be >= 0, or -1", id="varlen-window"),
    pytest.param(lambda: flash_attn_varlen_func(_packed(D=8), _packed(D=4), _packed(D=4), CU, CU, 6, 6),
                 r"q and k must share the head dim", id="varlen-head-dim"),
]


@pytest.mark.parametrize("call, message", VARLEN_ERRORS)
def test_flash_attn_varlen_func_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_flex_flash_attn_func_errors():
    q = torch.randn(6, 2, 8)
    qr = _t([[0, 6]])
    with pytest.raises(NotImplementedError, match=r"does not implement index_sparse_indices=.*default \(None\)"):
        flex_flash_attn_func(q, q, q, qr, qr, index_sparse_indices=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match=r"does not implement block_sparse=True"):
        flex_flash_attn_func(q, q, q, qr, qr, block_sparse=True)
    with pytest.raises(NotImplementedError, match=r"does not implement return_dtype=torch\.float32"):
        flex_flash_attn_func(q, q, q, qr, qr, return_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"attn_type_map must be an int32 tensor of shape \(S,\), a list of ints or None"):
        flex_flash_attn_func(q, q, q, qr, qr, 6, 6, "causal")
    with pytest.raises(ValueError, match=r"q_ranges must be an int32 tensor of shape \(S, 2\)"):
        flex_flash_attn_func(q, q, q, [[0, 6]], qr)
    with pytest.raises(ValueError, match=r"attn_type_map must be int32, got torch\.int64"):
        flex_flash_attn_func(q, q, q, qr, qr, torch.tensor([1]))


# ----------------------------------------------------------------------------- non-finite scalars


def _front_end_calls(**kw):
    """The same small problem through each front-end, with extra keyword arguments."""
    q4 = torch.randn(2, 5, 2, 8)
    q3 = q4.reshape(10, 2, 8)
    qr = _t([[0, 10]])
    return {
        "range_attention": lambda: range_attention(q3, q3, q3, qr, qr, _t([CAUSAL]), **kw),
        "flex_flash_attn_func": lambda: flex_flash_attn_func(q3, q3, q3, qr, qr, _t([CAUSAL]), **kw),
        "flash_attn_func": lambda: flash_attn_func(q4, q4, q4, causal=True, **kw),
        "flash_attn_varlen_func": lambda: flash_attn_varlen_func(q3, q3, q3, _t([0, 4, 10]), _t([0, 4, 10]), 6, 6,
                                                                 **kw),
    }


FRONT_ENDS = ["range_attention", "flex_flash_attn_func", "flash_attn_func", "flash_attn_varlen_func"]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(
    "kw, message",
    [
        pytest.param({"softmax_scale": float("nan")}, r"softmax_scale must be finite, got nan", id="scale-nan"),
        pytest.param({"softmax_scale": float("inf")}, r"softmax_scale must be finite, got inf", id="scale-inf"),
        pytest.param({"softmax_scale": float("-inf")}, r"softmax_scale must be finite, got -inf", id="scale-neginf"),
        pytest.param({"softmax_scale": torch.tensor(float("nan"))}, r"softmax_scale must be finite", id="scale-0d-nan"),
        pytest.param({"softcap": float("nan")}, r"softcap must be a finite number >= 0.*got nan", id="softcap-nan"),
        pytest.param({"softcap": float("inf")}, r"softcap must be a finite number >= 0.*got inf", id="softcap-inf"),
    ],
)
def test_non_finite_scalars_raise(front_end, kw, message):
    with pytest.raises(ValueError, match=message):
        _front_end_calls(**kw)[front_end]()


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_finite_scalars_are_accepted(front_end):
    out = _front_end_calls(softmax_scale=0.3, softcap=2.0)[front_end]()
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out).all()


# ----------------------------------------------------------------------------- flex_flash_attn_func arguments


def _ffa_problem():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(11, 4, 8, generator=g)
    k = torch.randn(9, 2, 8, generator=g)
    qr = _t([[0, 6], [6, 11], [0, 0], [3, 9]])
    kr = _t([[0, 6], [2, 9], [0, 0], [0, 4]])
    return q, k, qr, kr, [CAUSAL, 3, FULL, 2]


@pytest.mark.parametrize("as_", [pytest.param(list, id="list"), pytest.param(tuple, id="tuple")])
def test_ffa_attn_type_map_as_a_python_sequence(as_):
    q, k, qr, kr, types = _ffa_problem()
    want = flex_flash_attn_func(q, k, k, qr, kr, _t(types))
    for got in (flex_flash_attn_func(q, k, k, qr, kr, as_(types)),
                flex_flash_attn_func(q, k, k, qr, kr, attn_type_map=as_(types), strict=True)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # ... and it is not all FULL (the default): the types were read.
    full = flex_flash_attn_func(q, k, k, qr, kr)
    assert not torch.equal(full[0], want[0])


def test_ffa_unknown_keyword_raises_naming_it():
    q, k, qr, kr, types = _ffa_problem()
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['attn_typemap', 'causal'\]"):
        flex_flash_attn_func(q, k, k, qr, kr, attn_typemap=types, causal=True)


def test_ffa_tuning_flags_are_accepted_and_ignored():
    from flashrange.compat import FFA_IGNORED_FLAGS

    q, k, qr, kr, types = _ffa_problem()
    want = flex_flash_attn_func(q, k, k, qr, kr, types)
    values = {"sm_margin": 4, "swap_ab": True, "ref_block_size": (64, 64), "profile_mode": True,
              "disable_fwd_atomic_reduction": True, "auto_range_merge": True}
    assert set(values) <= set(FFA_IGNORED_FLAGS)
    got = flex_flash_attn_func(q, k, k, qr, kr, types, deterministic=True, **values)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for flag in FFA_IGNORED_FLAGS:
        flex_flash_attn_func(q, k, k, qr, kr, types, **{flag: None})


@pytest.mark.parametrize(
    "types, exc, message",
    [
        pytest.param(lambda t: t.long(), ValueError, r"attn_type_map must be int32, got torch\.int64", id="int64"),
        pytest.param(lambda t: t[:3], ValueError,
                     r"q_ranges, k_ranges and attn_type_map must describe the same number of slices, got 4, 4, 3",
                     id="length"),
        pytest.param(lambda t: t.to("meta"), ValueError, r"attn_type_map is on meta but q is on cpu", id="device"),
        pytest.param(lambda t: t.view(2, 2), ValueError, r"attn_type_map must have shape \(S,\)", id="2d"),
        pytest.param(lambda t: [0, "causal", 1, 2], ValueError, r"attn_type_map must be a list of ints", id="list-str"),
        pytest.param(lambda t: {0: 1}, TypeError, r"attn_type_map must be an int32 tensor of shape \(S,\), a list",
                     id="dict"),
        pytest.param(lambda t: [0, 7, 1, 2], ValueError, r"slice 1: unknown mask type attn_type_map\[1\] = 7",
                     id="strict-value"),
    ],
)
def test_ffa_errors_name_attn_type_map(types, exc, message):
    q, k, qr, kr, good = _ffa_problem()
    with pytest.raises(exc, match=message):
        flex_flash_attn_func(q, k, k, qr, kr, types(_t(good)), strict=True)


# ----------------------------------------------------------------------------- cu_seqlens in strict mode


@pytest.mark.parametrize(
    "cu_q, cu_k, message",
    [
        pytest.param([1, 4, 10], [0, 4, 10], r"cu_seqlens_q must start at 0, got \[1, 4, 10\]", id="q-start"),
        pytest.param([0, 4, 10], [0, 6, 3], r"cu_seqlens_k must be non-decreasing.*cu_seqlens_k\[2\] = 3 < "
                     r"cu_seqlens_k\[1\] = 6", id="k-decreasing"),
        pytest.param([0, 4, 12], [0, 4, 10], r"cu_seqlens_q\[-1\] = 12 is more than the 10 tokens", id="q-past-end"),
        pytest.param([0, 4, 10], [0, 4, 11], r"cu_seqlens_k\[-1\] = 11 is more than the 10 tokens", id="k-past-end"),
        pytest.param([0, -2, 10], [0, 4, 10], r"cu_seqlens_q must be non-decreasing", id="q-negative"),
    ],
)
def test_varlen_cu_seqlens_checked_in_strict_mode(cu_q, cu_k, message, monkeypatch):
    q = _packed()
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(q, q, q, _t(cu_q), _t(cu_k), 6, 6, strict=True)
    monkeypatch.setenv("FLASHRANGE_STRICT", "1")
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(q, q, q, _t(cu_q), _t(cu_k), 6, 6)
    monkeypatch.delenv("FLASHRANGE_STRICT")
    # By default nothing is read on the host: the ranges built from them are clamped, never a fault.
    out = flash_attn_varlen_func(q, q, q, _t(cu_q), _t(cu_k), 6, 6)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_varlen_seqused_checked_in_strict_mode():
    q = _packed()
    with pytest.raises(ValueError, match=r"seqused_k must be >= 0, got a minimum of -1"):
        flash_attn_varlen_func(q, q, q, CU, CU, 6, 6, seqused_k=_t([3, -1]), strict=True)


# ----------------------------------------------------------------------------- head-dim limits on the GPU


def _fake_cuda(*shape, dtype=torch.bfloat16):
    """A CUDA tensor without a GPU: fake tensors carry a device and a shape, no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(*shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize(
    "D, Dv, message",
    [
        pytest.param(320, 320, r"got D=320, Dv=320", id="D320"),
        pytest.param(128, 384, r"got D=128, Dv=384", id="D128-Dv384"),
        pytest.param(64, 640, r"got D=64, Dv=640", id="D64-Dv640"),
        pytest.param(512, 64, r"got D=512, Dv=64", id="D512"),
    ],
)
def test_head_dim_limit_on_cuda_is_checked_up_front(D, Dv, message):
    """Before any kernel is built: a clear ValueError naming both head dims and the limit."""
    from flashrange.constants import MAX_HEAD_DIM
    from flashrange.validation import check_qkv

    q, k, v = _fake_cuda(7, 2, D), _fake_cuda(7, 1, D), _fake_cuda(7, 1, Dv)
    assert q.device.type == "cuda"
    full = rf"head dims from 1 to {MAX_HEAD_DIM} are supported on the GPU \(q/k: D, v: Dv\), {message}; " \
           r"larger head dims run only on the CPU reference"
    with pytest.raises(ValueError, match=full):
        check_qkv(q, k, v)
    qr = _fake_cuda(1, 2, dtype=I32)
    with pytest.raises(ValueError, match=full):
        range_attention(q, k, v, qr, qr, _fake_cuda(1, dtype=I32))


def test_head_dim_limit_boundaries():
    from flashrange.constants import MAX_HEAD_DIM
    from flashrange.validation import check_qkv

    check_qkv(_fake_cuda(3, 2, MAX_HEAD_DIM), _fake_cuda(3, 2, MAX_HEAD_DIM), _fake_cuda(3, 2, MAX_HEAD_DIM))
    check_qkv(_fake_cuda(3, 2, 64), _fake_cuda(3, 2, 64), _fake_cuda(3, 2, 512))  # FA3's wide values
    # float64 runs the reference on any device, any head dim; so does the CPU.
    big = [_fake_cuda(3, 2, 320, dtype=torch.float64) for _ in range(3)]
    check_qkv(*big)
    check_qkv(torch.empty(3, 2, 320), torch.empty(3, 2, 320), torch.empty(3, 2, 320))


@pytest.mark.gpu
def test_head_dim_limit_on_a_real_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q = torch.randn(9, 2, 320, device="cuda", dtype=torch.bfloat16)
    qr = torch.tensor([[0, 9]], dtype=I32, device="cuda")
    mt = torch.tensor([CAUSAL], dtype=I32, device="cuda")
    with pytest.raises(ValueError, match=r"head dims from 1 to 256 are supported on the GPU.*got D=320, Dv=320"):
        range_attention(q, q, q, qr, qr, mt)
    with pytest.raises(ValueError, match=r"head dims from 1 to 256 .*got D=320"):
        flash_attn_func(q.view(1, 9, 2, 320), q.view(1, 9, 2, 320), q.view(1, 9, 2, 320), causal=True)


def _small_call():
    q = torch.randn(37, 2, 16)
    k = torch.randn(41, 1, 16)
    v = torch.randn(41, 1, 16)
    qr, kr, mt = _t([[0, 37]]), _t([[0, 41]]), _t([CAUSAL])
    return q, k, v, qr, kr, mt


def _bad_plans(plan):
    import flashrange

    yield "not-a-plan", "hello", TypeError, "plan must be a flashrange.RangePlan"
    yield "seven-tensors", tuple(plan)[:7], TypeError, "plan must be a flashrange.RangePlan"
    yield "element-not-tensor", (None,) + tuple(plan)[1:], TypeError, "plan.q_slices must be a torch.Tensor"
    yield "int64-order", tuple(plan)[:3] + (plan[3].long(),) + tuple(plan)[4:], ValueError, "plan.q_block_order"
    yield "other-Tq", flashrange.plan_mask(*_small_call()[3:], 37 + 128, 41), ValueError, "plan.q_block_lo"
    yield "other-S", flashrange.plan_mask(_t([[0, 37], [1, 1]]), _t([[0, 41], [2, 2]]), _t([0, 0]), 37, 41), \
        ValueError, "plan.q_slices"


def test_plan_that_does_not_fit_the_call_is_rejected():
    import flashrange

    q, k, v, qr, kr, mt = _small_call()
    plan = flashrange.plan_mask(qr, kr, mt, 37, 41)
    range_attention(q, k, v, qr, kr, mt, plan=plan)  # fits
    range_attention(q, k, v, qr, kr, mt, plan=list(plan))  # a plain sequence of the eight tensors fits too
    for name, bad, exc, message in _bad_plans(plan):
        with pytest.raises(exc, match=message):
            range_attention(q, k, v, qr, kr, mt, plan=bad)


@pytest.mark.parametrize("change", ["q-offset", "k-offset", "v-row-stride", "k-dtype", "plan-offset", "scale",
                                    "softcap", "max-logits", "heads"])
def test_launch_signature_sees_what_changes_the_launch(change):
    """The forward's recorded launches are keyed by everything that changes the kernel or its arguments."""
    from flashrange.kernels.forward import _signature
    import flashrange

    q, k, v, qr, kr, mt = _small_call()
    plan = flashrange.plan_mask(qr, kr, mt, 37, 41)
    args = [q, k, v, plan, None, 0.0, None, False]
    base = _signature(*args)
    assert _signature(*args) == base
    if change == "q-offset":
        args[0] = torch.randn(q.numel() + 1)[1:].view_as(q)
    elif change == "k-offset":
        args[1] = torch.randn(k.numel() + 2)[2:].view_as(k)
    elif change == "v-row-stride":
        args[2] = torch.randn(41, 1, 24)[:, :, :16]
    elif change == "k-dtype":
        args[1] = k.double()
    elif change == "plan-offset":
        buf = torch.zeros(plan.q_block_lo.numel() + 1, dtype=I32)
        args[3] = plan._replace(q_block_lo=buf[1:])
    elif change == "scale":
        args[4] = 0.5
    elif change == "softcap":
        args[5] = 3.0
    elif change == "max-logits":
        args[7] = True
    elif change == "heads":
        args[0] = torch.randn(37, 1, 16)
    assert _signature(*args) != base


def _qkv_variants():
    f32 = torch.float32
    yield "ok", torch.randn(5, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 3)
    yield "ok-mqa", torch.randn(5, 4, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    yield "q-2d", torch.randn(5, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    yield "v-4d", torch.randn(5, 4, 8), torch.randn(6, 2, 8), torch.randn(1, 6, 2, 8)
    yield "int-q", torch.ones(5, 4, 8, dtype=torch.int32), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    yield "dtypes", torch.randn(5, 4, 8, dtype=torch.float64), torch.randn(6, 2, 8, dtype=f32), torch.randn(6, 2, 8)
    yield "head-dim", torch.randn(5, 4, 8), torch.randn(6, 2, 9), torch.randn(6, 2, 8)
    yield "kv-len", torch.randn(5, 4, 8), torch.randn(6, 2, 8), torch.randn(7, 2, 8)
    yield "kv-heads", torch.randn(5, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 1, 8)
    yield "gqa-ratio", torch.randn(5, 3, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    yield "zero-kv-heads", torch.randn(5, 3, 8), torch.randn(6, 0, 8), torch.randn(6, 0, 8)
    yield "not-tensor", [[1.0]], torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    yield "numpy", torch.randn(5, 4, 8).numpy(), torch.randn(6, 2, 8), torch.randn(6, 2, 8)


def _ranges_variants():
    i32 = torch.int32
    good = torch.zeros(3, 2, dtype=i32), torch.zeros(3, 2, dtype=i32), torch.zeros(3, dtype=i32)
    yield "ok", good
    yield "empty", (torch.zeros(0, 2, dtype=i32), torch.zeros(0, 2, dtype=i32), torch.zeros(0, dtype=i32))
    yield "q-int64", (good[0].long(), good[1], good[2])
    yield "types-int64", (good[0], good[1], good[2].long())
    yield "k-shape", (good[0], torch.zeros(3, 3, dtype=i32), good[2])
    yield "types-2d", (good[0], good[1], good[2].view(3, 1))
    yield "count", (good[0], torch.zeros(4, 2, dtype=i32), good[2])
    yield "q-flat", (good[0].view(-1), good[1], good[2])
    yield "list", ([[0, 1]], good[1], good[2])
    yield "meta-device", (good[0].to("meta"), good[1], good[2])


def _outcome(fn, *args):
    try:
        fn(*args)
    except (TypeError, ValueError) as e:
        return type(e)
    return None


@pytest.mark.parametrize("case", [c[0] for c in _qkv_variants()])
def test_fast_qkv_check_agrees_with_the_detailed_checks(case, monkeypatch):
    """The one-expression check never accepts what the detailed checks reject (and vice versa)."""
    from flashrange import validation

    q, k, v = next(c[1:] for c in _qkv_variants() if c[0] == case)
    fast = _outcome(validation.check_qkv, q, k, v)
    monkeypatch.setattr(validation, "_qkv_ok", lambda *a: False)
    detailed = _outcome(validation.check_qkv, q, k, v)
    assert fast == detailed
    assert (detailed is None) == case.startswith("ok")


@pytest.mark.parametrize("case", [c[0] for c in _ranges_variants()])
def test_fast_ranges_check_agrees_with_the_detailed_checks(case, monkeypatch):
    from flashrange import validation

    ranges = next(c[1] for c in _ranges_variants() if c[0] == case)
    fast = _outcome(validation.check_ranges, *ranges, torch.device("cpu"))
    monkeypatch.setattr(validation, "_ranges_ok", lambda *a: False)
    detailed = _outcome(validation.check_ranges, *ranges, torch.device("cpu"))
    assert fast == detailed
    assert (detailed is None) == (case in ("ok", "empty"))
