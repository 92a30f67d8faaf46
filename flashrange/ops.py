"""The ``flashrange`` torch.library ops: schema, kernels per device, fake impls, autograd.

Four ops carry everything (docs/design.md §4, §7):

- ``flashrange::plan(q_ranges, k_ranges, mask_types, Tq, Tk) -> RangePlan`` (8 int32 tensors)
- ``flashrange::fwd(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap) -> (out, lse)``
- ``flashrange::bwd(dout, dlse?, q, k, v, out, lse, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap)
  -> (dq, dk, dv)``
- ``flashrange::fwd_max_logits``: ``fwd``'s arguments ``-> (out, lse, max_logits)``, the same
  attention plus each head's largest score (not differentiable; same backward).
  A separate op keeps ``fwd``'s schema and its kernel untouched when max logits are not asked for.

CPU tensors (and any device without a dedicated kernel) run the reference in
:mod:`flashrange.reference`, which reads the ranges and ignores the plan.
CUDA tensors run the Triton kernels of :mod:`flashrange.kernels`, which walk
the plan, when Triton is importable and the dtype is one they serve
(float64 always runs the reference). The forward saves the plan for the
backward, so a training step plans each mask once.

Arguments are resolved before the ops (the front-ends do it through
:mod:`flashrange.interface`): the schema holds no optional argument.
"""

from __future__ import annotations

import contextlib

import torch

from . import reference
from .constants import KERNEL_DTYPES
from .plan import RangePlan, build_plan_torch, plan_blocks

__all__ = ["plan", "fwd", "fwd_max_logits", "bwd", "plain_cuda", "eager_cuda", "plan_eager", "fwd_eager"]


_TRITON_IMPORTABLE = None


def _triton_serves(dtype: torch.dtype) -> bool:
    """Whether the Triton kernels serve CUDA tensors of ``dtype`` (Triton importable: asked once)."""
    global _TRITON_IMPORTABLE
    if dtype not in KERNEL_DTYPES:
        return False
    if _TRITON_IMPORTABLE is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            _TRITON_IMPORTABLE = False
        else:
            _TRITON_IMPORTABLE = True
    return _TRITON_IMPORTABLE


@torch.library.custom_op("flashrange::plan", mutates_args=())
def plan(
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, mask_types: torch.Tensor, Tq: int, Tk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(build_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk))


@plan.register_kernel("cuda")
def _plan_cuda(q_ranges, k_ranges, mask_types, Tq, Tk):
    try:
        from .kernels.plan import build_plan_triton
    except ImportError:
        return tuple(build_plan_torch(q_ranges, k_ranges, mask_types, Tq, Tk))
    # Triton launches on the current device; the ranges may live on another one.
    other_device = q_ranges.device.index != torch.cuda.current_device()
    with torch.cuda.device(q_ranges.device) if other_device else contextlib.nullcontext():
        return tuple(build_plan_triton(q_ranges, k_ranges, mask_types, Tq, Tk))


@plan.register_fake
def _plan_fake(q_ranges, k_ranges, mask_types, Tq, Tk):
    S = mask_types.shape[0]
    nq, nk = plan_blocks(Tq), plan_blocks(Tk)
    new = q_ranges.new_empty
    i32 = torch.int32
    return (
        new(S, 5, dtype=i32), new(nq, dtype=i32), new(nq, dtype=i32), new(nq, dtype=i32),
        new(S, 5, dtype=i32), new(nk, dtype=i32), new(nk, dtype=i32), new(nk, dtype=i32),
    )


