"""Input checks shared by every front-end (docs/design.md §8).

Two kinds of checks:

- **static** (shapes, dtypes, devices, scalar settings): free, run on every
  call, also under ``torch.compile`` (they read no tensor value);
- **values** (range bounds, types, ``cu_seqlens``): read the tensors on the
  host, so they run only in *strict mode*, asked for with ``strict=True`` or
  the environment variable ``FLASHRANGE_STRICT=1``. By default no call reads
  a mask value on the host: the kernels clamp every range instead, so garbage
  never faults. Under ``torch.compile`` tracing and CUDA-graph capture the
  value checks are skipped even in strict mode (nothing can be read there).

Every message names the caller's own parameter (``attn_type_map``,
``cu_seqlens_q``...), says what is wrong and how to fix it.
"""

from __future__ import annotations

import math
import os

import torch

from .constants import (
    KERNEL_DTYPES,
    MASK_TYPES,
    MAX_HEAD_DIM,
    MAX_HEAD_DIM_V,
    MAX_TOKENS,
    STRICT_ENV,
    TYPE_NAMES,
    WIDE_V_MAX_HEAD_DIM,
    kernel_head_dims_ok,
)

__all__ = [
    "RANGE_NAMES",
    "check_qkv",
    "check_ranges",
    "check_scalars",
    "check_sink",
    "check_window",
    "resolve_scale",
    "strict_enabled",
    "values_readable",
    "check_range_values",
    "check_cu_seqlens_values",
]

# Parameter names of range_attention; front-ends pass their own.
RANGE_NAMES = ("q_ranges", "k_ranges", "mask_types")

_TYPE_LIST = ", ".join(f"{t} ({TYPE_NAMES[t]})" for t in MASK_TYPES)


def _qkv_ok(q, k, v) -> bool:
    """Every condition of :func:`check_qkv` in one expression (it runs on every call)."""
    try:
        qs, ks, vs, dt, dev = q.shape, k.shape, v.shape, q.dtype, q.device
        return (
            type(q) is type(k) is type(v) and isinstance(q, torch.Tensor)
            and len(qs) == 3 and len(ks) == 3 and len(vs) == 3
            and k.dtype == dt and v.dtype == dt and dt.is_floating_point
            and k.device == dev and v.device == dev
            and qs[2] == ks[2] and ks[0] == vs[0] and ks[1] == vs[1] and ks[1] != 0 and qs[1] % ks[1] == 0
            and qs[0] <= MAX_TOKENS and ks[0] <= MAX_TOKENS
            and (dev.type != "cuda" or dt not in KERNEL_DTYPES or kernel_head_dims_ok(qs[2], vs[2]))
        )
    except AttributeError:
        return False


def check_qkv(q, k, v):
    """Packed ``(T, H, D)`` q, k, v: dtypes, devices, GQA ratio, token and head-dim limits."""
    if _qkv_ok(q, k, v):
        return
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
    if q.device.type == "cuda" and q.dtype in KERNEL_DTYPES:
        D, Dv = q.shape[2], v.shape[2]
        if not kernel_head_dims_ok(D, Dv):
            raise ValueError(
                f"head dims from 1 to {MAX_HEAD_DIM} are supported on the GPU (q/k: D, v: Dv), got D={D}, "
                f"Dv={Dv}; larger head dims run only on the CPU reference. Wider values are supported too: "
                f"Dv up to {MAX_HEAD_DIM_V} when D <= {WIDE_V_MAX_HEAD_DIM} (e.g. D={WIDE_V_MAX_HEAD_DIM}, "
                f"Dv={MAX_HEAD_DIM_V})"
            )


def _ranges_ok(q_ranges, k_ranges, mask_types, device) -> bool:
    """Every condition of :func:`check_ranges` in one expression (it runs on every call)."""
    try:
        qs, ks, ts, i32 = q_ranges.shape, k_ranges.shape, mask_types.shape, torch.int32
        return (
            isinstance(q_ranges, torch.Tensor) and isinstance(k_ranges, torch.Tensor)
            and isinstance(mask_types, torch.Tensor)
            and len(qs) == 2 and len(ks) == 2 and len(ts) == 1 and qs[1] == 2 and ks[1] == 2
            and qs[0] == ks[0] == ts[0]
            and q_ranges.dtype == i32 and k_ranges.dtype == i32 and mask_types.dtype == i32
            and q_ranges.device == device and k_ranges.device == device and mask_types.device == device
        )
    except AttributeError:
        return False


