"""``range_attention``: the core public function, and the input checks every front-end shares."""

from __future__ import annotations

import math

import torch

from . import ops
from .plan import MAX_TOKENS

__all__ = ["range_attention", "check_inputs", "check_range_values"]

_TYPE_NAMES = "0 (FULL), 1 (CAUSAL), 2 (INV_CAUSAL), 3 (BI_CAUSAL)"


def check_inputs(q, k, v, q_ranges, k_ranges, mask_types):
    """Shape, dtype and device checks: static, so they cost nothing under compile."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be packed (T, H, D), got shape {tuple(t.shape)}; "
                "for (B, S, H, D) inputs use flashrange.flash_attn_func or reshape to (B*S, H, D)"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must share the head dim, got {q.shape[2]} and {k.shape[2]}")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share (Tk, Hkv)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"the number of query heads ({q.shape[1]}) must be a multiple of the number of "
            f"key/value heads ({k.shape[1]}) for GQA/MQA"
        )
    if q.shape[0] > MAX_TOKENS or k.shape[0] > MAX_TOKENS:
        raise ValueError(f"at most {MAX_TOKENS} tokens are supported, got Tq={q.shape[0]}, Tk={k.shape[0]}")
    for name, t in (("q_ranges", q_ranges), ("k_ranges", k_ranges)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.shape[1] != 2:
            raise ValueError(f"{name} must have shape (S, 2), got {tuple(t.shape)}")
    if not isinstance(mask_types, torch.Tensor):
        raise TypeError(f"mask_types must be a torch.Tensor, got {type(mask_types).__name__}")
    if mask_types.dim() != 1:
        raise ValueError(f"mask_types must have shape (S,), got {tuple(mask_types.shape)}")
    if not (q_ranges.shape[0] == k_ranges.shape[0] == mask_types.shape[0]):
        raise ValueError(
            f"q_ranges, k_ranges and mask_types must describe the same number of slices, got "
            f"{q_ranges.shape[0]}, {k_ranges.shape[0]}, {mask_types.shape[0]}"
        )
    for name, t in (("q_ranges", q_ranges), ("k_ranges", k_ranges), ("mask_types", mask_types)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}; convert with {name}.to(torch.int32)")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; move it with {name}.to(q.device)")


def _values_checkable(t: torch.Tensor) -> bool:
    """Whether reading range values on the host is allowed here (no trace, no capture, no sync ban)."""
    if torch.compiler.is_compiling():
        return False
    if t.is_cuda:
        if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0:
            return False
    return True


def check_range_values(q_ranges, k_ranges, mask_types, Tq, Tk):
    """Raise ``ValueError`` naming the first slice whose values are out of bounds.

    Reads the tensors on the host; callers skip it under compile and capture,
    where the kernels clamp every range instead.
    """
    if q_ranges.numel() == 0:
        return
    qr, kr, mt = q_ranges.tolist(), k_ranges.tolist(), mask_types.tolist()
    for s, ((qs, qe), (ks, ke), t) in enumerate(zip(qr, kr, mt)):
        if t not in (0, 1, 2, 3):
            raise ValueError(f"slice {s}: unknown mask type {t}; valid types are {_TYPE_NAMES}")
        if not (0 <= qs <= Tq and 0 <= qe <= Tq):
            raise ValueError(f"slice {s}: q range [{qs}, {qe}) lies outside [0, Tq={Tq}]")
        if not (0 <= ks <= Tk and 0 <= ke <= Tk):
            raise ValueError(f"slice {s}: k range [{ks}, {ke}) lies outside [0, Tk={Tk}]")
        if qs > qe or ks > ke:
            raise ValueError(
                f"slice {s}: start after end (q [{qs}, {qe}), k [{ks}, {ke})); "
                "use [0, 0) for an empty padding slice"
            )


def resolve_scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def range_attention(
    q,
    k,
    v,
    q_ranges,
    k_ranges,
    mask_types,
    *,
    softmax_scale=None,
    softcap=0.0,
    max_seqlen_q=None,
    max_seqlen_k=None,
):
    """Attention over a mask written as ranges (DESIGN §2).

    Args:
        q: `(Tq, Hq, D)`; k: `(Tk, Hkv, D)`; v: `(Tk, Hkv, Dv)`, with `Hq % Hkv == 0`.
        q_ranges, k_ranges: `(S, 2)` int32; slice `s` is `[qs, qe) x [ks, ke)`.
        mask_types: `(S,)` int32: 0 FULL, 1 CAUSAL (bottom-right), 2 INV_CAUSAL
            (top-left), 3 BI_CAUSAL. Empty slices (`[0, 0)`) pad the list freely.
        softmax_scale: defaults to `1 / sqrt(D)`.
        softcap: when `> 0`, scores become `softcap * tanh(score / softcap)`.
        max_seqlen_q, max_seqlen_k: accepted for API compatibility; unused.

    Returns:
        `out`: `(Tq, Hq, Dv)` in q's dtype, and `lse`: `(Tq, Hq)` float32
        (natural log; `-inf` on rows no slice covers, whose `out` is 0).
        Differentiable in q, k, v (and through `lse`).
    """
    check_inputs(q, k, v, q_ranges, k_ranges, mask_types)
    softcap = float(softcap)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if _values_checkable(q_ranges):
        check_range_values(q_ranges, k_ranges, mask_types, q.shape[0], k.shape[0])
    scale = resolve_scale(softmax_scale, q.shape[-1])
    return ops.fwd(q, k, v, q_ranges, k_ranges, mask_types, scale, softcap)
