"""``flashrange demo``: packed documents whose slice count changes every step, compiled once.

The users' scenario (docs/design.md §1): every step packs a new batch of documents of
random lengths into one token stream, so the causal document mask has a
different number of slices each step. The mask is padded with empty slices
to a fixed capacity, so the compiled attention layer (``torch.compile`` over
:func:`flashrange.range_attention`, forward and backward) is compiled exactly
once. Each step prints its time, the number of compilations so far and the
error of the layer's attention output and input gradient against
:mod:`flashrange.reference`; the first batch's mask is written as a PNG.

Runs on the GPU (bf16, Triton kernels) when CUDA is available and on the CPU
(float32, reference implementation) otherwise.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from torch import nn

from . import reference
from .interface import range_attention
from .mask import RangeMask

_DEFAULTS = {
    # Small enough on the CPU to finish in well under a minute with compilation.
    "cpu": {"steps": 8, "tokens": 384, "heads": 4, "head_dim": 32},
    "cuda": {"steps": 20, "tokens": 8192, "heads": 8, "head_dim": 128},
}


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs handed to the wrapped backend.

    Each call is one compilation of one frame (the backward graph is compiled
    inside the same call by AOTAutograd), so ``count`` is the number of
    compilations, recompilations included.
    """

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self.count = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.count += 1
        return lookup_backend(self.backend)(gm, example_inputs)


