"""``ContextParallel``: one global range mask, its tokens spread over a process group.

Build one per mask (host planning, once), then per layer::

    cp = ContextParallel(q_ranges, k_ranges, mask_types, T, T, group=cp_group)
    x_local = cp.dispatch(x)                      # this rank's tokens, no communication
    out_local, lse_local = cp.attention(q_local, k_local, v_local)
    x = cp.undispatch(x_local)                    # the global order, on every rank

Semantics, communication, balance and compile support are described in
docs/context_parallel.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import flashrange
from flashrange.validation import check_qkv, check_scalars, resolve_scale

from . import ops as cp_ops
from .planner import ContextParallelPlan

__all__ = ["ContextParallel"]


def _resolve_group(group):
    """``(process group, device type or None)`` from ``None``, a ProcessGroup or a 1-D DeviceMesh."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ContextParallel needs torch.distributed: call torch.distributed.init_process_group() first "
            "(torchrun sets up the environment), or use plan_context_parallel() to plan without processes"
        )
    if group is None:
        return dist.group.WORLD, None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"ContextParallel takes a 1-D DeviceMesh, got one with {group.ndim} dimensions "
                f"{group.mesh_dim_names}; pass the context-parallel dimension, e.g. mesh['cp']"
            )
        return group.get_group(), group.device_type
    return group, None


def _default_device(group, device_type):
    if device_type is None:
        backend = str(dist.get_backend(group)).lower()
        device_type = "cuda" if "nccl" in backend else "cpu"
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


