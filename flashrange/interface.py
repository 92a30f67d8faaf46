"""``range_attention`` and ``plan_mask``: the core public functions, and the one entry below every front-end.

Every front-end (:func:`range_attention`, the MagiAttention and
FlashAttention-3 front-ends of :mod:`flashrange.compat`, the transformers
backend) calls :func:`attention`, which runs the static checks of
:mod:`flashrange.validation`, the value checks when strict mode asks for
them, plans the mask when no plan is given, and calls the ops (eager CUDA
calls call the ops' implementations directly: :func:`flashrange.ops.eager_cuda`).
"""

from __future__ import annotations

import torch

from . import ops
from .plan import RangePlan, check_plan
from .validation import (
    RANGE_NAMES,
    check_qkv,
    check_range_values,
    check_ranges,
    check_scalars,
    check_sink,
    resolve_scale,
    strict_enabled,
    values_readable,
)

__all__ = ["range_attention", "plan_mask", "attention", "merge_sink"]


def plan_mask(q_ranges, k_ranges, mask_types, Tq: int, Tk: int, *, strict=None) -> RangePlan:
    """Plan a mask once, for every call (and layer) that uses it.

    Args:
        q_ranges, k_ranges: `(S, 2)` int32; mask_types: `(S,)` int32, on the
            device of the attention inputs.
        Tq, Tk: the token counts of q and of k/v.
        strict: check the range values (see :func:`range_attention`).

    Returns:
        A :class:`~flashrange.plan.RangePlan` (plain tensors) to pass as
        ``plan=`` to :func:`range_attention` and the front-ends. The forward
        keeps it for the backward, so a training step plans each mask once.
        Under CUDA-graph capture, capture this call with the attention so that
        in-place updates of the ranges reach the plan.
    """
    if not isinstance(q_ranges, torch.Tensor):
        raise TypeError(f"q_ranges must be a torch.Tensor of shape (S, 2), got {type(q_ranges).__name__}")
    check_ranges(q_ranges, k_ranges, mask_types, q_ranges.device)
    Tq, Tk = int(Tq), int(Tk)
    if Tq < 0 or Tk < 0:
        raise ValueError(f"Tq and Tk must be >= 0, got Tq={Tq}, Tk={Tk}")
    if strict_enabled(strict) and values_readable(q_ranges):
        check_range_values(q_ranges, k_ranges, mask_types, Tq, Tk)
    return _plan(q_ranges, k_ranges, mask_types, Tq, Tk)


def _plan(q_ranges, k_ranges, mask_types, Tq, Tk) -> RangePlan:
    """The plan through the eager CUDA path or the op (see :func:`flashrange.ops.plain_cuda`)."""
    if ops.plain_cuda(q_ranges, k_ranges, mask_types):
        return ops.plan_eager(q_ranges, k_ranges, mask_types, Tq, Tk)
    return RangePlan(*ops.plan(q_ranges, k_ranges, mask_types, Tq, Tk))


def merge_sink(out, lse, sink):
    """Add learnable sink logits to every row's softmax: ``(out, lse)`` without sinks -> with them.

    `out`: `(Tq, Hq, Dv)`, `lse`: `(Tq, Hq)` (natural log, `-inf` on rows no
    slice covers), `sink`: `(S_sink, Hq)`. With `L = logsumexp(sink, 0)`, the
    result is `lse' = logaddexp(lse, L)` and `out' = out * exp(lse - lse')`: the
    sinks join the denominator and carry no value. A row no slice covers gets
    `out' = 0` and `lse' = L` (MagiAttention's convention). Plain torch ops, so
    autograd gives the gradient of `sink` and, through `lse`, the extra terms of
    q, k and v; they trace under ``torch.compile`` and CUDA-graph capture.
    """
    acc = lse.dtype
    s = sink.to(acc)
    # A stable logsumexp of the sinks whose gradient stays finite when every sink of a
    # head is -inf (torch.logsumexp's backward is NaN there). The shifts m and M are
    # detached: the result does not depend on them, only its rounding does.
    m = s.detach().amax(dim=0)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    z_sink = torch.exp(s - m).sum(dim=0)
    has_sink = z_sink > 0
    L = torch.where(has_sink, m + torch.log(torch.where(has_sink, z_sink, torch.ones_like(z_sink))), float("-inf"))
    M = torch.maximum(lse.detach(), L.detach())
    M = torch.where(M == float("-inf"), torch.zeros_like(M), M)
    a = torch.exp(lse - M)  # this row's own mass (0 where no slice covers it)
    z = a + torch.exp(L - M)
    live = z > 0
    z_safe = torch.where(live, z, torch.ones_like(z))
    new_lse = torch.where(live, M + torch.log(z_safe), float("-inf"))
    new_out = (out.to(acc) * (a / z_safe).unsqueeze(-1)).to(out.dtype)
    return new_out, new_lse


