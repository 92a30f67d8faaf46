"""Exact merge of partial attention results through their log-sum-exp.

Attention over a set of keys split into disjoint parts can run part by part:
part ``j`` gives ``out_j`` (softmax-weighted values over its keys) and
``lse_j`` (log-sum-exp of its scores). The whole is

    lse = m + log(sum_j exp(lse_j - m)),  m = max_j lse_j
    out = sum_j exp(lse_j - lse) * out_j

which is exact up to reassociation. A row that no part covers (every
``lse_j = -inf``) stays ``out = 0``, ``lse = -inf``, never NaN.
"""

from __future__ import annotations

import torch

__all__ = ["merge_partials"]


def merge_partials(outs, lses):
    """Merge partial attention results over disjoint key sets.

    Args:
        outs: sequence of `(T, H, Dv)` tensors, one per part (same shape and
            dtype).
        lses: sequence of `(T, H)` tensors (natural log, ``-inf`` where the
            part covers nothing in the row), one per part.

    Returns:
        ``(out, lse)``: `out` `(T, H, Dv)` in the dtype of ``outs``, `lse`
        `(T, H)` in the widest dtype of ``lses``. The arithmetic runs in
        float32, or float64 when any input is float64; parts are added in
        list order (deterministic).

    Raises:
        ValueError: empty or mismatched lists.
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge_partials needs as many outs as lses, at least one; got {len(outs)} and {len(lses)}")
    shape = outs[0].shape
    for o, l in zip(outs, lses):
        if o.shape != shape or l.shape != shape[:2]:
            raise ValueError(
                f"every out must have shape {tuple(shape)} and every lse {tuple(shape[:2])}; "
                f"got {tuple(o.shape)} and {tuple(l.shape)}"
            )
    if len(outs) == 1:
        return outs[0], lses[0]
    wide = torch.float64 if any(t.dtype == torch.float64 for t in outs + lses) else torch.float32
    lse_dtype = torch.float64 if any(l.dtype == torch.float64 for l in lses) else lses[0].dtype
    lse_parts = [l.to(wide) for l in lses]
    m = lse_parts[0]
    for l in lse_parts[1:]:
        m = torch.maximum(m, l)
    # A row that no part covers has m = -inf: shift by 0 instead, so that
    # every exp() below is exp(-inf) = 0 and nothing becomes NaN.
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    weights = [torch.exp(l - m) for l in lse_parts]
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    lse = m + torch.log(total)
    covered = total > 0
    safe = torch.where(covered, total, torch.ones_like(total))
    out = None
    for w, o in zip(weights, outs):
        term = torch.where(covered, w / safe, torch.zeros_like(w)).unsqueeze(-1) * o.to(wide)
        out = term if out is None else out + term
    return out.to(outs[0].dtype), lse.to(lse_dtype)