class ContextParallel:
    """Context-parallel attention over one global self-attention range mask.

    Queries and keys share one token axis (self-attention): the sequence is
    cut into chunks, every rank holds the same number of chunks chosen so
    that the covered cells of the mask (the attention work) are balanced, and
    each rank receives exactly the key/value tokens its query rows read.

    Args:
        q_ranges, k_ranges: `(S, 2)` int32 global ranges of the whole sequence;
            mask_types: `(S,)` int32 (0 FULL, 1 CAUSAL, 2 INV_CAUSAL,
            3 BI_CAUSAL; docs/design.md §2). Any device: they are
            read on the host once, here. Empty slices are ignored.
        total_seqlen_q: ``T``, the tokens of the global sequence.
        total_seqlen_k: must equal ``total_seqlen_q`` (``None`` means equal):
            context parallelism here splits one token axis shared by queries
            and keys.
        group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (for example
            ``mesh["cp"]`` of a data x context mesh) or ``None`` for the world.
        chunk_size: tokens per chunk (the dispatch granularity); ``None``
            picks about sixteen chunks per rank. The sequence is padded to a
            multiple of ``world_size * chunk_size`` with tokens no slice
            covers (``dispatch`` fills them with zeros, ``undispatch`` drops
            them).
        overlap: attend to the local keys while the remote ones travel and
            merge both parts through lse (default); ``False`` waits for the
            keys and makes one call over all of them (debugging, fewer
            kernels).
        bucket: pad the local slice lists, the receive buffer and the send
            list to powers of two, so that ``torch.compile(dynamic=False)``
            sees few shapes when the mask changes every step (by default,
            automatic dynamic shapes handle the changing sizes).
        device: where the local ranges, plans and indices live; defaults to
            the current CUDA device for NCCL groups, to the mesh's device
            type for a DeviceMesh, and to the CPU otherwise.

    Raises:
        ValueError: ``total_seqlen_k != total_seqlen_q``, a slice outside
            ``[0, T]``, an unknown mask type or a bad size or mesh.
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(
        self,
        q_ranges,
        k_ranges,
        mask_types,
        total_seqlen_q: int,
        total_seqlen_k: int | None = None,
        group=None,
        chunk_size: int | None = None,
        *,
        overlap: bool = True,
        bucket: bool = False,
        device=None,
    ):
        T = int(total_seqlen_q)
        if total_seqlen_k is not None and int(total_seqlen_k) != T:
            raise ValueError(
                f"ContextParallel splits one token axis shared by queries and keys (self-attention), but "
                f"total_seqlen_q={T} and total_seqlen_k={int(total_seqlen_k)}; for cross-attention, gather the "
                "keys on every rank and call flashrange.range_attention on the local queries"
            )
        self.group, device_type = _resolve_group(group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else _default_device(self.group, device_type)
        self.overlap = bool(overlap)
        self.plan = ContextParallelPlan(q_ranges, k_ranges, mask_types, T, self.world_size, chunk_size)
        self._group_name = cp_ops.register_group(self.group)
        self._build(bool(bucket))

    def _build(self, bucket):
        p, r, dev = self.plan, self.rank, self.device
        Tl = p.local_seqlen
        send_splits, recv_splits = p.send_splits(r), p.recv_splits(r)
        R = sum(recv_splits)

        def cap(n):
            # At least two: torch.compile specialises sizes 0 and 1, so a list
            # that shrinks to one slice would recompile even with dynamic shapes.
            n = max(2, n)
            return flashrange.bucket_capacity(n) if bucket else n

        self.recv_capacity = cap(R)
        send_index = p.send_index(r)
        self._send_index = torch.cat(
            [send_index, send_index.new_zeros(cap(send_index.numel()) - send_index.numel())]
        ).to(dev)
        lr = p.local_ranges(r)
        stages = (lr.combined, lr.local, lr.remote)
        key_lengths = (Tl + self.recv_capacity, Tl, self.recv_capacity)
        self._ranges, self._plans, counts = [], [], []
        for (qr, kr, mt), Tk in zip(stages, key_lengths):
            counts.append(mt.numel())
            # Padding slices keep every list non-empty and, with bucketing, its length stable.
            mask = flashrange.RangeMask(qr, kr, mt).pad_to(cap(mt.numel())).to(dev)
            self._ranges.extend(mask.tensors())
            self._plans.extend(flashrange.plan_mask(*mask.tensors(), Tl, Tk))
        communicate = self.world_size > 1 and int(p.recv_tokens.sum()) > 0  # the same on every rank
        self._meta = torch.tensor(
            [counts[0] > 0, counts[1] > 0, counts[2] > 0 and R > 0, communicate] + send_splits + recv_splits,
            dtype=torch.int64,
        )
        self._local_index = p.local_index(r).to(dev)
        owner = p.chunk_owner
        g = torch.arange(p.total_seqlen)
        c = g // p.chunk_size
        self._inverse_index = (owner[c] * Tl + p.chunk_slot[c] * p.chunk_size + g % p.chunk_size).to(dev)
        self.num_local_slices = counts[0]

    # ------------------------------------------------------------ sizes

    @property
    def total_seqlen(self) -> int:
        """``T``: tokens of the global sequence."""
        return self.plan.total_seqlen

    @property
    def local_seqlen(self) -> int:
        """Tokens on each rank (the same on every rank, padding included)."""
        return self.plan.local_seqlen

    @property
    def chunk_size(self) -> int:
        return self.plan.chunk_size

    @property
    def local_index(self) -> torch.Tensor:
        """`(T_local,)` int64: the global position of each local token (``>= T`` for padding).

        Use it for positions (RoPE, position embeddings): ``cp.dispatch(position_ids)`` gives the same.
        """
        return self._local_index

    # ------------------------------------------------------------ figures

    def balance(self) -> dict:
        """Per-rank mask area (covered cells) and its max/mean, with the contiguous split for comparison."""
        p = self.plan
        return {
            "rank_area": p.rank_area().tolist(),
            "imbalance": p.imbalance(),
            "contiguous_rank_area": p.rank_area(contiguous=True).tolist(),
            "contiguous_imbalance": p.imbalance(contiguous=True),
            "strategy": p.strategy,
        }

    def traffic(self, heads_kv=None, head_dim=None, head_dim_v=None, dtype=torch.bfloat16) -> dict:
        """Key/value tokens each rank receives and sends per forward, and what a ring would move.

        With ``heads_kv`` and ``head_dim`` the figures include bytes (the
        backward sends as many gradient bytes back).
        """
        p = self.plan
        fig = {
            "recv_tokens": p.recv_tokens.tolist(),
            "send_tokens": p.send_tokens.tolist(),
            "ring_tokens": p.ring_tokens.tolist(),
        }
        if heads_kv is not None and head_dim is not None:
            fig["recv_bytes"] = p.traffic_bytes(heads_kv, head_dim, head_dim_v, dtype).tolist()
            per_token = fig["recv_bytes"][0] // max(1, fig["recv_tokens"][0]) if fig["recv_tokens"][0] else None
            fig["ring_bytes"] = [t * per_token for t in fig["ring_tokens"]] if per_token else None
        return fig

    def summary(self) -> str:
        """Text table of the balance and traffic figures (see :meth:`ContextParallelPlan.summary`)."""
        return self.plan.summary()

    # ------------------------------------------------------------ data movement

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a global tensor; no communication.

        Args:
            x: `(T, ...)`, the same on every rank (tokens first: hidden states,
                q/k/v, labels, position ids...).

        Returns:
            `(T_local, ...)`: the rank's chunks in global order, padding tokens
            zero. Differentiable.
        """
        T = self.plan.total_seqlen
        if x.dim() < 1 or x.shape[0] != T:
            raise ValueError(
                f"dispatch takes a global tensor of {T} tokens on dim 0, got shape {tuple(x.shape)}"
            )
        pad = self.plan.padded_seqlen - T
        if pad:
            x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
        return x.index_select(0, self._local_index.to(x.device))

    def undispatch(self, x_local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every rank's local part, on every rank (one all-gather).

        Args:
            x_local: `(T_local, ...)`, this rank's tokens (as ``dispatch``
                returns them), the same trailing shape on every rank.

        Returns:
            `(T, ...)` in the global order, padding dropped. Differentiable
            under the convention that every rank computes the same loss on
            it: the gradient of a local token is the global gradient at its
            position (no communication in the backward).
        """
        if x_local.dim() < 1 or x_local.shape[0] != self.local_seqlen:
            raise ValueError(
                f"undispatch takes this rank's {self.local_seqlen} tokens on dim 0 (as dispatch returns them), "
                f"got shape {tuple(x_local.shape)}"
            )
        dev = x_local.device
        return cp_ops.undispatch(
            x_local, self._local_index.to(dev), self._inverse_index.to(dev), self._group_name
        )

    # ------------------------------------------------------------ attention

    def attention(self, q_local, k_local, v_local, softmax_scale=None, softcap=0.0):
        """Attention of the local queries over the global keys their mask rows read.

        Args:
            q_local: `(T_local, Hq, D)`; k_local: `(T_local, Hkv, D)`;
                v_local: `(T_local, Hkv, Dv)`: this rank's tokens, in dispatch
                order (``cp.dispatch(q)`` or projections of ``cp.dispatch(x)``).
            softmax_scale: defaults to `1 / sqrt(D)`.
            softcap: when `> 0`, scores become `softcap * tanh(score / softcap)`.

        Returns:
            `out_local`: `(T_local, Hq, Dv)` in q's dtype and `lse_local`:
            `(T_local, Hq)` float32 (float64 for float64 inputs), equal to the
            rows of :func:`flashrange.range_attention` on the global tensors
            (padding rows: `out = 0`, `lse = -inf`). Differentiable in
            ``q_local``, ``k_local``, ``v_local``: each rank gets the full
            gradient of its own tokens, other ranks' queries included.
        """
        check_qkv(q_local, k_local, v_local)
        softcap = check_scalars(softmax_scale, softcap)
        Tl = self.local_seqlen
        for name, t in (("q_local", q_local), ("k_local", k_local), ("v_local", v_local)):
            if t.shape[0] != Tl:
                raise ValueError(
                    f"{name} has {t.shape[0]} tokens but this rank holds {Tl}; pass this rank's tokens, "
                    f"e.g. cp.dispatch({name[0]}) of the global tensor"
                )
        if q_local.device != self.device:
            raise ValueError(
                f"q_local is on {q_local.device} but the ContextParallel was built for {self.device}; pass "
                f"device={q_local.device} to the constructor"
            )
        scale = resolve_scale(softmax_scale, q_local.shape[-1])
        out, lse, _, _ = cp_ops.attn_fwd(
            q_local, k_local, v_local, self._send_index, self._meta, self._ranges, self._plans, self._group_name,
            self.recv_capacity, scale, softcap, self.overlap,
        )
        return out, lse
