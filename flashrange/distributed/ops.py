"""The ``flashrange_cp`` torch.library ops: context-parallel attention and undispatch.

Communication lives inside registered ops so that ``torch.compile`` traces a
training step with ``fullgraph=True``: the compiler sees an opaque op with a
fake implementation (shapes only) and an autograd formula, and never a
process group. The ops:

- ``flashrange_cp::attn_fwd(q, k, v, send_index, meta, ranges, plans, group, recv_capacity,
  softmax_scale, softcap, overlap) -> (out, lse, k_remote, v_remote)``
- ``flashrange_cp::attn_bwd(dout, dlse, q, k, v, k_remote, v_remote, out, lse, send_index, meta,
  ranges, plans, group, softmax_scale, softcap, overlap) -> (dq, dk, dv)``
- ``flashrange_cp::undispatch(x_local, local_index, inverse_index, group) -> x``

``meta`` is a small int64 *host* tensor (stage flags and split sizes): the
op reads it without a device sync, and a new mask with the same capacities
is new tensor values, not a new graph. ``ranges`` are the three local slice
lists of :class:`~flashrange.distributed.planner.LocalRanges` (combined,
local, remote: nine tensors) and ``plans`` their three
:class:`flashrange.RangePlan` (24 tensors), built once per mask.

Attention itself is :func:`flashrange.range_attention` (forward) and the
registered ``flashrange::bwd`` op (backward, with the merged ``out`` and
``lse``: the flash backward of a key subset with the global softmax
statistics is that subset's exact share of the gradient).

Process groups cannot be op arguments: :func:`register_group` keeps them in
a table under their ``group_name``, which the ops receive as a string.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import flashrange
from flashrange import ops as fr_ops

from .merge import merge_partials

__all__ = ["register_group", "attn_fwd", "attn_bwd", "undispatch", "META_FIELDS"]

_GROUPS: dict = {}

# Leading fields of ``meta``; the send splits (W ints) and the receive splits
# (W ints) follow.
META_FIELDS = ("has_combined", "has_local", "has_remote", "communicate")
_HAS_COMBINED, _HAS_LOCAL, _HAS_REMOTE, _COMMUNICATE = range(4)

# Offsets of the three slice lists in ``ranges`` (three tensors each) and of
# their plans in ``plans`` (eight tensors each).
COMBINED, LOCAL, REMOTE = 0, 1, 2
_PLAN_LEN = len(flashrange.RangePlan._fields)


def register_group(group) -> str:
    """Make ``group`` reachable from the ops; returns the name to pass them."""
    name = group.group_name
    _GROUPS[name] = group
    return name


def _group(name: str):
    try:
        return _GROUPS[name]
    except KeyError:
        raise RuntimeError(
            f"process group {name!r} is not registered with flashrange.distributed; build a ContextParallel "
            "on it in this process first"
        ) from None


class _Meta:
    def __init__(self, meta: torch.Tensor):
        vals = meta.tolist()  # a host tensor: no device sync
        head = len(META_FIELDS)
        W = (len(vals) - head) // 2
        self.has_combined, self.has_local, self.has_remote, self.communicate = (bool(x) for x in vals[:head])
        self.send_splits = vals[head:head + W]
        self.recv_splits = vals[head + W:]
        self.world_size = W


def _stage(ranges, plans, which):
    return ranges[3 * which:3 * which + 3], plans[_PLAN_LEN * which:_PLAN_LEN * (which + 1)]


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_result(q, v):
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=_acc(q.dtype), device=q.device)
    return out, lse


def _attend(q, k, v, ranges, plans, which, scale, softcap):
    (qr, kr, mt), plan = _stage(ranges, plans, which)
    return flashrange.range_attention(
        q, k, v, qr, kr, mt, softmax_scale=scale, softcap=softcap, plan=flashrange.RangePlan(*plan)
    )


def _attend_bwd(dout, dlse, q, k, v, out, lse, ranges, plans, which, scale, softcap):
    (qr, kr, mt), plan = _stage(ranges, plans, which)
    return fr_ops.bwd(dout, dlse, q, k, v, out, lse, qr, kr, mt, list(plan), scale, softcap)


def _all_to_all(tensors, outputs, out_splits, in_splits, group):
    """Start one ``all_to_all_single`` per tensor (asynchronous); returns the works."""
    return [
        dist.all_to_all_single(o, t, out_splits, in_splits, group=group, async_op=True)
        for t, o in zip(tensors, outputs)
    ]


def _wait(works):
    for w in works:
        w.wait()


# ------------------------------------------------------------------ forward


@torch.library.custom_op("flashrange_cp::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    send_index: torch.Tensor,
    meta: torch.Tensor,
    ranges: list[torch.Tensor],
    plans: list[torch.Tensor],
    group: str,
    recv_capacity: int,
    softmax_scale: float,
    softcap: float,
    overlap: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m = _Meta(meta)
    k_remote = k.new_zeros(recv_capacity, k.shape[1], k.shape[2])
    v_remote = v.new_zeros(recv_capacity, v.shape[1], v.shape[2])
    works = []
    if m.communicate:
        n_send, n_recv = sum(m.send_splits), sum(m.recv_splits)
        idx = send_index[:n_send]
        # One collective per tensor: k and v stay separate buffers end to end.
        works = _all_to_all(
            [k.index_select(0, idx), v.index_select(0, idx)], [k_remote[:n_recv], v_remote[:n_recv]],
            m.recv_splits, m.send_splits, _group(group),
        )
    if overlap:
        # The local keys need no communication: attend to them while the
        # remote keys travel (gloo runs the collective on its own threads,
        # NCCL on its own stream), then merge the two parts through lse.
        parts = []
        if m.has_local:
            parts.append(_attend(q, k, v, ranges, plans, LOCAL, softmax_scale, softcap))
        _wait(works)
        if m.has_remote:
            parts.append(_attend(q, k_remote, v_remote, ranges, plans, REMOTE, softmax_scale, softcap))
        out, lse = merge_partials(*zip(*parts)) if parts else _empty_result(q, v)
    else:
        _wait(works)
        if m.has_combined:
            out, lse = _attend(
                q, torch.cat([k, k_remote]), torch.cat([v, v_remote]), ranges, plans, COMBINED, softmax_scale,
                softcap,
            )
        else:
            out, lse = _empty_result(q, v)
    return out, lse, k_remote, v_remote


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, send_index, meta, ranges, plans, group, recv_capacity, softmax_scale, softcap, overlap):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=_acc(q.dtype))
    return out, lse, k.new_empty(recv_capacity, k.shape[1], k.shape[2]), v.new_empty(
        recv_capacity, v.shape[1], v.shape[2]
    )


# ------------------------------------------------------------------ backward


@torch.library.custom_op(
    "flashrange_cp::attn_bwd",
    mutates_args=(),
    schema="(Tensor dout, Tensor dlse, Tensor q, Tensor k, Tensor v, Tensor k_remote, Tensor v_remote, Tensor out, "
    "Tensor lse, Tensor send_index, Tensor meta, Tensor[] ranges, Tensor[] plans, str group, float softmax_scale, "
    "float softcap, bool overlap) -> (Tensor, Tensor, Tensor)",
)
def attn_bwd(
    dout, dlse, q, k, v, k_remote, v_remote, out, lse, send_index, meta, ranges, plans, group, softmax_scale, softcap,
    overlap,
):
    m = _Meta(meta)
    acc = _acc(q.dtype)
    n_send, n_recv = sum(m.send_splits), sum(m.recv_splits)
    args = (softmax_scale, softcap)
    dk_back = k.new_zeros(n_send, k.shape[1], k.shape[2])
    dv_back = v.new_zeros(n_send, v.shape[1], v.shape[2])
    works = []

    def send_back(dk_remote, dv_remote):
        # The reverse exchange: the gradients of the keys received go back to
        # their owners, which get them in the order of their send_index.
        if m.communicate:
            works.extend(_all_to_all(
                [dk_remote[:n_recv].contiguous(), dv_remote[:n_recv].contiguous()], [dk_back, dv_back],
                m.send_splits, m.recv_splits, _group(group),
            ))

    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    if overlap:
        # Remote part first, so that its gradients travel home while the
        # local part computes.
        if m.has_remote:
            dq_r, dk_r, dv_r = _attend_bwd(dout, dlse, q, k_remote, v_remote, out, lse, ranges, plans, REMOTE, *args)
            dq += dq_r
        else:
            dk_r, dv_r = torch.zeros_like(k_remote), torch.zeros_like(v_remote)
        send_back(dk_r, dv_r)
        if m.has_local:
            dq_l, dk, dv = _attend_bwd(dout, dlse, q, k, v, out, lse, ranges, plans, LOCAL, *args)
            dq += dq_l
        else:
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    else:
        if m.has_combined:
            dq_c, dkb, dvb = _attend_bwd(
                dout, dlse, q, torch.cat([k, k_remote]), torch.cat([v, v_remote]), out, lse, ranges, plans, COMBINED,
                *args,
            )
            dq += dq_c
            T = k.shape[0]
            # Copies: the results must not be views of one buffer.
            dk, dv = dkb[:T].to(acc, copy=True), dvb[:T].to(acc, copy=True)
            dk_r, dv_r = dkb[T:], dvb[T:]
        else:
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            dk_r, dv_r = torch.zeros_like(k_remote), torch.zeros_like(v_remote)
        send_back(dk_r, dv_r)
    dk, dv = dk.to(acc), dv.to(acc)
    _wait(works)
    # Sum the returned gradients destination by destination, in rank order:
    # within one destination the indices are distinct, so every index_add_
    # is free of races and the result is bitwise reproducible.
    start = 0
    for n in m.send_splits:
        if n:
            idx = send_index[start:start + n]
            dk.index_add_(0, idx, dk_back[start:start + n].to(acc))
            dv.index_add_(0, idx, dv_back[start:start + n].to(acc))
        start += n
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, dlse, q, k, v, k_remote, v_remote, out, lse, send_index, meta, ranges, plans, group,
                   softmax_scale, softcap, overlap):
    fmt = torch.contiguous_format
    return torch.empty_like(q, memory_format=fmt), torch.empty_like(k, memory_format=fmt), torch.empty_like(
        v, memory_format=fmt
    )


def _fwd_setup(ctx, inputs, output):
    q, k, v, send_index, meta, ranges, plans, group, recv_capacity, softmax_scale, softcap, overlap = inputs
    out, lse, k_remote, v_remote = output
    ctx.save_for_backward(q, k, v, k_remote, v_remote, out, lse, send_index, meta, *ranges, *plans)
    ctx.n_ranges = len(ranges)
    ctx.statics = (group, softmax_scale, softcap, overlap)


def _fwd_backward(ctx, dout, dlse, _dk_remote, _dv_remote):
    q, k, v, k_remote, v_remote, out, lse, send_index, meta, *rest = ctx.saved_tensors
    ranges, plans = rest[:ctx.n_ranges], rest[ctx.n_ranges:]
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dk, dv = attn_bwd(
        dout.contiguous(), dlse.contiguous(), q, k, v, k_remote, v_remote, out, lse, send_index, meta, list(ranges),
        list(plans), *ctx.statics,
    )
    return dq, dk, dv, None, None, [None] * len(ranges), [None] * len(plans), None, None, None, None, None


attn_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ------------------------------------------------------------------ undispatch


@torch.library.custom_op("flashrange_cp::undispatch", mutates_args=())
def undispatch(
    x_local: torch.Tensor, local_index: torch.Tensor, inverse_index: torch.Tensor, group: str
) -> torch.Tensor:
    pg = _group(group)
    W = dist.get_world_size(pg)
    x_local = x_local.contiguous()
    gathered = x_local.new_empty((W * x_local.shape[0],) + tuple(x_local.shape[1:]))
    if W == 1:
        gathered.copy_(x_local)
    else:
        dist.all_gather(list(gathered.chunk(W)), x_local, group=pg)
    return gathered.index_select(0, inverse_index)


@undispatch.register_fake
def _undispatch_fake(x_local, local_index, inverse_index, group):
    return x_local.new_empty((inverse_index.shape[0],) + tuple(x_local.shape[1:]))


def _undispatch_setup(ctx, inputs, output):
    x_local, local_index, inverse_index, group = inputs
    ctx.save_for_backward(local_index)
    ctx.total = inverse_index.shape[0]


def _undispatch_backward(ctx, grad):
    # Every rank holds the same global result (and, by convention, the same
    # loss on it): the gradient of a local token is the global gradient at
    # its position; padding tokens get zero. No communication.
    (local_index,) = ctx.saved_tensors
    real = local_index < ctx.total
    g = grad.index_select(0, local_index.clamp(max=ctx.total - 1))
    g = torch.where(real.view((-1,) + (1,) * (g.dim() - 1)), g, torch.zeros_like(g))
    return g, None, None, None


undispatch.register_autograd(_undispatch_backward, setup_context=_undispatch_setup)
