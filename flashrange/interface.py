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
    resolve_scale,
    strict_enabled,
    values_readable,
)

__all__ = ["range_attention", "plan_mask", "attention"]


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
    if ops.eager_cuda(q_ranges, k_ranges, mask_types):
        return ops.plan_eager(q_ranges, k_ranges, mask_types, Tq, Tk)
    return RangePlan(*ops.plan(q_ranges, k_ranges, mask_types, Tq, Tk))


def attention(
    q, k, v, q_ranges, k_ranges, mask_types, *, softmax_scale=None, softcap=0.0, plan=None, strict=None,
    names=RANGE_NAMES,
):
    """The entry below every front-end: checks, plan, op. ``names``: the caller's names of the three range tensors.

    Same arguments and result as :func:`range_attention`.
    """
    check_qkv(q, k, v)
    check_ranges(q_ranges, k_ranges, mask_types, q.device, names)
    softcap = check_scalars(softmax_scale, softcap)
    Tq, Tk = q.shape[0], k.shape[0]
    if strict_enabled(strict) and values_readable(q_ranges):
        check_range_values(q_ranges, k_ranges, mask_types, Tq, Tk, names)
    scale = resolve_scale(softmax_scale, q.shape[-1])
    if plan is not None:
        plan = check_plan(plan, mask_types.shape[0], Tq, Tk)
        if plan.q_slices.device != q.device:
            raise ValueError(f"the plan is on {plan.q_slices.device} but q is on {q.device}")
    if ops.eager_cuda(q, k, v, q_ranges, k_ranges, mask_types, *(plan or ())):
        if plan is None:
            plan = ops.plan_eager(q_ranges, k_ranges, mask_types, Tq, Tk)
        return ops.fwd_eager(q, k, v, q_ranges, k_ranges, mask_types, plan, scale, softcap)
    if plan is None:
        plan = ops.plan(q_ranges, k_ranges, mask_types, Tq, Tk)
    return ops.fwd(q, k, v, q_ranges, k_ranges, mask_types, list(plan), scale, softcap)


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
):
    """Attention over a mask written as ranges (docs/design.md, "Semantics").

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

    Returns:
        `out`: `(Tq, Hq, Dv)` in q's dtype, and `lse`: `(Tq, Hq)` float32
        (float64 for float64 inputs; natural log; `-inf` on rows no slice
        covers, whose `out` is 0). Differentiable in q, k, v (and through `lse`).
    """
    return attention(
        q, k, v, q_ranges, k_ranges, mask_types, softmax_scale=softmax_scale, softcap=softcap, plan=plan,
        strict=strict,
    )