class PackedAttention(nn.Module):
    """qkv projection -> range attention -> out projection over a packed `(T, heads * head_dim)` stream.

    Returns ``(y, q, k, v, out, lse)``: the layer output plus the attention's
    inputs and outputs, so that the demo can check them against the reference.
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        dim = heads * head_dim
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x, q_ranges, k_ranges, mask_types):
        T = x.shape[0]
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        out, lse = range_attention(q, k, v, q_ranges, k_ranges, mask_types)
        return self.proj(out.reshape(T, H * D)), q, k, v, out, lse


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="flashrange demo",
        description=(
            "Packed documents of random lengths, a new slice count every step, padded to a fixed "
            "capacity: a compiled attention layer (forward + backward) that compiles once."
        ),
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 8 on CPU, 20 on GPU)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per packed batch (default: 384 CPU, 8192 GPU)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default: 4 CPU, 8 GPU)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads, dividing --heads (default: heads/2)")
    p.add_argument("--head-dim", type=int, default=None, help="head dimension (default: 32 CPU, 128 GPU)")
    p.add_argument(
        "--capacity", type=int, default=64,
        help="slice capacity the mask is padded to; each step packs 1..capacity documents (default 64)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cuda:N or cpu")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--png", default="flashrange_demo_mask.png", help="where to write the first batch's mask")
    p.add_argument(
        "--backend", default="inductor",
        help="torch.compile backend wrapped by the compile counter (default inductor; aot_eager compiles faster)",
    )
    return p.parse_args(argv)


def _resolve(args):
    """Device, dtype and defaults; raises ``ValueError`` on inconsistent options."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cuda", "cpu"):
            raise ValueError(f"--device must be auto, cpu or cuda[:N], got {args.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
    defaults = _DEFAULTS[device.type]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.kv_heads is None:
        args.kv_heads = args.heads // 2 if args.heads % 2 == 0 else args.heads
    for name in ("steps", "tokens", "heads", "kv_heads", "head_dim", "capacity"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.heads % args.kv_heads != 0:
        raise ValueError(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads})")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, dtype


def _random_documents(rng, tokens, max_docs):
    """Cumulative lengths of ``1..max_docs`` documents of random lengths filling ``tokens``."""
    n_docs = rng.randint(1, min(max_docs, tokens))
    cuts = sorted(rng.sample(range(1, tokens), n_docs - 1))
    return [0, *cuts, tokens]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_rel_err(got, want):
    """``max |got - want| / max |want|`` in float32 (0 when both are 0)."""
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    return err / scale if scale > 0 else err


def _reference_errors(model, x, w, q, k, v, out, lse, x_grad, mask):
    """Relative errors of ``out``, ``lse`` and ``x.grad`` against the reference on the same q, k, v.

    The loss is ``(y * w).sum()`` with ``y = proj(out)``, so ``dout = w @ W_proj``;
    the reference backward gives ``dq, dk, dv`` and ``dx = [dq, dk, dv] @ W_qkv``,
    all in float32.
    """
    T, H, D = q.shape
    scale = 1.0 / D**0.5
    qf, kf, vf = q.float(), k.float(), v.float()
    ref_out, ref_lse = reference.range_attention_forward(qf, kf, vf, *mask.tensors(), scale, 0.0)
    dout = (w.float() @ model.proj.weight.float()).view(T, H, -1)
    dq, dk, dv = reference.range_attention_backward(
        dout, qf, kf, vf, ref_out, ref_lse, *mask.tensors(), scale, 0.0, None
    )
    dqkv = torch.cat([dq.reshape(T, -1), dk.reshape(T, -1), dv.reshape(T, -1)], dim=-1)
    ref_dx = dqkv @ model.qkv.weight.float()
    finite = torch.isfinite(ref_lse)
    return (
        _max_rel_err(out, ref_out),
        _max_rel_err(lse[finite], ref_lse[finite]),
        _max_rel_err(x_grad, ref_dx),
    )


def _write_png(mask, tokens, path, n_docs):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"mask picture: skipped (matplotlib is not installed; pip install matplotlib to write {path})")
        return
    mask.plot(path, Tq=tokens, Tk=tokens, title=f"step 0: {n_docs} causal documents, padded to {mask.num_slices} slices")
    print(f"mask picture: first batch written to {path}")


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        device, dtype = _resolve(args)
    except ValueError as e:
        print(f"flashrange demo: {e}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        print(f"device: {device} ({name}), {str(dtype).replace('torch.', '')}, Triton kernels")
    else:
        print(
            "device: cpu, float32, reference implementation (no CUDA device; slow but exact: the op runs "
            "the reference itself, so the errors below are 0 up to the projections' rounding)"
        )
    print(
        f"layer: {args.tokens} tokens, {args.heads} query heads, {args.kv_heads} kv heads, head dim "
        f"{args.head_dim}; 1..{min(args.capacity, args.tokens)} causal documents per step, padded to "
        f"{args.capacity} slices; torch.compile(fullgraph=True, backend={args.backend!r})"
    )

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    model = PackedAttention(args.heads, args.kv_heads, args.head_dim).to(device, dtype)
    counter = CountingBackend(args.backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    dim = args.heads * args.head_dim

    times_ms, errors = [], []
    for step in range(args.steps):
        cu_seqlens = _random_documents(rng, args.tokens, args.capacity)
        n_docs = len(cu_seqlens) - 1
        mask = RangeMask.varlen(cu_seqlens, causal=True, device=device).pad_to(args.capacity)
        if step == 0:
            _write_png(mask, args.tokens, args.png, n_docs)
        x = torch.randn(args.tokens, dim, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(args.tokens, dim, device=device, dtype=dtype)

        _sync(device)
        t0 = time.perf_counter()
        y, q, k, v, out, lse = compiled(x, *mask.tensors())
        (y * w).sum().backward()
        _sync(device)
        ms = (time.perf_counter() - t0) * 1e3
        model.zero_grad(set_to_none=True)

        err = _reference_errors(model, x, w, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                x.grad, mask)
        errors.append(err)
        note = "  (includes compilation)" if step == 0 else ""
        if step > 0:
            times_ms.append(ms)
        print(
            f"step {step:3d}: {n_docs:3d} documents -> {mask.num_slices} slices  fwd+bwd {ms:9.2f} ms  "
            f"compilations so far: {counter.count}  rel err out {err[0]:.2e} lse {err[1]:.2e} dx {err[2]:.2e}{note}"
        )

    worst = [max(e[i] for e in errors) for i in range(3)]
    median = f"{statistics.median(times_ms):.2f} ms" if times_ms else "n/a (one step)"
    print(
        f"summary: {args.steps} steps, compiled {counter.count} time{'s' if counter.count != 1 else ''}, "
        f"median step {median} after compilation, max rel err vs reference: out {worst[0]:.2e}, "
        f"lse {worst[1]:.2e}, dx {worst[2]:.2e}"
    )
    if counter.count != 1:
        print("flashrange demo: expected exactly one compilation with a padded mask", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
