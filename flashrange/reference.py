"""Reference implementation of range attention (docs/design.md §2).

Dumb and obviously right: float32 math in plain PyTorch, on any device
(float64 math, and a float64 ``lse``, for float64 inputs, so that tests can
check it against a float64 golden result to ~1e-10). It is
the CPU implementation of the ``flashrange`` ops and the oracle for every test
of the Triton kernels, which share its signatures.

Memory stays bounded: query rows are processed in chunks, so the largest
temporary is ``(Hq, chunk, Tk)`` float32, never ``(Tq, Tk)`` for large inputs.

Ranges are clamped to the tensors and unknown mask types contribute nothing,
exactly as the kernels do with garbage ranges (strict mode validates and
raises before reaching this code). Tokens that no slice covers never enter
the arithmetic: a NaN or Inf in them cannot reach a covered row, as in the
kernels, which never load them.
"""

from __future__ import annotations

import math

import torch

from .constants import CAUSAL, FULL, INV_CAUSAL, MASK_TYPES

__all__ = ["range_attention_forward", "range_attention_backward", "range_attention_max_logits", "coverage_counts"]

# Upper bound on the elements of one (Hq, chunk, Tk) float32 score block.
_CHUNK_ELEMENTS = 1 << 24


def _clamped_slices(q_ranges, k_ranges, mask_types, Tq, Tk):
    """Host list of non-empty slices ``(qs, qe, ks, ke, type)``, clamped to the tensors."""
    out = []
    qr = q_ranges.reshape(-1, 2).tolist()
    kr = k_ranges.reshape(-1, 2).tolist()
    mt = mask_types.reshape(-1).tolist()
    for (qs, qe), (ks, ke), t in zip(qr, kr, mt):
        qs, qe = min(max(qs, 0), Tq), min(max(qe, 0), Tq)
        ks, ke = min(max(ks, 0), Tk), min(max(ke, 0), Tk)
        if qe <= qs or ke <= ks or t not in MASK_TYPES:
            continue
        out.append((qs, qe, ks, ke, t))
    return out


def _slice_cells(qs, qe, ks, ke, t, rows, device):
    """Bool ``(len(rows), ke - ks)``: which cells of rows ``rows`` the slice covers."""
    i = rows.to(device).unsqueeze(1) - qs
    j = torch.arange(ke - ks, device=device).unsqueeze(0)
    lq, lk = qe - qs, ke - ks
    inside = (i >= 0) & (i < lq)
    if t == FULL:
        return inside.expand(-1, lk)
    below = j <= i + (lk - lq)
    above = j >= i
    if t == CAUSAL:
        return inside & below
    if t == INV_CAUSAL:
        return inside & above
    return inside & below & above