@torch.library.custom_op("flashrange::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    mask_types: torch.Tensor,
    plan: list[torch.Tensor],
    softmax_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.range_attention_forward(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap)


@fwd.register_kernel("cuda")
def _fwd_cuda(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap):
    if _triton_serves(q.dtype):
        from .kernels.forward import range_attention_forward_triton

        return range_attention_forward_triton(
            q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap, plan=RangePlan(*plan)
        )
    return reference.range_attention_forward(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap)


@fwd.register_fake
def _fwd_fake(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    # The reference keeps float64 inputs in float64 (lse included).
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse


@torch.library.custom_op("flashrange::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    mask_types: torch.Tensor,
    plan: list[torch.Tensor],
    softmax_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.range_attention_backward(
        dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse
    )


@bwd.register_kernel("cuda")
def _bwd_cuda(dout, dlse, q, k, v, out, lse, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap):
    if _triton_serves(q.dtype):
        from .kernels.backward import range_attention_backward_triton

        return range_attention_backward_triton(
            dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse,
            plan=RangePlan(*plan),
        )
    return reference.range_attention_backward(
        dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse
    )


@bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap):
    # Contiguous like the real kernels' results: empty_like would keep the
    # strides of a permuted (dense) q and mislead the compiled graph's layout.
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


def _fwd_max_logits_reference(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap):
    out, lse = reference.range_attention_forward(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap)
    max_logits = reference.range_attention_max_logits(q, k, q_ranges, k_ranges, mask_types, softmax_scale, softcap)
    return out, lse, max_logits


# fwd's arguments (its schema, spelled out) with a third result: the reference serves CPU and other devices.
fwd_max_logits = torch.library.custom_op(
    "flashrange::fwd_max_logits",
    _fwd_max_logits_reference,
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor q_ranges, Tensor k_ranges, Tensor mask_types, Tensor[] plan, "
    "float softmax_scale, float softcap) -> (Tensor, Tensor, Tensor)",
)


@fwd_max_logits.register_kernel("cuda")
def _fwd_max_logits_cuda(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap):
    if _triton_serves(q.dtype):
        from .kernels.forward import range_attention_forward_triton

        return range_attention_forward_triton(
            q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap, plan=RangePlan(*plan),
            return_max_logits=True,
        )
    return _fwd_max_logits_reference(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap)


@fwd_max_logits.register_fake
def _fwd_max_logits_fake(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap):
    out, lse = _fwd_fake(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap)
    return out, lse, lse.new_empty(q.shape[1])


def _setup_context(ctx, inputs, output):
    q, k, v, q_ranges, k_ranges, mask_types, plan_tensors, softmax_scale, softcap = inputs
    out, lse = output[:2]
    if len(output) > 2:
        # max_logits: a statistic of the scores, not differentiable (as in MagiAttention).
        ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, mask_types, *plan_tensors)
    ctx.softmax_scale = softmax_scale
    ctx.softcap = softcap


def _gradients(bwd_fn, saved, dout, dlse, softmax_scale, softcap):
    """``(dq, dk, dv)`` of one forward from its saved tensors, through ``bwd_fn`` (the op or its CUDA kernel)."""
    q, k, v, out, lse, q_ranges, k_ranges, mask_types, *plan_tensors = saved
    if dout is None:
        dout = torch.zeros_like(out)
    # No gradient through lse (the usual case): None, and the kernels skip that term.
    dlse = None if dlse is None else dlse.contiguous()
    return bwd_fn(
        dout.contiguous(), dlse, q, k, v, out, lse, q_ranges, k_ranges, mask_types, plan_tensors, softmax_scale, softcap,
    )


def _backward(ctx, dout, dlse, *unused):
    # ctx.saved_tensors once: non-reentrant activation checkpointing unpacks each saved tensor only once.
    saved = ctx.saved_tensors
    dq, dk, dv = _gradients(bwd, saved, dout, dlse, ctx.softmax_scale, ctx.softcap)
    return dq, dk, dv, None, None, None, [None] * (len(saved) - 8), None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
fwd_max_logits.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Eager CUDA calls: the same implementations, without the dispatcher.
#
# A call through a torch.library custom op pays for the dispatcher, the autograd
# wrapper and dynamo's guard around the backend on every call: more than the
# kernels of a short sequence take. Eager calls on plain CUDA tensors therefore
# run the very functions registered above through a torch.autograd.Function
# (same kernels, same plan, bitwise the same results); traced calls
# (torch.compile, export, fake or functional tensors) keep the ops.


def plain_cuda(*tensors) -> bool:
    """Whether these are plain CUDA tensors, not under tracing: the eager path's condition for planning."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if type(t) is not torch.Tensor:
            return False
    return tensors[0].is_cuda


def eager_cuda(*tensors) -> bool:
    """Whether these tensors can take the eager attention path: :func:`plain_cuda`, and the first one's
    dtype served by the Triton kernels."""
    return plain_cuda(*tensors) and _triton_serves(tensors[0].dtype)


def plan_eager(q_ranges, k_ranges, mask_types, Tq, Tk) -> RangePlan:
    """``flashrange::plan``'s CUDA implementation, called directly (see :func:`plain_cuda`)."""
    return RangePlan(*_plan_cuda(q_ranges, k_ranges, mask_types, Tq, Tk))


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap, *plan_tensors):
        out, lse = _fwd_cuda(q, k, v, q_ranges, k_ranges, mask_types, plan_tensors, softmax_scale, softcap)
        ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, mask_types, *plan_tensors)
        ctx.softmax_scale = softmax_scale
        ctx.softcap = softcap
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse, *unused):
        saved = ctx.saved_tensors  # once, as in _backward
        dq, dk, dv = _gradients(_bwd_cuda, saved, dout, dlse, ctx.softmax_scale, ctx.softcap)
        return (dq, dk, dv, None, None, None, None, None) + (None,) * (len(saved) - 8)


class _EagerAttentionMaxLogits(_EagerAttention):
    """:class:`_EagerAttention` that also returns max logits (``flashrange::fwd_max_logits``); same backward."""

    @staticmethod
    def forward(ctx, q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap, *plan_tensors):
        out, lse, max_logits = _fwd_max_logits_cuda(
            q, k, v, q_ranges, k_ranges, mask_types, plan_tensors, softmax_scale, softcap
        )
        ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, mask_types, *plan_tensors)
        ctx.softmax_scale = softmax_scale
        ctx.softcap = softcap
        ctx.mark_non_differentiable(max_logits)
        return out, lse, max_logits


def fwd_eager(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap, return_max_logits=False):
    """``flashrange::fwd`` (``fwd_max_logits`` if asked) with its autograd, called directly (see :func:`eager_cuda`)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        fn = _EagerAttentionMaxLogits if return_max_logits else _EagerAttention
        return fn.apply(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap, *plan)
    if return_max_logits:
        return _fwd_max_logits_cuda(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap)
    return _fwd_cuda(q, k, v, q_ranges, k_ranges, mask_types, plan, softmax_scale, softcap)