def attention(
    q, k, v, q_ranges, k_ranges, mask_types, *, softmax_scale=None, softcap=0.0, plan=None, strict=None,
    sink=None, return_max_logits=False, names=RANGE_NAMES, sink_name="sink",
):
    """The entry below every front-end: checks, plan, op, sinks.

    Same arguments and result as :func:`range_attention`. ``names``: the
    caller's names of the three range tensors; ``sink_name``: its name of the
    sink tensor (for the messages).
    """
    check_qkv(q, k, v)
    check_ranges(q_ranges, k_ranges, mask_types, q.device, names)
    if sink is not None:
        check_sink(sink, q, sink_name)
    softcap = check_scalars(softmax_scale, softcap)
    Tq, Tk = q.shape[0], k.shape[0]
    if strict_enabled(strict) and values_readable(q_ranges):
        check_range_values(q_ranges, k_ranges, mask_types, Tq, Tk, names)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if plan is not None:
        plan = check_plan(plan, mask_types.shape[0], Tq, Tk)
        if plan.q_slices.device != q.device:
            raise ValueError(f"the plan is on {plan.q_slices.device} but q is on {q.device}")
    if plan is None:
        plan = _plan(q_ranges, k_ranges, mask_types, Tq, Tk)
    if ops.eager_cuda(q, k, v, q_ranges, k_ranges, mask_types, *plan):
        result = ops.fwd_eager(q, k, v, q_ranges, k_ranges, mask_types, plan, scale, softcap, return_max_logits)
    else:
        op = ops.fwd_max_logits if return_max_logits else ops.fwd
        result = op(q, k, v, q_ranges, k_ranges, mask_types, list(plan), scale, softcap)
    if sink is None:
        return result
    out, lse = merge_sink(result[0], result[1], sink)
    return (out, lse) + tuple(result[2:])


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
    plan=None,
    strict=None,
    sink=None,
    return_max_logits=False,
):
    """Attention over a mask written as ranges (docs/design.md §2).

    Args:
        q: `(Tq, Hq, D)`; k: `(Tk, Hkv, D)`; v: `(Tk, Hkv, Dv)`, with `Hq % Hkv == 0`.
        q_ranges, k_ranges: `(S, 2)` int32; slice `s` is `[qs, qe) x [ks, ke)`.
        mask_types: `(S,)` int32: 0 FULL, 1 CAUSAL (bottom-right), 2 INV_CAUSAL
            (top-left), 3 BI_CAUSAL. Empty slices (`start == end`) pad the list
            freely, wherever they lie.
        softmax_scale: defaults to `1 / sqrt(D)`; must be finite.
        softcap: when `> 0`, scores become `softcap * tanh(score / softcap)`.
        max_seqlen_q, max_seqlen_k: accepted for API compatibility; unused.
        plan: a :class:`~flashrange.plan.RangePlan` from :func:`plan_mask` for
            these ranges and sizes; planned in the call when ``None``.
        strict: check the range values on the host (one copy, one sync) and
            raise ``ValueError`` naming the first bad slice. ``None`` follows
            the environment variable ``FLASHRANGE_STRICT``; off by default, so
            that no call waits for the GPU. Skipped under ``torch.compile``
            and CUDA-graph capture. Without it the kernels clamp every range.
        sink: optional `(S_sink, Hq)` learnable sink logits (float32; other
            float dtypes are upcast): extra logits in every row's softmax
            denominator that carry no value (GPT-OSS, MagiAttention's ``sink``).
            `lse` then includes them; a row no slice covers gets `out = 0` and
            `lse = logsumexp(sink[:, h])`. Differentiable (docs/features.md).
        return_max_logits: also return `max_logits`: `(Hq,)` float32 (float64
            for float64 inputs), each head's largest score (scaled and
            softcapped, sinks excluded) over every covered cell; `-inf` for a
            head with no covered cell. Not differentiable.

    Returns:
        `out`: `(Tq, Hq, Dv)` in q's dtype, and `lse`: `(Tq, Hq)` float32
        (float64 for float64 inputs; natural log; `-inf` on rows no slice
        covers, whose `out` is 0), then `max_logits` when asked for.
        Differentiable in q, k, v, `sink` (and through `lse`).
    """
    return attention(
        q, k, v, q_ranges, k_ranges, mask_types, softmax_scale=softmax_scale, softcap=softcap, plan=plan,
        strict=strict, sink=sink, return_max_logits=return_max_logits,
    )