def check_ranges(q_ranges, k_ranges, mask_types, device, names=RANGE_NAMES):
    """Shapes, dtypes and device of the three slice tensors (``names``: the caller's parameter names)."""
    if _ranges_ok(q_ranges, k_ranges, mask_types, device):
        return
    n_q, n_k, n_t = names
    for name, t in ((n_q, q_ranges), (n_k, k_ranges)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape (S, 2), got {type(t).__name__}")
        if t.dim() != 2 or t.shape[1] != 2:
            raise ValueError(f"{name} must have shape (S, 2), got {tuple(t.shape)}")
    if not isinstance(mask_types, torch.Tensor):
        raise TypeError(f"{n_t} must be a torch.Tensor of shape (S,), got {type(mask_types).__name__}")
    if mask_types.dim() != 1:
        raise ValueError(f"{n_t} must have shape (S,), got {tuple(mask_types.shape)}")
    if not (q_ranges.shape[0] == k_ranges.shape[0] == mask_types.shape[0]):
        raise ValueError(
            f"{n_q}, {n_k} and {n_t} must describe the same number of slices, got "
            f"{q_ranges.shape[0]}, {k_ranges.shape[0]}, {mask_types.shape[0]}"
        )
    for name, t in ((n_q, q_ranges), (n_k, k_ranges), (n_t, mask_types)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}; convert with {name}.to(torch.int32)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but q is on {device}; move it with {name}.to(q.device)")


def check_sink(sink, q, name="sink"):
    """Learnable sink logits: a floating-point `(S_sink, Hq)` tensor on q's device, ``S_sink >= 1``.

    ``name``: the caller's parameter name, for the messages.
    """
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (S_sink, Hq) or None, got {type(sink).__name__}")
    Hq = q.shape[1]
    if sink.dim() != 2 or sink.shape[0] < 1 or sink.shape[1] != Hq:
        raise ValueError(
            f"{name} must have shape (S_sink, Hq) = (S_sink >= 1, {Hq}): one logit per sink and query head, "
            f"got {tuple(sink.shape)}"
        )
    if not sink.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (float32 recommended), got {sink.dtype}")
    if sink.device != q.device:
        raise ValueError(f"{name} is on {sink.device} but q is on {q.device}; move it with {name}.to(q.device)")


def check_scalars(softmax_scale, softcap):
    """Finite settings: ``softmax_scale`` (``None`` = default) and ``softcap >= 0`` (0 disables it).

    Returns ``softcap`` as a float. While ``torch.compile`` traces with
    ``dynamic=True`` the scalars may be symbolic: their values are not checked
    there (a check would guard on them and recompile for each new value).
    """
    if torch.compiler.is_compiling():
        return float(softcap)
    if softmax_scale is not None:
        try:
            scale = float(softmax_scale)
        except (TypeError, ValueError) as e:
            raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}") from e
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {scale}; pass None for 1/sqrt(head_dim)")
    try:
        cap = float(softcap)
    except (TypeError, ValueError) as e:
        raise TypeError(f"softcap must be a float, got {softcap!r}") from e
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {cap}")
    return cap


def resolve_scale(softmax_scale, head_dim: int) -> float:
    """The score scale: ``softmax_scale``, or ``1 / sqrt(head_dim)`` when ``None``."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def check_window(window_size):
    """``(left, right)`` of a FlashAttention window as ints (``-1`` = unbounded side)."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError) as e:
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from e
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= 0, or -1 for unbounded, got {window_size!r}")
    return left, right


def strict_enabled(strict) -> bool:
    """Whether value checks are asked for: ``strict``, or ``FLASHRANGE_STRICT`` when it is ``None``."""
    if strict is None:
        return os.environ.get(STRICT_ENV, "0").strip().lower() not in ("", "0", "false", "no", "off")
    return bool(strict)


def values_readable(t: torch.Tensor) -> bool:
    """Whether a tensor's values can be read on the host here: not while tracing or capturing."""
    if torch.compiler.is_compiling():
        return False
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_range_values(q_ranges, k_ranges, mask_types, Tq, Tk, names=RANGE_NAMES):
    """Raise ``ValueError`` naming the first bad slice (one host copy, vectorised comparisons).

    An empty slice (``start == end`` in q or k) is valid padding wherever it
    lies. A slice with ``start > end`` is reported (the kernels treat it as
    empty). A non-empty slice must have a known type and lie inside
    ``[0, Tq]`` x ``[0, Tk]``.
    """
    n_q, n_k, n_t = names
    S = mask_types.shape[0]
    if S == 0:
        return
    host = torch.cat([q_ranges.reshape(-1, 2), k_ranges.reshape(-1, 2), mask_types.reshape(-1, 1)], 1)
    host = host.to("cpu", torch.int64)
    qs, qe, ks, ke, mt = host.unbind(1)
    reversed_ = (qs > qe) | (ks > ke)
    live = ~reversed_ & (qe > qs) & (ke > ks)
    bad_type = live & ~torch.isin(mt, torch.tensor(MASK_TYPES))
    bad_q = live & ((qs < 0) | (qe > Tq))
    bad_k = live & ((ks < 0) | (ke > Tk))
    bad = reversed_ | bad_type | bad_q | bad_k
    if not bool(bad.any()):
        return
    s = int(bad.nonzero()[0, 0])
    q_r, k_r, t = (int(qs[s]), int(qe[s])), (int(ks[s]), int(ke[s])), int(mt[s])
    if reversed_[s]:
        raise ValueError(
            f"slice {s}: start after end ({n_q}[{s}] = [{q_r[0]}, {q_r[1]}), {n_k}[{s}] = [{k_r[0]}, {k_r[1]})); "
            "such a slice is empty: use [0, 0) for a padding slice"
        )
    if bad_type[s]:
        raise ValueError(f"slice {s}: unknown mask type {n_t}[{s}] = {t}; valid types are {_TYPE_LIST}")
    if bad_q[s]:
        raise ValueError(f"slice {s}: {n_q}[{s}] = [{q_r[0]}, {q_r[1]}) lies outside [0, Tq={Tq}]")
    raise ValueError(f"slice {s}: {n_k}[{s}] = [{k_r[0]}, {k_r[1]}) lies outside [0, Tk={Tk}]")


def check_cu_seqlens_values(cu_seqlens, name, total):
    """``cu_seqlens`` as FlashAttention reads it: starts at 0, non-decreasing, last value ``<= total``."""
    host = cu_seqlens.detach().to("cpu", torch.int64).reshape(-1)
    if host.numel() == 0:
        raise ValueError(f"{name} must hold at least one value (0)")
    if int(host[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {host[:8].tolist()}")
    steps = host[1:] < host[:-1]
    if bool(steps.any()):
        b = int(steps.nonzero()[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing (cumulative lengths), but {name}[{b + 1}] = {int(host[b + 1])} < "
            f"{name}[{b}] = {int(host[b])}"
        )
    if int(host[-1]) > total:
        raise ValueError(f"{name}[-1] = {int(host[-1])} is more than the {total} tokens of the packed tensor")
