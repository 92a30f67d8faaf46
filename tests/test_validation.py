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


VALUE_ERRORS = [
    pytest.param([[0, 5], [2, 9]], [[0, 5], [0, 5]], [FULL, FULL], r"slice 1: q_ranges\[1\] = \[2, 9\) lies outside \[0, Tq=8\]", id="q-past-end"),
    pytest.param([[0, 5]], [[-1, 5]], [FULL], r"slice 0: k_ranges\[0\] = \[-1, 5\) lies outside \[0, Tk=6\]", id="k-negative"),
    pytest.param([[0, 5]], [[0, 7]], [CAUSAL], r"slice 0: k_ranges\[0\] = \[0, 7\) lies outside \[0, Tk=6\]", id="k-past-end"),
    pytest.param([[0, 0], [4, 2]], [[0, 0], [0, 3]], [FULL, FULL], r"slice 1: start after end.*use \[0, 0\) for a padding slice", id="q-reversed"),
    pytest.param([[0, 2]], [[5, 3]], [FULL], r"slice 0: start after end", id="k-reversed"),
    pytest.param([[0, 2], [0, 2]], [[0, 2], [0, 2]], [FULL, 4], r"slice 1: unknown mask type (mask_types|attn_type_map)\[1\] = 4; valid types are 0 \(FULL\)", id="type-4"),
    pytest.param([[0, 2]], [[0, 2]], [-1], r"slice 0: unknown mask type (mask_types|attn_type_map)\[0\] = -1", id="type-negative"),
]


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_validate_value_errors(q_ranges, k_ranges, types, message):
    m = RangeMask(q_ranges, k_ranges, types)
    with pytest.raises(ValueError, match=message):
        m.validate(8, 6)


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_range_attention_and_ffa_raise_the_same(q_ranges, k_ranges, types, message):
    q = torch.randn(8, 2, 8)
    k = torch.randn(6, 1, 8)
    m = RangeMask(q_ranges, k_ranges, types)
    with pytest.raises(ValueError, match=message):
        range_attention(q, k, k, *m.tensors(), strict=True)
    with pytest.raises(ValueError, match=message):
        flex_flash_attn_func(q, k, k, m.q_ranges, m.k_ranges, m.mask_types, strict=True)


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_strict_mode_from_the_environment(q_ranges, k_ranges, types, message, monkeypatch):
    q = torch.randn(8, 2, 8)
    k = torch.randn(6, 1, 8)
    m = RangeMask(q_ranges, k_ranges, types)
    monkeypatch.setenv("FLASHRANGE_STRICT", "1")
    with pytest.raises(ValueError, match=message):
        range_attention(q, k, k, *m.tensors())
    # An explicit argument wins over the environment.
    out, lse = range_attention(q, k, k, *m.tensors(), strict=False)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("q_ranges, k_ranges, types, message", VALUE_ERRORS)
def test_default_calls_clamp_instead_of_reading_values(q_ranges, k_ranges, types, message):
    """Without strict mode no value is read on the host: bad slices are clamped or dropped, never a fault."""
    q = torch.randn(8, 2, 8)
    k = torch.randn(6, 1, 8)
    m = RangeMask(q_ranges, k_ranges, types)
    out, lse = range_attention(q, k, k, *m.tensors())
    assert out.shape == (8, 2, 8) and torch.isfinite(out).all()


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
    with pytest.raises(NotImplementedError, match=r"does not implement sink=.*default \(None\)"):
        flex_flash_attn_func(q, q, q, qr, qr, sink=torch.zeros(1, 2))
    with pytest.raises(NotImplementedError, match=r"does not implement index_sparse_indices="):
        flex_flash_attn_func(q, q, q, qr, qr, index_sparse_indices=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match=r"return_max_logits=True"):
        flex_flash_attn_func(q, q, q, qr, qr, return_max_logits=True)
    with pytest.raises(TypeError, match=r"attn_type_map must be an int32 tensor of shape \(S,\), a list of ints or None"):
        flex_flash_attn_func(q, q, q, qr, qr, 6, 6, "causal")
    with pytest.raises(ValueError, match=r"q_ranges must be an int32 tensor of shape \(S, 2\)"):
        flex_flash_attn_func(q, q, q, [[0, 6]], qr)
    with pytest.raises(ValueError, match=r"attn_type_map must be int32, got torch\.int64"):
        flex_flash_attn_func(q, q, q, qr, qr, torch.tensor([1]))
