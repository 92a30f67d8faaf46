"""Drop-in front-ends with the argument names and return shapes of other libraries.

- :func:`flex_flash_attn_func`: MagiAttention's FFA interface (ranges + types).
- :func:`flash_attn_func`, :func:`flash_attn_varlen_func`: FlashAttention-3's
  padded ``(B, S, H, D)`` and packed varlen interfaces, causal and windows
  aligned to the bottom-right corner as in FA3.

All run through :func:`flashrange.interface.attention`, the entry below
every front-end (static checks always; value checks in strict mode; an
optional ``plan=``). The FA3 front-ends
build their slices **on the device** from ``cu_seqlens`` with elementwise
ops: no ``.item()``, no host copy, slice counts that depend only on the batch
size and the (static) window, so they trace under
``torch.compile(fullgraph=True)`` and run under CUDA-graph capture.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .interface import attention
from .validation import check_cu_seqlens_values, check_window, strict_enabled, values_readable
from .window import window_slices

__all__ = ["flex_flash_attn_func", "flash_attn_func", "flash_attn_varlen_func", "FFA_IGNORED_FLAGS", "AttnForwardMeta"]

# MagiAttention's flags that only tune speed or memory, accepted by name and ignored.
FFA_IGNORED_FLAGS = (
    "sm_margin",
    "disable_fwd_atomic_reduction",
    "disable_bwd_dkv_atomic_reduction",
    "disable_bwd_dq_atomic_reduction",
    "auto_range_merge",
    "range_merge",
    "ref_block_size",
    "max_outer_range_width",
    "swap_ab",
    "pack_gqa",
    "cat_gqa",
    "swap_bwd_qk_loop",
    "bwd_inner_loop_k",
    "profile_mode",
)
# MagiAttention's flags that change the result and are not implemented: they raise unless left at the default.
_FFA_UNSUPPORTED = {
    "index_sparse_indices": None,
    "block_sparse": False,
    "index_sparse": False,
    "return_dtype": None,
    "q_block_size": 1,
    "sparse_k_block_size": 1,
}
_FFA_NAMES = ("q_ranges", "k_ranges", "attn_type_map")
# MagiAttention's sink layouts: "sh" is (S_sink, Hq); "ssh" (per-query sinks) and "shd" are not implemented here.
_SINK_LAYOUTS = ("sh", "ssh", "shd")

# FA3 arguments that change the result and that flashrange does not implement.
_FA3_UNSUPPORTED = ("qv", "q_descale", "k_descale", "v_descale", "alibi_slopes")


class AttnForwardMeta(NamedTuple):
    """What :func:`flex_flash_attn_func` returns next to ``out`` with ``return_max_logits=True``.

    Read as MagiAttention's ``AttnForwardMeta``: ``meta.lse`` `(Tq, Hq)` float32
    and ``meta.max_logits`` `(Hq,)` float32. A named tuple, so that compiled
    code returns it without a graph break.
    """

    lse: torch.Tensor
    max_logits: torch.Tensor | None
# FA3 arguments that only tune speed or are already the behaviour here.
_FA3_TUNING = ("num_splits", "pack_gqa", "sm_margin", "scheduler_metadata", "cp_world_size", "cp_rank", "cp_tot_seqused_k")


def flex_flash_attn_func(
    q,
    k,
    v,
    q_ranges,
    k_ranges,
    attn_type_map=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    softcap=0.0,
    deterministic=False,
    *,
    sink=None,
    sink_layout="sh",
    return_max_logits=False,
    plan=None,
    strict=None,
    **magi_flags,
):
    """MagiAttention-style ``flex_flash_attn_func``: attention over ranges, returns ``(out, lse)``.

    Args:
        q: `(Tq, Hq, D)`; k: `(Tk, Hkv, D)`; v: `(Tk, Hkv, Dv)`.
        q_ranges, k_ranges: `(S, 2)` int32 on q's device.
        attn_type_map: `(S,)` int32 types (0 FULL, 1 CAUSAL, 2 INV_CAUSAL,
            3 BI_CAUSAL), or a list / tuple of them; ``None`` means all FULL.
        max_seqlen_q, max_seqlen_k: accepted and unused. The older positional
            order ``(..., k_ranges, max_seqlen_q, max_seqlen_k, attn_type_map)``
            is recognised when an int sits in ``attn_type_map``'s place.
        softmax_scale: defaults to `1 / sqrt(D)`; softcap: `0` disables.
        deterministic: accepted; flashrange is always deterministic.
        sink: optional `(S_sink, Hq)` learnable sink logits, as in
            :func:`flashrange.range_attention` (``lse`` includes them).
        sink_layout: ``"sh"`` (the default, `(S_sink, Hq)`); MagiAttention's
            ``"ssh"`` (per-query sinks) raises ``NotImplementedError``.
        return_max_logits: also return each head's largest score
            (MagiAttention's QK-clip statistic), see Returns.
        plan, strict: as in :func:`flashrange.range_attention`.
        magi_flags: MagiAttention's speed knobs (:data:`FFA_IGNORED_FLAGS`)
            are accepted and ignored; ``index_sparse_indices``,
            ``block_sparse``, ``index_sparse`` and ``return_dtype`` change the
            result, are not supported and raise ``NotImplementedError`` unless
            left at their defaults; any other keyword raises ``TypeError``.

    Returns:
        ``out`` `(Tq, Hq, Dv)` in q's dtype and ``lse`` `(Tq, Hq)` float32; with
        ``return_max_logits=True``, ``(out, meta)`` as MagiAttention returns
        them: ``meta`` an :class:`AttnForwardMeta` with ``meta.lse`` and
        ``meta.max_logits`` `(Hq,)` float32 (`-inf` for a head with no covered cell).
    """
    unknown = sorted(set(magi_flags) - set(FFA_IGNORED_FLAGS) - set(_FFA_UNSUPPORTED))
    if unknown:
        raise TypeError(
            f"flex_flash_attn_func got unexpected keyword arguments {unknown}; accepted and ignored: "
            f"{', '.join(FFA_IGNORED_FLAGS)}"
        )
    for name, default in _FFA_UNSUPPORTED.items():
        if name in magi_flags and magi_flags[name] is not default and magi_flags[name] != default:
            raise NotImplementedError(
                f"flashrange's flex_flash_attn_func does not implement {name}={magi_flags[name]!r}; "
                f"leave it at its default ({default!r})"
            )
    if isinstance(attn_type_map, int) and not isinstance(attn_type_map, bool):
        # Older MagiAttention order: (..., max_seqlen_q, max_seqlen_k, attn_type_map).
        attn_type_map, max_seqlen_q, max_seqlen_k = max_seqlen_k, attn_type_map, max_seqlen_q
    if isinstance(attn_type_map, (list, tuple)):
        device = q_ranges.device if isinstance(q_ranges, torch.Tensor) else None
        try:
            attn_type_map = torch.tensor(attn_type_map, dtype=torch.int32, device=device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"attn_type_map must be a list of ints (mask types), got {attn_type_map!r}") from e
    elif attn_type_map is None:
        if not isinstance(q_ranges, torch.Tensor) or q_ranges.dim() != 2:
            raise ValueError("q_ranges must be an int32 tensor of shape (S, 2)")
        attn_type_map = torch.zeros(q_ranges.shape[0], dtype=torch.int32, device=q_ranges.device)
    elif not isinstance(attn_type_map, torch.Tensor):
        raise TypeError(
            f"attn_type_map must be an int32 tensor of shape (S,), a list of ints or None, got "
            f"{type(attn_type_map).__name__}"
        )
    if sink_layout not in _SINK_LAYOUTS:
        raise ValueError(f"sink_layout must be one of {', '.join(map(repr, _SINK_LAYOUTS))}, got {sink_layout!r}")
    if sink_layout != "sh" and sink is not None:
        raise NotImplementedError(
            f"flashrange implements sink_layout='sh' only (sink of shape (S_sink, Hq)), got {sink_layout!r}"
        )
    result = attention(
        q, k, v, q_ranges, k_ranges, attn_type_map,
        softmax_scale=softmax_scale, softcap=softcap, plan=plan, strict=strict, sink=sink,
        return_max_logits=bool(return_max_logits), names=_FFA_NAMES,
    )
    if not return_max_logits:
        return result
    out, lse, max_logits = result
    return out, AttnForwardMeta(lse, max_logits)


def _fa_sink(learnable_sink, sink, Hq):
    """``(sink (S_sink, Hq) or None, its parameter name)`` from FA4's ``learnable_sink`` or MagiAttention's ``sink``."""
    if learnable_sink is None:
        return sink, "sink"
    if sink is not None:
        raise ValueError(
            "pass learnable_sink (FlashAttention-4: one logit per query head, (Hq,)) or sink (MagiAttention: "
            "(S_sink, Hq)), not both"
        )
    if not isinstance(learnable_sink, torch.Tensor) or learnable_sink.dim() != 1 or learnable_sink.shape[0] != Hq:
        is_tensor = isinstance(learnable_sink, torch.Tensor)
        shape = tuple(learnable_sink.shape) if is_tensor else type(learnable_sink).__name__
        raise ValueError(f"learnable_sink must have shape (Hq,) = ({Hq},) as in FlashAttention-4, got {shape}")
    return learnable_sink.view(1, Hq), "learnable_sink"


def _fa3_window(causal, window_size, extra):
    """``(left, right)`` as FA3 applies them (causal = right side 0); reject unsupported extras."""
    for name in _FA3_UNSUPPORTED:
        if extra.get(name) is not None:
            raise NotImplementedError(f"flashrange does not implement FA3's {name}=...; pass {name}=None")
    if extra.get("attention_chunk", 0):
        raise NotImplementedError(
            "flashrange's FA3 front-end does not implement attention_chunk; build the mask with "
            "RangeMask.chunked_causal / window_slices and call range_attention"
        )
    if extra.get("dropout_p", 0.0):
        raise NotImplementedError("flashrange does not implement attention dropout; pass dropout_p=0")
    unknown = set(extra) - set(_FA3_UNSUPPORTED) - set(_FA3_TUNING) - {"attention_chunk", "dropout_p"}
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    left, right = check_window(window_size)
    if causal:
        right = 0
    return left, right


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    sink=None,
    strict=None,
    **fa3_flags,
):
    """FlashAttention-3-style attention on padded batches.

    Args:
        q: `(B, Sq, Hq, D)`; k: `(B, Sk, Hkv, D)`; v: `(B, Sk, Hkv, Dv)`;
            ``Sq`` may differ from ``Sk``.
        causal: query ``i`` attends key ``j <= i + Sk - Sq`` (bottom-right).
        window_size: ``(left, right)``: query ``i`` attends keys
            ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``-1`` is
            unbounded; ``causal`` forces ``right = 0``.
        softmax_scale: defaults to `1 / sqrt(D)`; softcap: `0` disables.
        deterministic: accepted; flashrange is always deterministic.
        return_attn_probs: as in FA3, returns the log-sum-exp, not probabilities.
        learnable_sink: optional `(Hq,)` sink logits, as FlashAttention-4 names
            them; or ``sink``: `(S_sink, Hq)`, as MagiAttention's FA3 front-end
            does. Extra logits in every row's softmax denominator that carry no
            value (:func:`flashrange.range_attention`); the lse includes them.
        fa3_flags: FA3's speed knobs (``num_splits``, ``pack_gqa``,
            ``sm_margin``) are ignored; ``qv``, descales, ``attention_chunk``
            and dropout raise ``NotImplementedError``.

    Rows that see no key (top rows of a causal mask with ``Sq > Sk``) get
    ``out = 0`` and ``lse = -inf`` (with sinks, the log-sum-exp of the sinks).

    Returns:
        ``out`` `(B, Sq, Hq, Dv)`, or ``(out, lse)`` with ``lse`` `(B, Hq, Sq)`
        float32 when ``return_attn_probs``.
    """
    left, right = _fa3_window(causal, window_size, fa3_flags)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be (batch, seqlen, heads, head_dim), got {shape}; "
                "for packed (total, heads, head_dim) inputs use flash_attn_varlen_func"
            )
    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"q, k, v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if v.shape[1] != Sk:
        raise ValueError(f"k and v must share the sequence length, got {k.shape[1]} and {v.shape[1]}")
    b = torch.arange(B, device=q.device, dtype=torch.int64)
    q_ranges, k_ranges, mask_types = window_slices(b * Sq, (b + 1) * Sq, b * Sk, (b + 1) * Sk, left, right)
    sink, sink_name = _fa_sink(learnable_sink, sink, Hq)
    out, lse = attention(
        q.reshape(B * Sq, Hq, q.shape[3]),
        k.reshape(B * Sk, k.shape[2], k.shape[3]),
        v.reshape(B * Sk, v.shape[2], v.shape[3]),
        q_ranges, k_ranges, mask_types,
        softmax_scale=softmax_scale, softcap=softcap, strict=strict, sink=sink, sink_name=sink_name,
    )
    out = out.view(B, Sq, Hq, v.shape[3])
    if not return_attn_probs:
        return out
    return out, lse.view(B, Sq, Hq).transpose(1, 2).contiguous()


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    sink=None,
    plan=None,
    strict=None,
    **fa3_flags,
):
    """FlashAttention-3-style attention on packed variable-length sequences.

    Args:
        q: `(total_q, Hq, D)`; k: `(total_k, Hkv, D)`; v: `(total_k, Hkv, Dv)`.
        cu_seqlens_q, cu_seqlens_k: `(B + 1,)` int32 cumulative lengths on
            q's device (sequence ``b`` is ``[cu[b], cu[b + 1])``).
        max_seqlen_q, max_seqlen_k: accepted for compatibility; unused (the
            mask needs at most 3 slices per sequence whatever the lengths).
        seqused_q, seqused_k: optional `(B,)` int32: only the first
            ``seqused[b]`` tokens of sequence ``b`` take part. Query rows beyond
            get ``out = 0``, ``lse = -inf`` and zero gradients (FA3 leaves them
            undefined); keys beyond are not attended.
        causal, window_size: as in FA3, per sequence, aligned bottom-right
            (``off = Lk - Lq`` with the used lengths).
        softmax_scale, softcap, deterministic, return_attn_probs, learnable_sink, sink, fa3_flags:
            as in :func:`flash_attn_func`.
        plan: a plan of this call's slices (:func:`flashrange.plan_mask` over
            ``flashrange.window.window_slices`` of the same documents), reused
            across layers; planned in the call when ``None``.
        strict: as in :func:`flashrange.range_attention`; here it also checks
            ``cu_seqlens_q`` / ``cu_seqlens_k`` (start at 0, non-decreasing,
            last value within the packed tensor) and ``seqused_*`` (>= 0).

    Returns:
        ``out`` `(total_q, Hq, Dv)`, or ``(out, lse)`` with ``lse``
        `(Hq, total_q)` float32 when ``return_attn_probs``.
    """
    left, right = _fa3_window(causal, window_size, fa3_flags)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor of B + 1 cumulative lengths, got {t!r}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with {name}.to(q.device)")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    if strict_enabled(strict) and values_readable(cu_seqlens_q):
        check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
        check_cu_seqlens_values(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
        for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if isinstance(used, torch.Tensor) and used.numel() and int(used.min()) < 0:
                raise ValueError(f"{name} must be >= 0, got a minimum of {int(used.min())}")
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    qs, qe, ks, ke = cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]
    for name, used, start, end in (("seqused_q", seqused_q, qs, "qe"), ("seqused_k", seqused_k, ks, "ke")):
        if used is None:
            continue
        if not isinstance(used, torch.Tensor) or used.dim() != 1 or used.shape[0] != qs.shape[0]:
            raise ValueError(f"{name} must be a (B,) = ({qs.shape[0]},) int32 tensor, got {used!r}")
        if used.device != q.device:
            raise ValueError(f"{name} is on {used.device} but q is on {q.device}; move it with {name}.to(q.device)")
    if seqused_q is not None:
        qe = torch.minimum(qe, qs + seqused_q.long().clamp(min=0))
    if seqused_k is not None:
        ke = torch.minimum(ke, ks + seqused_k.long().clamp(min=0))
    q_ranges, k_ranges, mask_types = window_slices(qs, qe, ks, ke, left, right)
    # The slices are built from cu_seqlens (checked above in strict mode), so their
    # values are not checked again: a message about slices would name nothing the
    # caller wrote.
    sink, sink_name = _fa_sink(learnable_sink, sink, q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 3 else 0)
    out, lse = attention(
        q, k, v, q_ranges, k_ranges, mask_types,
        softmax_scale=softmax_scale, softcap=softcap, plan=plan, strict=False, sink=sink, sink_name=sink_name,
    )
    if not return_attn_probs:
        return out
    return out, lse.transpose(0, 1).contiguous()
