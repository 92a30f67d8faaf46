"""Train a tiny transformer on packed documents with context parallelism (flashrange.distributed).

Every step packs documents of random lengths into one sequence of
``--seqlen`` tokens (a new document-causal mask each step), spreads its
tokens over the ranks with :class:`flashrange.distributed.ContextParallel`
(balanced by mask area) and trains a couple of attention layers on them.
Each document repeats a random pattern, so the loss falls once attention
learns to copy from one period back.

CPU (gloo)::

    torchrun --nproc-per-node 2 examples/context_parallel.py --steps 3

GPUs (NCCL, one process per GPU)::

    torchrun --nproc-per-node 8 examples/context_parallel.py --seqlen 131072 --dim 512 --heads 8 --kv-heads 2

Data x context parallelism with FSDP2 (a 2-D mesh ``("dp", "cp")``;
context parallelism on ``mesh["cp"]``, parameters sharded over ``cp`` and
replicated over ``dp``)::

    torchrun --nproc-per-node 4 examples/context_parallel.py --dp 2 --steps 3

``--check`` compares one attention call with :func:`flashrange.range_attention`
on the global tensors; ``--compile`` compiles the model with
``torch.compile(fullgraph=True)`` (without ``--dp``); ``--no-overlap`` turns
the communication/compute overlap off.

Every rank of a context-parallel group builds the same global batch from
the step's seed, so no data moves before ``dispatch``. Each rank's loss is
its share of the batch's token mean, so the gradient is the sum over the
context-parallel ranks (and the mean over data-parallel replicas): summed
by hand without ``--dp``, by FSDP2 with ``--dp`` (divide factor ``dp``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import flashrange
from flashrange.distributed import ContextParallel


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seqlen", type=int, default=None, help="tokens per step (default: 1024 on CPU, 65536 on GPU)")
    ap.add_argument("--max-docs", type=int, default=16, help="documents per step: 1 to this many")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--check", action="store_true", help="check one attention call against a single device")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (FSDP2 over a dp x cp mesh)")
    return ap.parse_args()


def setup():
    """Process group and device: NCCL with one GPU per process when there are GPUs, gloo on the CPU otherwise."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        return torch.device("cuda", local), torch.bfloat16
    dist.init_process_group("gloo")
    return torch.device("cpu"), torch.float32


def make_batch(step, T, max_docs, vocab, replica=0):
    """The step's global batch, the same on every rank of a replica: tokens, next-token labels, positions, documents."""
    g = torch.Generator().manual_seed(1000 + step + 100_000 * replica)
    docs = int(torch.randint(1, max_docs + 1, (1,), generator=g))
    cuts = torch.sort(torch.randperm(T - 1, generator=g)[: docs - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])])
    lengths = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(docs), lengths)
    start = cu[:-1][doc]
    pos = torch.arange(T) - start
    # Document d repeats a random pattern of period p_d: position t copies position t - p_d.
    period = torch.randint(2, 9, (docs,), generator=g)[doc]
    pattern = torch.randint(0, vocab, (docs, 8), generator=g)
    tokens = pattern[doc, pos % period]
    labels = torch.full((T,), -1, dtype=torch.int64)
    same_doc = doc[1:] == doc[:-1]
    labels[:-1] = torch.where(same_doc, tokens[1:], -1)
    return tokens, labels, pos, cu


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.d, bias=False)
        self.out = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, cp):
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        o, _ = cp.attention(q.view(-1, self.h, self.d), k.view(-1, self.hkv, self.d), v.view(-1, self.hkv, self.d))
        return self.out(o.reshape(-1, self.h * self.d))


class Model(nn.Module):
    def __init__(self, vocab, dim, heads, kv_heads, layers, max_pos):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_pos, dim)
        self.attn = nn.ModuleList(Attention(dim, heads, kv_heads) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * layers + 1))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, pos, cp):
        """Local tokens `(T_local,)` and their positions in their documents -> logits `(T_local, vocab)`."""
        x = self.tok(tokens) + self.pos(pos)
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attn(self.norms[2 * i](x), cp)
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


