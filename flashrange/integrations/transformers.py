"""Hugging Face ``transformers`` backend: ``attn_implementation="flashrange"``.

::

    import flashrange.integrations.transformers  # registers "flashrange"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flashrange")
    # or, on a loaded model: model.set_attn_implementation("flashrange")

Importing this module calls :func:`register`, which adds two entries under
the name ``"flashrange"``: an attention function to transformers'
``AttentionInterface`` and a mask function to its ``AttentionMaskInterface``.

**Plan once per forward.** transformers calls the mask function once per
forward for each mask type of the model (``"full_attention"``, and
``"sliding_attention"`` for models with sliding-window layers), then hands
its result to every layer of that type as ``attention_mask``. So the mask
function does all the mask work: it turns the 2-D padding mask, or the
packing that transformers found in ``position_ids``, into range slices on
the device, plans them (:func:`flashrange.plan_mask`) and returns a
:class:`PlannedMask`. Each layer then only runs the attention op with that
plan, and the backward reuses it. No dense ``(B, 1, S, S)`` mask is ever
made. A layer builds its own ranges instead (the way every layer did before
plans existed) when it gets no :class:`PlannedMask` (transformers without
mask interfaces, a caller passing the 2-D mask directly), when the plan was
made for another shape, causality or window, and when ``cu_seq_lens_q/k``
come with the attention call (they never reach the mask function).

Range building is elementwise tensor work with static shapes (``argmax``,
``cummin``, ``cumsum``, ``where``): no ``.item()``, no ``nonzero``, so a
model traces under ``torch.compile(fullgraph=True)`` with no graph break,
and packed batches whose document count changes never recompile: the slice
list has a capacity that depends on shapes only, with the documents first
and exactly ``[0, 0)`` ``FULL`` slices after them.

What each layer gets (``S_q`` queries, ``S_k`` keys per row, ``B`` rows):

- **Padding** (a 2-D ``attention_mask``): one document per row, the row's
  run of 1s. Query ``i`` of a row sits at key position ``i + S_k - S_q``
  (queries are the last keys: a KV cache). Padded query positions get a zero
  output (as FlashAttention's unpadding does); they never reach a real token.
- **Packing** (no ``attention_mask``, ``S_q == S_k``): ``cu_seq_lens_q/k``
  when given (FlashAttention convention, offsets into the ``B * S`` flat
  tokens), else the documents transformers found in ``position_ids``: a
  document starts wherever the position does not go up by exactly 1 from
  the previous token (so positions restarting at 0, as
  ``DataCollatorWithFlattening`` produces, split documents). The capacity is
  ``B * S`` slices, one per token, since the documents are only known on
  the device.
- **Causal** layers get one bottom-right-aligned ``CAUSAL`` slice per
  document; **sliding-window** layers the window ``0 <= q - k < sliding_window``
  (transformers' ``kv_idx > q_idx - sliding_window``), as at most three
  slices per document (:func:`flashrange.window.window_slices`).
- **Bidirectional** layers (encoders, ``is_causal=False``, cross-attention):
  every query of a row attends the row's unpadded keys (``FULL`` slices).
- GQA/MQA, the module's ``scaling`` and ``softcap`` (Gemma-2's
  ``attn_logit_softcapping``) go to the op as they are; GPT-OSS's learnable
  attention sinks (``s_aux``, one logit per query head) join every row's
  softmax denominator (``sink=`` of :func:`flashrange.range_attention`).

Unsupported inputs raise ``ValueError`` / ``NotImplementedError`` with what
to do instead: dense 4-D masks or additive biases, attention dropout > 0,
``output_attentions=True``, position biases,
masks with holes (checked in strict mode, ``FLASHRANGE_STRICT=1``), static KV caches, chunked attention,
bidirectional sliding windows and custom mask overlays (``or_mask_function``
or ``and_mask_function``, e.g. bidirectional image tokens).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

try:
    import transformers  # noqa: F401
    from transformers import AttentionInterface
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flashrange.integrations.transformers needs Hugging Face transformers (>= 4.57): "
        "pip install 'flashrange[transformers]'"
    ) from e

try:
    from transformers import masking_utils as _hf_masks
except ImportError:  # pragma: no cover - transformers without mask functions: every layer plans
    _hf_masks = None

from ..constants import CAUSAL
from ..interface import attention, plan_mask
from ..plan import RangePlan
from ..validation import strict_enabled, values_readable
from ..window import window_slices

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PlannedMask",
    "register",
    "flashrange_attention_forward",
    "flashrange_mask",
    "build_ranges",
]

ATTN_IMPLEMENTATION = "flashrange"

# transformers' own mask functions, recognised by identity: dynamo folds an
# identity test of two functions to a constant, so the checks cost nothing
# under torch.compile.
_HF_CAUSAL = getattr(_hf_masks, "causal_mask_function", None)
_HF_BIDIRECTIONAL = getattr(_hf_masks, "bidirectional_mask_function", None)


class PlannedMask(NamedTuple):
    """One mask type of one forward, ranges and plan built once by :func:`flashrange_mask`.

    transformers passes it to every layer of that type as ``attention_mask``;
    :func:`flashrange_attention_forward` runs the op with ``plan`` when the
    layer is the one it was built for (the sizes, ``causal`` and
    ``sliding_window`` below), and otherwise builds the layer's ranges from
    ``padding``. Tensors and Python scalars only, so that ``torch.compile``
    carries it from the mask function to the layers without a graph break.
    """

    padding: Optional[torch.Tensor]  # (batch_size, kv_length) bool, or None without padding
    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    mask_types: torch.Tensor
    plan: RangePlan
    batch_size: int
    q_length: int
    kv_length: int
    causal: bool
    sliding_window: Optional[int]


# --------------------------------------------------------------------------- ranges


def _causal_slices(qs, qe, ks, ke, window):
    """Slices of causal (optionally windowed) documents, bottom-right aligned.

    ``qs, qe, ks, ke``: int64 ``(N,)``, document ``n`` is queries
    ``[qs[n], qe[n])`` by keys ``[ks[n], ke[n])``. Returns ``q_ranges``,
    ``k_ranges`` ``(P*N, 2)`` and ``mask_types`` ``(P*N,)`` int32, with
    ``P = 1`` without a window and ``3`` with one; empty slices are
    ``[0, 0)`` ``FULL``.
    """
    if window is not None:
        # transformers' sliding window keeps q - k < window: FA's (window - 1, 0).
        return window_slices(qs, qe, ks, ke, int(window) - 1, 0)
    empty = (qe <= qs) | (ke <= ks)
    zero = torch.zeros_like(qs)
    q_ranges = torch.stack([torch.where(empty, zero, qs), torch.where(empty, zero, qe)], dim=1)
    k_ranges = torch.stack([torch.where(empty, zero, ks), torch.where(empty, zero, ke)], dim=1)
    types = torch.where(empty, zero, torch.full_like(qs, CAUSAL))
    return q_ranges.to(torch.int32), k_ranges.to(torch.int32), types.to(torch.int32)


def _full_slices(qs, qe, ks, ke):
    """One ``FULL`` slice per document (bidirectional attention); empties become ``[0, 0)``."""
    return window_slices(qs, qe, ks, ke, -1, -1)


def _compact(q_ranges, k_ranges, mask_types, capacity=None):
    """The non-empty slices first, in their order, then the empty ``[0, 0)`` ones; at most ``capacity``.

    A stable partition by a cumulative sum and one scatter (every index
    distinct, so deterministic everywhere): static shapes, no host sync. The
    builders write every empty slice as ``[0, 0)`` ``FULL`` (all zeros), so
    moving the empties keeps them exact. ``capacity`` may cut the list only
    where the caller knows that no more slices than that can be non-empty.
    """
    n = mask_types.shape[0]
    keep = n if capacity is None else min(n, capacity)
    if n == 0:
        return q_ranges, k_ranges, mask_types
    live = (q_ranges[:, 1] > q_ranges[:, 0]) & (k_ranges[:, 1] > k_ranges[:, 0])
    rank = live.to(torch.int64).cumsum(0)
    # The i-th slice is the (rank[i] - 1)-th non-empty one, or the (i - rank[i])-th empty one.
    dest = torch.where(live, rank - 1, rank[-1] + torch.arange(n, device=rank.device) - rank)
    moved = tuple(torch.empty_like(x).index_copy_(0, dest, x)[:keep] for x in (q_ranges, k_ranges, mask_types))
    return moved


def _padding_documents(mask, Sq, Sk, causal):
    """Per-row documents from a 2-D padding mask ``(B, Sk)`` bool: int64 ``(B,)`` each.

    The keys of row ``b`` are its run of 1s ``[first, last + 1)``. Causal rows
    keep the queries that sit on those keys (query ``i`` is key ``i + Sk - Sq``);
    bidirectional rows keep every query.
    """
    B = mask.shape[0]
    dev = mask.device
    m = mask.to(torch.int32)
    has_keys = mask.any(dim=1)
    zero = torch.zeros(B, dtype=torch.int64, device=dev)
    # argmax returns the first maximal index: the first 1, and from the end the last 1.
    first = torch.where(has_keys, torch.argmax(m, dim=1), zero)
    end = torch.where(has_keys, Sk - torch.argmax(m.flip(1), dim=1), zero)
    # Strict mode only (a host sync). The mask function checks once per mask type; the
    # version stamp keeps layers that build their own ranges from the same mask object
    # from checking it again.
    if (strict_enabled(None) and values_readable(mask)
            and getattr(mask, "_flashrange_checked_version", None) != mask._version):
        lengths = m.sum(dim=1)
        bad = lengths != (end - first)
        if bool(bad.any()):
            row = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"attention_mask row {row} has holes (its 1s are not one contiguous run); the flashrange "
                "backend supports left or right padding only. Pack the sequences instead (position_ids "
                "restarting at 0, or cu_seq_lens_q/k) or use attn_implementation='sdpa'."
            )
        mask._flashrange_checked_version = mask._version
    base_q = torch.arange(B, dtype=torch.int64, device=dev) * Sq
    base_k = torch.arange(B, dtype=torch.int64, device=dev) * Sk
    if causal:
        off = Sk - Sq
        qs = torch.clamp(first - off, min=0)
        qe = torch.clamp(end - off, min=0)
    else:
        qs, qe = zero, torch.full_like(zero, Sq)
    return base_q + qs, base_q + qe, base_k + first, base_k + end


def _starts_from_positions(position_ids, B, S):
    """``(B, S)`` bool: token ``t`` starts a document (``t == 0``, or its position is not the previous + 1)."""
    if position_ids.dim() != 2 or position_ids.shape[-1] != S or position_ids.shape[0] not in (1, B):
        raise ValueError(
            f"position_ids must have shape ({B}, {S}) or (1, {S}) to describe packed documents, got "
            f"{tuple(position_ids.shape)}; pass cu_seq_lens_q/k instead for other layouts"
        )
    pos = position_ids.to(torch.int64).expand(B, S)
    first = torch.ones(B, 1, dtype=torch.bool, device=pos.device)
    return torch.cat([first, (pos[:, 1:] - pos[:, :-1]) != 1], dim=1)


def _starts_from_mask_function(mask_function, B, S, q_offset, kv_offset, cache_position, device):
    """``(B, S)`` bool: token ``t`` starts a document, read off transformers' own mask function.

    transformers keeps the documents it found in ``position_ids`` inside the
    mask function it builds (``packed_sequence_mask_function``); the mask
    function never receives ``position_ids``. A causal token sees the token
    just before it exactly when both are in one document, so evaluating the
    function on the pairs ``(t, t - 1)`` (elementwise, as transformers' own
    non-vmap expansion does) gives the boundaries without knowing how the
    function stores them. A window of one token, which sees no neighbour,
    splits every token into its own document: the same mask.
    """
    b = torch.arange(B, device=device).view(B, 1)
    h = torch.zeros(1, 1, dtype=torch.int64, device=device)
    t = torch.arange(1, S, device=device).view(1, S - 1)
    if cache_position is not None:  # transformers 4 passes the absolute query positions
        q = cache_position.to(device)[1:].view(1, S - 1)
    else:
        q = t + q_offset
    sees_previous = mask_function(b, h, q, t - 1 + kv_offset).to(device=device, dtype=torch.bool).expand(B, S - 1)
    first = torch.ones(B, 1, dtype=torch.bool, device=device)
    return torch.cat([first, ~sees_previous], dim=1)


def _packed_documents(starts):
    """Documents of packed rows from their starts ``(B, S)`` bool: int64 ``(B*S,)`` each.

    Every token position gets a slot; the slot of a token that starts a
    document holds ``[t, next start)``, the others are empty, so the count
    is static.
    """
    B, S = starts.shape
    dev = starts.device
    t = torch.arange(S, dtype=torch.int64, device=dev).expand(B, S)
    never = torch.full((B, S), S, dtype=torch.int64, device=dev)
    start_at = torch.where(starts, t, never)
    # end of the document opened at t = the first start after t: a suffix minimum.
    after = torch.cat([start_at[:, 1:], never[:, :1]], dim=1)
    end = torch.flip(torch.cummin(torch.flip(after, dims=[1]), dim=1).values, dims=[1])
    base = (torch.arange(B, dtype=torch.int64, device=dev) * S).unsqueeze(1)
    qs = (base + t).reshape(-1)
    qe = (base + torch.where(starts, end, t)).reshape(-1)
    return qs, qe, qs, qe


def _build(B, Sq, Sk, padding, starts, cu_seq_lens_q, cu_seq_lens_k, causal, sliding_window, device):
    """The slices of one layer type; see :func:`build_ranges`. ``starts``: packed document starts or ``None``."""
    if sliding_window is not None and not causal:
        raise NotImplementedError(
            "bidirectional sliding-window attention is not supported by the flashrange backend; "
            "use attn_implementation='sdpa' for this model"
        )
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    capacity = None
    if padding is not None:
        if padding.dim() != 2 or padding.dtype != torch.bool:
            raise ValueError(
                f"the flashrange backend takes a 2-D bool padding mask (B, kv_len), got a "
                f"{padding.dim()}-D {padding.dtype} mask of shape {tuple(padding.shape)}"
            )
        if tuple(padding.shape) != (B, Sk):
            raise ValueError(
                f"attention_mask has shape {tuple(padding.shape)} but the layer has {B} rows of "
                f"{Sk} keys; static KV caches are not supported by the flashrange backend (use the "
                "default dynamic cache)"
            )
        docs = _padding_documents(padding, Sq, Sk, causal)
    elif causal and cu_seq_lens_q is not None:
        cu_q = cu_seq_lens_q.to(device=device, dtype=torch.int64).reshape(-1)
        cu_k = cu_q if cu_seq_lens_k is None else cu_seq_lens_k.to(device=device, dtype=torch.int64).reshape(-1)
        if cu_q.numel() < 2 or cu_k.numel() != cu_q.numel():
            raise ValueError(
                f"cu_seq_lens_q and cu_seq_lens_k must be (N + 1,) cumulative lengths of the same N >= 1 "
                f"documents, got {cu_q.numel()} and {cu_k.numel()} values"
            )
        docs = (cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])
    elif causal and starts is not None and Sq == Sk:
        docs = _packed_documents(starts)
        # The documents partition the B * Sq query rows and the slices of one document
        # partition its rows, so at most B * Sq slices are non-empty, windowed or not.
        capacity = B * Sq
    else:
        rows = torch.arange(B, dtype=torch.int64, device=device)
        docs = (rows * Sq, rows * Sq + Sq, rows * Sk, rows * Sk + Sk)
    slices = _causal_slices(*docs, sliding_window) if causal else _full_slices(*docs)
    # Documents first and the empty slots after them, all [0, 0) FULL: the plan's cheapest
    # case for slots that a shape-only capacity leaves empty.
    return _compact(*slices, capacity)


def build_ranges(
    batch_size,
    q_len,
    kv_len,
    *,
    attention_mask=None,
    position_ids=None,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
    causal=True,
    sliding_window=None,
    device=None,
):
    """Slices for one attention layer of a transformers model, built on the device.

    The queries of the layer are flattened to ``Tq = batch_size * q_len``
    tokens and the keys to ``Tk = batch_size * kv_len`` (row-major, as
    ``(B, S, H, D) -> (B*S, H, D)``).

    Args:
        attention_mask: ``(B, kv_len)`` bool padding mask (one run of 1s per
            row), or ``None``.
        position_ids: ``(B or 1, q_len)``; used for packing when there is no
            ``attention_mask``, the layer is causal and ``q_len == kv_len``.
        cu_seq_lens_q, cu_seq_lens_k: ``(N + 1,)`` cumulative document
            lengths over the flat tokens; take precedence over ``position_ids``.
        causal: bottom-right causal documents, else bidirectional (``FULL``).
        sliding_window: keys with ``0 <= q - k < sliding_window`` (causal only).

    Returns:
        ``q_ranges (S, 2)``, ``k_ranges (S, 2)``, ``mask_types (S,)`` int32,
        where ``S`` depends only on shapes, never on the values: the
        non-empty slices first, then ``[0, 0)`` ``FULL`` padding slices.
    """
    B, Sq, Sk = int(batch_size), int(q_len), int(kv_len)
    starts = None
    if attention_mask is None and causal and cu_seq_lens_q is None and position_ids is not None and Sq == Sk:
        starts = _starts_from_positions(position_ids.to(device), B, Sq)
    return _build(B, Sq, Sk, attention_mask, starts, cu_seq_lens_q, cu_seq_lens_k, causal, sliding_window, device)


# --------------------------------------------------------------------------- transformers hooks


def _check_supported(dropout, attention_mask, kwargs):
    if kwargs.get("output_attentions", False):
        raise ValueError(
            "the flashrange backend never materialises attention weights: output_attentions=True needs "
            "attn_implementation='eager'"
        )
    if dropout and float(dropout) > 0.0:
        raise ValueError(
            f"the flashrange backend has no attention dropout (got p={dropout} in training); set the "
            "config's attention_dropout to 0.0, or use attn_implementation='sdpa'"
        )
    if kwargs.get("position_bias", None) is not None:
        raise NotImplementedError("additive position biases are not supported by the flashrange backend")
    if isinstance(attention_mask, PlannedMask):
        return
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(
            f"the flashrange backend got a prepared attention mask of shape {shape}; it builds its "
            "ranges from the 2-D padding mask (B, S), position_ids or cu_seq_lens_q/k. Pass those instead "
            "of a 4-D mask or additive bias, or use attn_implementation='sdpa'"
        )


def _sink_logits(s_aux, Hq):
    """GPT-OSS's ``s_aux`` (one sink logit per query head, ``(Hq,)``) as flashrange's ``sink`` ``(1, Hq)``."""
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or s_aux.numel() != Hq:
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise ValueError(f"s_aux (attention sinks) must hold one logit per query head, ({Hq},), got {shape}")
    return s_aux.reshape(1, Hq)


def _fits(planned, device, B, Sq, Sk, causal, sliding_window):
    """Whether ``planned`` was built for a layer on this device, of this shape, causality and window."""
    return (
        planned.q_ranges.device == device
        and planned.batch_size == B
        and planned.q_length == Sq
        and planned.kv_length == Sk
        and planned.causal == causal
        and planned.sliding_window == sliding_window
    )


def flashrange_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    sliding_window=None,
    softcap=None,
    is_causal=None,
    **kwargs,
):
    """transformers attention function for ``attn_implementation="flashrange"``.

    ``query``: ``(B, Hq, S_q, D)``; ``key``: ``(B, Hkv, S_k, D)``; ``value``:
    ``(B, Hkv, S_k, Dv)``; ``attention_mask``: what :func:`flashrange_mask`
    returned (a :class:`PlannedMask`), or a ``(B, S_k)`` bool padding mask,
    or ``None``. Returns ``(out, None)`` with ``out`` ``(B, S_q, Hq, Dv)``, as
    transformers' other backends.
    """
    _check_supported(dropout, attention_mask, kwargs)
    B, Hq, Sq, D = query.shape
    Hkv, Sk = key.shape[1], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True) and getattr(getattr(module, "config", None), "is_causal", True)
    causal = bool(is_causal)
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    q = query.transpose(1, 2).reshape(B * Sq, Hq, D)
    k = key.transpose(1, 2).reshape(B * Sk, Hkv, D)
    v = value.transpose(1, 2).reshape(B * Sk, Hkv, value.shape[-1])
    softcap = 0.0 if softcap is None else softcap
    sink = _sink_logits(kwargs.get("s_aux", None), Hq)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q", None), kwargs.get("cu_seq_lens_k", None)
    planned = attention_mask if isinstance(attention_mask, PlannedMask) else None
    if planned is not None and cu_q is None and _fits(planned, query.device, B, Sq, Sk, causal, sliding_window):
        # The common case: ranges and plan come from the mask function, built once for
        # every layer of this type. They are ours, so there is nothing to check strictly.
        out, _ = attention(
            q, k, v, planned.q_ranges, planned.k_ranges, planned.mask_types, plan=planned.plan,
            softmax_scale=scaling, softcap=softcap, strict=False, sink=sink,
        )
        return out.view(B, Sq, Hq, v.shape[-1]), None
    # This layer builds (and plans) its own ranges: no plan, one made for another
    # layer (or device: a model split across devices), or documents given as
    # cu_seq_lens, which only the attention call sees.
    padding = planned.padding if planned is not None else attention_mask
    if padding is not None:
        padding = padding.to(query.device)
    q_ranges, k_ranges, mask_types = build_ranges(
        B,
        Sq,
        Sk,
        attention_mask=padding,
        position_ids=kwargs.get("position_ids", None),
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        causal=causal,
        sliding_window=sliding_window,
        device=query.device,
    )
    # Only user-given cu_seq_lens can be out of bounds (the other builders cannot): their
    # values are checked in strict mode (FLASHRANGE_STRICT=1), like every range.
    out, _ = attention(
        q, k, v, q_ranges, k_ranges, mask_types, softmax_scale=scaling, softcap=softcap,
        strict=None if (padding is None and causal and cu_q is not None) else False, sink=sink,
    )
    return out.view(B, Sq, Hq, v.shape[-1]), None


def _is_or_overlay(fn):
    """Whether transformers' ``or_masks`` made ``fn`` (its inner function is named ``or_mask``).

    ``__name__``, not ``__qualname__``: dynamo reads the former of a closure
    but not the latter.
    """
    return getattr(fn, "__name__", "") == "or_mask"


def _closure_value(fn, name):
    """The value ``fn`` closes over under ``name``, or ``None`` (plain Python; never traced)."""
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None)
    if code is None or closure is None or name not in code.co_freevars:
        return None
    return closure[code.co_freevars.index(name)].cell_contents


def _plainly_unpacked(fn, depth=0):
    """Whether ``fn`` is built only of transformers' causal and sliding-window functions (no packing).

    Anything else (a packed-sequence function, or a structure this does not
    know) answers ``False``, which only costs the packed layout's capacity.
    """
    if fn is _HF_CAUSAL:
        return True
    if getattr(fn, "__qualname__", "").startswith("sliding_window_overlay."):
        return True
    # transformers nests and_masks a level or two deep; the bound only stops a closure
    # that reaches itself from recursing forever.
    if getattr(fn, "__name__", "") == "and_mask" and depth < 8:
        parts = _closure_value(fn, "mask_functions")
        return isinstance(parts, tuple) and all(_plainly_unpacked(g, depth + 1) for g in parts)
    return False


def _may_be_packed(mask_function):
    """Whether a causal mask function may hold packed documents (decided on the host, from its structure).

    Under ``torch.compile`` transformers adds its packed-sequence function
    whenever ``position_ids`` come without a padding mask (it cannot read
    them to see whether they restart), and dynamo cannot look inside a
    closure: any function but the plain causal one may be packed there. In
    eager mode transformers adds it only when the positions do restart, and
    the closure can be read, so unpacked sliding-window layers keep one
    document per row.
    """
    if mask_function is None or mask_function is _HF_CAUSAL:
        return False
    if torch.compiler.is_compiling():
        return True
    return not _plainly_unpacked(mask_function)


def _is_bidirectional(mask_function, kwargs):
    # transformers >= 5 builds bidirectional masks from bidirectional_mask_function and
    # passes allow_is_bidirectional_skip (the sliding-window variant wraps the function).
    return (_HF_BIDIRECTIONAL is not None and mask_function is _HF_BIDIRECTIONAL) or (
        "allow_is_bidirectional_skip" in kwargs
    )


def flashrange_mask(
    batch_size=None,
    q_length=None,
    kv_length=None,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    **kwargs,
):
    """transformers mask function for ``"flashrange"``: the ranges and plan of one mask type, never a dense mask.

    transformers calls it once per forward for each mask type (full,
    sliding-window, bidirectional) with the sizes of the layers of that type
    (``q_length``, ``kv_length``, ``kv_offset`` of the KV cache; transformers
    4 passes ``cache_position`` instead of ``q_length`` / ``q_offset``) and
    the 2-D padding mask. Returns a :class:`PlannedMask` that every layer of
    the type receives as ``attention_mask``: the padding mask's columns the
    layer sees (``attention_mask[:, kv_offset : kv_offset + kv_length]``,
    bool, or ``None``), the slices and their plan. Without the sizes it
    returns that padding mask alone and each layer builds its own ranges.
    Raises for mask patterns the backend cannot express.
    """
    config = kwargs.get("config", None)
    if kwargs.get("use_vmap", False) or _is_or_overlay(mask_function):
        raise NotImplementedError(
            "the flashrange backend does not support custom mask overlays (or_mask_function / "
            "and_mask_function / block_sequence_ids, e.g. bidirectional image tokens); use "
            "attn_implementation='sdpa' for such inputs"
        )
    if config is not None and getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError("chunked attention (attention_chunk_size) is not supported by the flashrange backend")
    if attention_mask is not None and attention_mask.dim() != 2:
        return attention_mask  # a prepared mask: the attention function explains the error
    padding = None
    if attention_mask is not None:
        if kv_length is None:
            return attention_mask.to(torch.bool)
        if kv_offset + kv_length > attention_mask.shape[-1]:
            raise ValueError(
                f"the layer sees {kv_length} keys from offset {kv_offset} but the attention_mask has "
                f"{attention_mask.shape[-1]} columns: static KV caches are not supported by the flashrange "
                "backend (use the default dynamic cache)"
            )
        padding = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    cache_position = kwargs.get("cache_position", None)
    if q_length is None and cache_position is not None:
        q_length = cache_position.shape[0]
    device = padding.device if padding is not None else kwargs.get("device", None)
    if device is None and cache_position is not None:
        device = cache_position.device
    if batch_size is None or q_length is None or kv_length is None or device is None:
        return padding  # sizes unknown: each layer builds its ranges from the padding mask
    causal = not _is_bidirectional(mask_function, kwargs)
    # local_size is the window of sliding-window masks (chunked ones are refused above).
    window = kwargs.get("local_size", None)
    starts = None
    # One token per row is one document whatever the packing (and leaves no pair to look at).
    if padding is None and causal and q_length == kv_length and q_length > 1 and _may_be_packed(mask_function):
        starts = _starts_from_mask_function(
            mask_function, batch_size, q_length, q_offset, kv_offset, cache_position, device
        )
    q_ranges, k_ranges, mask_types = _build(
        batch_size, q_length, kv_length, padding, starts, None, None, causal, window, device
    )
    # Our own ranges are in bounds by construction: nothing to check on the host.
    plan = plan_mask(q_ranges, k_ranges, mask_types, batch_size * q_length, batch_size * kv_length, strict=False)
    return PlannedMask(
        padding, q_ranges, k_ranges, mask_types, plan, batch_size, q_length, kv_length, causal, window
    )


def _skip_flash_import(name):
    """Keep transformers from importing FlashAttention for ``name``.

    transformers 5 treats every ``attn_implementation`` whose name contains
    ``"flash"`` as a FlashAttention build and imports it when a model selects
    it (``lazy_import_flash_attention``), which fails for ours. That function
    skips the import when the name equals the last one it imported, so we
    record ours as imported; nothing of FlashAttention's is used by this
    backend. transformers 4 checks ``startswith("flash_attention")`` instead
    and needs nothing.
    """
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return
    if is_flash_attention_requested(requested_attention_implementation=name) and hasattr(
        fa_utils, "_loaded_implementation"
    ):
        fa_utils._loaded_implementation = name


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register the backend with transformers under ``name`` (idempotent); returns ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)``,
    ``from_config(..., attn_implementation=name)`` and
    ``model.set_attn_implementation(name)`` select it. With transformers 5,
    call it again before selecting the backend if a real FlashAttention model
    ran in between (see :func:`_skip_flash_import`).
    """
    AttentionInterface.register(name, flashrange_attention_forward)
    _skip_flash_import(name)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # pragma: no cover - transformers without mask interfaces builds no masks for us
        return name
    AttentionMaskInterface.register(name, flashrange_mask)
    return name


register()
