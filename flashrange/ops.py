"""The ``flashrange`` torch.library ops: schema, kernels per device, fake impls, autograd.

Two ops carry everything (DESIGN §4, §5):

- ``flashrange::fwd(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap) -> (out, lse)``
- ``flashrange::bwd(dout, dlse, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap) -> (dq, dk, dv)``

CPU tensors (and any device without a dedicated kernel) run the reference in
:mod:`flashrange.reference`. **CUDA slot**: CUDA tensors run the Triton
kernels of :mod:`flashrange.kernels` when Triton is importable, and the
reference otherwise; a kernel family is plugged in by
``_fwd_cuda`` / ``_bwd_cuda`` below, with the reference's signature.

``softmax_scale`` is always resolved to a float before the op (the front-ends
do it), so the schema holds no optional arguments.
"""

from __future__ import annotations

import torch

from . import reference

__all__ = ["fwd", "bwd"]


def _triton_available(dtype: torch.dtype) -> bool:
    """Whether the Triton kernels serve this call: 2-byte and fp32 inputs, Triton importable.

    float64 (used by tests for golden results) always runs the reference.
    """
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.library.custom_op("flashrange::fwd", mutates_args=())
def fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    mask_types: torch.Tensor,
    softmax_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.range_attention_forward(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap)


@fwd.register_kernel("cuda")
def _fwd_cuda(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap):
    if _triton_available(q.dtype):
        from .kernels.forward import range_attention_forward_triton

        return range_attention_forward_triton(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap)
    return reference.range_attention_forward(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap)


@fwd.register_fake
def _fwd_fake(q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    # The reference keeps float64 inputs in float64 (lse included).
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out, lse


@torch.library.custom_op("flashrange::bwd", mutates_args=())
def bwd(
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    mask_types: torch.Tensor,
    softmax_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return reference.range_attention_backward(
        dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse
    )


@bwd.register_kernel("cuda")
def _bwd_cuda(dout, dlse, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap):
    if _triton_available(q.dtype):
        try:
            from .kernels.backward import range_attention_backward_triton
        except ImportError:  # the backward kernels have not landed yet
            range_attention_backward_triton = None
        if range_attention_backward_triton is not None:
            return range_attention_backward_triton(
                dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse
            )
    return reference.range_attention_backward(
        dout, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap, dlse
    )


@bwd.register_fake
def _bwd_fake(dout, dlse, q, k, v, out, lse, q_ranges, k_ranges, mask_types, softmax_scale, softcap):
    # Contiguous like the real kernels' results: empty_like would keep the
    # strides of a permuted (dense) q and mislead the compiled graph's layout.
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
        torch.empty_like(v, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs, output):
    q, k, v, q_ranges, k_ranges, mask_types, softmax_scale, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, mask_types)
    ctx.softmax_scale = softmax_scale
    ctx.softcap = softcap


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, q_ranges, k_ranges, mask_types = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    dq, dk, dv = bwd(
        dout.contiguous(), dlse.contiguous(), q, k, v, out, lse, q_ranges, k_ranges, mask_types,
        ctx.softmax_scale, ctx.softcap,
    )
    return dq, dk, dv, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