def _acc_dtype(dtype):
    """Math dtype: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_counts(slices, row0, row1, Tk, device, dtype=torch.float32):
    """Float ``(row1 - row0, Tk)``: how many slices cover each cell of the rows."""
    cnt = torch.zeros(row1 - row0, Tk, dtype=dtype, device=device)
    rows = torch.arange(row0, row1, device=device)
    for qs, qe, ks, ke, t in slices:
        if qe <= row0 or qs >= row1:
            continue
        cnt[:, ks:ke] += _slice_cells(qs, qe, ks, ke, t, rows, device).to(dtype)
    return cnt


def coverage_counts(q_ranges, k_ranges, mask_types, Tq, Tk):
    """Int32 ``(Tq, Tk)``: how many slices cover each cell (overlaps count twice).

    Dense: meant for tests and pictures of small masks.
    """
    slices = _clamped_slices(q_ranges, k_ranges, mask_types, Tq, Tk)
    return _chunk_counts(slices, 0, Tq, Tk, q_ranges.device).to(torch.int32)


def _used_only(qc, kf, vf, cnt, doc=None):
    """Zero the query rows and keys of a chunk that no slice covers (their values never count)."""
    row_used = (cnt > 0).any(dim=1)
    key_used = (cnt > 0).any(dim=0)
    qc = torch.where(row_used[:, None, None], qc, 0.0)
    kf = torch.where(key_used[:, None, None], kf, 0.0)
    vf = torch.where(key_used[:, None, None], vf, 0.0)
    if doc is None:
        return qc, kf, vf
    return qc, kf, vf, torch.where(row_used[:, None, None], doc, 0.0)


def _chunk_rows(Hq, Tk):
    return max(1, min(1024, _CHUNK_ELEMENTS // max(1, Hq * Tk)))


def _scores(qc, k, scale, softcap):
    """Float32 scores ``(Hkv, G, C, Tk)`` of a query chunk ``(C, Hkv, G, D)``."""
    s = torch.einsum("cngd,knd->ngck", qc, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return s


def _check_shapes(q, k, v):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("q, k, v must be (T, H, D) tensors")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]}")


def _chunk_scores(q, kf, vf, slices, Tk, scale, softcap):
    """Per chunk of query rows with a covered cell: ``(r0, r1, counts, v, scores)``.

    ``counts`` `(C, Tk)` are the chunk's cover counts; ``v`` is ``vf`` with the
    keys no row of the chunk reads zeroed; ``scores`` `(Hkv, G, C, Tk)` are in
    the math dtype, from q and k with the uncovered rows and keys zeroed.
    """
    Tq, Hq, D = q.shape
    Hkv = kf.shape[1]
    step = _chunk_rows(Hq, Tk)
    for r0 in range(0, Tq, step):
        r1 = min(Tq, r0 + step)
        cnt = _chunk_counts(slices, r0, r1, Tk, q.device, kf.dtype)
        if not bool((cnt > 0).any()):
            continue
        qc, kc, vc = _used_only(q[r0:r1].to(kf.dtype), kf, vf, cnt)
        yield r0, r1, cnt, vc, _scores(qc.view(r1 - r0, Hkv, Hq // Hkv, D), kc, scale, softcap)


def range_attention_forward(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale=None, softcap=0.0):
    """Reference forward.

    `q`: `(Tq, Hq, D)`, `k`: `(Tk, Hkv, D)`, `v`: `(Tk, Hkv, Dv)`,
    `q_ranges`, `k_ranges`: `(S, 2)` int32, `mask_types`: `(S,)` int32.
    Returns `out`: `(Tq, Hq, Dv)` in q's dtype and `lse`: `(Tq, Hq)` float32
    (float64 for float64 inputs).
    """
    _check_shapes(q, k, v)
    Tq, Hq, D = q.shape
    Tk, Dv = v.shape[0], v.shape[2]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    dev = q.device
    acc = _acc_dtype(q.dtype)
    out = torch.zeros(Tq, Hq, Dv, dtype=acc, device=dev)
    lse = torch.full((Tq, Hq), float("-inf"), dtype=acc, device=dev)
    slices = _clamped_slices(q_ranges, k_ranges, mask_types, Tq, Tk)
    if not slices or Tq == 0 or Tk == 0:
        return out.to(q.dtype), lse
    for r0, r1, cnt, vc, s in _chunk_scores(q, k.to(acc), v.to(acc), slices, Tk, scale, softcap):
        # log(0) = -inf removes uncovered cells (where(): a NaN score there stays out).
        logits = torch.where(cnt > 0, s + torch.log(cnt), float("-inf"))
        m = logits.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(logits - m)
        l = p.sum(dim=-1, keepdim=True)
        o = torch.einsum("ngck,knd->cngd", p, vc)
        l_c = l.squeeze(-1).permute(2, 0, 1).unsqueeze(-1)  # (C, Hkv, G, 1)
        # l = 0 only on rows with no covered cell; a NaN l (NaN in a covered input) propagates.
        o = torch.where(l_c != 0, o / l_c.clamp_min(1e-30), torch.zeros_like(o))
        out[r0:r1] = o.reshape(r1 - r0, Hq, Dv)
        lse[r0:r1] = (m + torch.log(l)).squeeze(-1).permute(2, 0, 1).reshape(r1 - r0, Hq)
    return out.to(q.dtype), lse


def range_attention_backward(
    dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale=None, softcap=0.0, dlse=None
):
    """Reference backward: returns `(dq, dk, dv)` in the dtypes of `q, k, v`.

    `dout`: `(Tq, Hq, Dv)`, `out`: `(Tq, Hq, Dv)`, `lse`: `(Tq, Hq)` float32 as
    the forward returned them; `dlse`: optional `(Tq, Hq)` gradient of `lse`.
    """
    _check_shapes(q, k, v)
    Tq, Hq, D = q.shape
    Tk, Hkv, Dv = v.shape
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    dev = q.device
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(Tq, Hq, D, dtype=acc, device=dev)
    dk = torch.zeros(Tk, Hkv, D, dtype=acc, device=dev)
    dv = torch.zeros(Tk, Hkv, Dv, dtype=acc, device=dev)
    slices = _clamped_slices(q_ranges, k_ranges, mask_types, Tq, Tk)
    if slices and Tq > 0 and Tk > 0:
        kf, vf = k.to(acc), v.to(acc)
        # delta_i = sum_d dO_i * O_i - dlse_i: the softmax Jacobian's row term
        # (kept only on covered rows, below).
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        step = _chunk_rows(Hq, Tk)
        for r0 in range(0, Tq, step):
            r1 = min(Tq, r0 + step)
            C = r1 - r0
            cnt = _chunk_counts(slices, r0, r1, Tk, dev, acc)
            if not bool((cnt > 0).any()):
                continue
            qc, kc, vc, do_c = _used_only(q[r0:r1].to(acc), kf, vf, cnt, dout[r0:r1].to(acc))
            qc = qc.view(C, Hkv, G, D)
            s = _scores(qc, kc, scale, softcap)
            lse_c = lse[r0:r1].to(acc).view(C, Hkv, G).permute(1, 2, 0).unsqueeze(-1)
            # lse = -inf (no covered cell) -> p = 0; a NaN lse (NaN in a covered input) propagates.
            lse_safe = torch.where(lse_c == float("-inf"), torch.full_like(lse_c, float("inf")), lse_c)
            # Rows with lse = -inf get p = 0; where(): a NaN score on an uncovered cell stays out.
            p = torch.where(cnt > 0, cnt * torch.exp(s - lse_safe), 0.0)
            do_c = do_c.view(C, Hkv, G, Dv)
            dv += torch.einsum("ngck,cngd->knd", p, do_c)
            dp = torch.einsum("cngd,knd->ngck", do_c, vc)
            row_used = (cnt > 0).any(dim=1)[:, None]
            delta_c = torch.where(row_used, delta[r0:r1], 0.0)
            delta_c = delta_c.view(C, Hkv, G).permute(1, 2, 0).unsqueeze(-1)
            ds = p * (dp - delta_c)
            if softcap > 0:
                ds = torch.where(cnt > 0, ds * (1.0 - (s / softcap) ** 2), 0.0)
            ds = ds * scale
            dq[r0:r1] = torch.einsum("ngck,knd->cngd", ds, kc).reshape(C, Hq, D)
            dk += torch.einsum("ngck,cngd->knd", ds, qc)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def range_attention_max_logits(q, k, q_ranges, k_ranges, mask_types, softmax_scale=None, softcap=0.0):
    """Reference max logits: per query head, the largest score over every covered cell.

    `q`: `(Tq, Hq, D)`, `k`: `(Tk, Hkv, D)`; ranges and types as in
    :func:`range_attention_forward`. Scores are scaled and softcapped as in the
    forward, with no weight for overlaps (a cell covered twice has one score).
    Returns `(Hq,)` float32 (float64 for float64 inputs); `-inf` for a head with
    no covered cell (that is, when the mask covers nothing).
    """
    _check_shapes(q, k, k)
    Tq, Hq, D = q.shape
    Tk = k.shape[0]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    dev = q.device
    acc = _acc_dtype(q.dtype)
    best = torch.full((Hq,), float("-inf"), dtype=acc, device=dev)
    slices = _clamped_slices(q_ranges, k_ranges, mask_types, Tq, Tk)
    if not slices or Tq == 0 or Tk == 0:
        return best
    kf = k.to(acc)
    # Uncovered tokens stay out of the products, as in the forward.
    for _, _, cnt, _, s in _chunk_scores(q, kf, kf, slices, Tk, scale, softcap):
        s = torch.where(cnt > 0, s, float("-inf"))
        best = torch.maximum(best, s.amax(dim=(2, 3)).reshape(Hq))
    return best