def check(cp, mask, device, dtype, T, heads, kv_heads, d):
    """One attention call through the group against flashrange.range_attention on the global tensors."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(T, heads, d, generator=g).to(device, dtype)
    k = torch.randn(T, kv_heads, d, generator=g).to(device, dtype)
    v = torch.randn(T, kv_heads, d, generator=g).to(device, dtype)
    want, want_lse = flashrange.range_attention(q, k, v, *mask.to(device).tensors())
    out, lse = cp.attention(cp.dispatch(q), cp.dispatch(k), cp.dispatch(v))
    got, got_lse = cp.undispatch(out), cp.undispatch(lse)
    fin = torch.isfinite(want_lse)
    err = (got.float() - want.float()).abs().max().item()
    lse_err = (got_lse[fin] - want_lse[fin]).abs().max().item() if bool(fin.any()) else 0.0
    return err, lse_err


def main():
    a = parse_args()
    device, dtype = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    T = a.seqlen or (65536 if device.type == "cuda" else 1024)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model(a.vocab, a.dim, a.heads, a.kv_heads, a.layers, T).to(device, dtype)
    if a.dp > 1:
        if world % a.dp or a.compile:
            raise SystemExit(f"--dp must divide the world size ({world}) and is not combined with --compile here")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (a.dp, world // a.dp), mesh_dim_names=("dp", "cp"))
        cp_group, replica = mesh["cp"], mesh.get_local_rank("dp")
        # A 2-D mesh gives HSDP: parameters replicated over dp, sharded over cp.
        for block in list(model.attn) + list(model.mlp):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_gradient_divide_factor(float(a.dp))  # sum over cp, mean over dp
    else:
        cp_group, replica = None, 0
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    fwd = torch.compile(model, fullgraph=True) if a.compile else model
    if rank == 0:
        print(f"world {world} (dp {a.dp} x cp {world // a.dp}) on {device} ({dist.get_backend()}), {T} tokens per "
              f"step and replica, {dtype}, overlap={not a.no_overlap}, compile={a.compile}", flush=True)
    for step in range(a.steps):
        t0 = time.perf_counter()
        tokens, labels, pos, cu = make_batch(step, T, a.max_docs, a.vocab, replica)
        mask = flashrange.RangeMask.varlen(cu, causal=True)
        # Planning runs on the host, once per mask, outside the compiled model.
        cp = ContextParallel(*mask.tensors(), T, T, group=cp_group, chunk_size=a.chunk_size,
                             overlap=not a.no_overlap)
        if a.check and step == 0:
            err, lse_err = check(cp, mask, device, dtype, T, a.heads, a.kv_heads, a.dim // a.heads)
            if rank == 0:
                print(f"check against one device: max |out diff| {err:.3e}, max |lse diff| {lse_err:.3e}", flush=True)
        tok_l, lab_l, pos_l = (cp.dispatch(x.to(device)) for x in (tokens, labels, pos))
        valid = cp.dispatch(torch.ones(T, dtype=torch.bool, device=device)) & (lab_l >= 0)  # padding is False
        n_global = int((labels >= 0).sum())
        logits = fwd(tok_l, pos_l, cp)
        loss = F.cross_entropy(logits.float()[valid], lab_l[valid], reduction="sum") / n_global
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.dp == 1:
            # Every rank saw different tokens of the same batch: sum the gradients (one collective).
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=cp.group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        opt.step()
        total = loss.detach().float()
        dist.all_reduce(total)
        total /= a.dp
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if rank == 0:
            bal = cp.balance()
            print(f"step {step:4d}  loss {total.item():.4f}  {a.dp * T / dt:10.0f} tokens/s  docs {cu.numel() - 1:3d}  "
                  f"area max/mean {bal['imbalance']:.3f}  recv {sum(cp.traffic()['recv_tokens'])} tokens",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
