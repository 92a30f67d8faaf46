"""Host planner for context parallelism: chunks, balance, communication and local ranges.

Everything here runs on the host, once per mask, with vectorised torch ops
(no loop over tokens or slices; the only Python loops run over ranks and
over chunks in the greedy assignment), and needs no process group, so the
figures of a large job can be simulated on a laptop
(:func:`plan_context_parallel`, ``python -m flashrange.distributed.report``).

Geometry used throughout (docs/context_parallel.md, "Planning"). On row
``i``, slice ``[qs, qe) x [ks, ke)`` covers the keys
``[max(ks, i + alpha), min(ke, i + beta))``, where ``alpha = ks - qs`` for
INV_CAUSAL and BI_CAUSAL (unbounded below otherwise) and
``beta = ke - qe + 1`` for CAUSAL and BI_CAUSAL (unbounded above otherwise).
Both bounds grow by at most one key per row, so the keys that any run of
consecutive rows of one slice reads form one interval, and that interval is
exactly what those rows need: nothing is moved that no local row reads.

Steps:

1. Cut the padded sequence into chunks of ``chunk_size`` tokens; the chunk
   count is a multiple of the world size so that every rank holds the same
   number of tokens (the padding tokens are covered by no slice).
2. Weigh each chunk by the covered cells of its rows (closed-form sums of the
   row bounds above) and assign chunks to ranks: largest chunk first to the
   least-loaded rank that still has room, unless the contiguous split is at
   least as balanced.
3. Per rank: the key interval each (slice, local run of rows) reads, their
   union, minus the keys the rank owns, split by owner: the receive list of
   an ``all_to_all`` (source-major, then global order); the senders' lists
   follow from the receivers'.
4. Per rank: every slice clipped to (local run of rows) x (contiguous run of
   keys in a local buffer) and rewritten in local coordinates, at most three
   slices per piece (a diagonal bound only lines up with a corner of the
   rectangle on part of the rows).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL
from ..mask import RangeMask

__all__ = ["ContextParallelPlan", "LocalRanges", "plan_context_parallel", "default_chunk_size"]

# Stands for an unbounded diagonal in int64 arithmetic: far beyond any
# sequence (tokens are < 2**30), far from overflow.
_BIG = 1 << 40

# Default number of chunks per rank: enough for the greedy assignment to
# balance document and causal masks within a few percent, few enough to keep
# the communication in long contiguous pieces.
_CHUNKS_PER_RANK = 16


# Bound on the refinement swaps, per rank: a few do nearly all of the good.
_SWAPS_PER_RANK = 8


def default_chunk_size(total_seqlen: int, world_size: int) -> int:
    """The default chunk size: about ``_CHUNKS_PER_RANK`` chunks per rank.

    Rounded up to a multiple of the kernels' block (or of 16) when chunks are
    long enough that the rounding pads the sequence by at most a sixteenth.
    """
    T, W = int(total_seqlen), int(world_size)
    c = max(1, -(-T // (W * _CHUNKS_PER_RANK)))
    for align in (128, 16):
        if c >= 16 * align:
            return -(-c // align) * align
    return c


def _i64(x):
    return x.detach().to("cpu", torch.int64)


@dataclass(frozen=True)
class _Slices:
    """Non-empty slices trimmed to their covered rows ``[qa, qb)`` (int64 host tensors).

    Row ``i`` in ``[qa, qb)`` covers keys ``[max(ks, i + alpha), min(ke, i + beta))``,
    never empty. ``index`` holds each slice's position in the caller's list.
    """

    qa: torch.Tensor
    qb: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    index: torch.Tensor

    @property
    def n(self) -> int:
        return self.qa.numel()


def _slice_table(q_ranges, k_ranges, mask_types, T) -> _Slices:
    qr, kr, mt = _i64(q_ranges).reshape(-1, 2), _i64(k_ranges).reshape(-1, 2), _i64(mask_types).reshape(-1)
    qs, qe, ks, ke = qr[:, 0], qr[:, 1], kr[:, 0], kr[:, 1]
    big = torch.full_like(qs, _BIG)
    alpha = torch.where((mt == INV_CAUSAL) | (mt == BI_CAUSAL), ks - qs, -big)
    beta = torch.where((mt == CAUSAL) | (mt == BI_CAUSAL), ke - qe + 1, big)
    known = (mt >= FULL) & (mt <= BI_CAUSAL)
    # Rows with a non-empty key interval: ks < i + beta and i + alpha < ke.
    qa = torch.maximum(qs, ks - beta + 1)
    qb = torch.minimum(qe, ke - alpha)
    keep = known & (qe > qs) & (ke > ks) & (alpha < beta) & (qb > qa)
    idx = keep.nonzero().flatten()
    return _Slices(qa[idx], qb[idx], ks[idx], ke[idx], alpha[idx], beta[idx], idx)


def _sum_upper(a, b, K, beta):
    """``sum_{i=a}^{b-1} min(K, i + beta)``, elementwise (``a <= b``)."""
    m = torch.minimum(torch.maximum(K - beta + 1, a), b)  # rows [a, m) on the diagonal
    n = m - a
    return n * beta + (a + m - 1) * n // 2 + (b - m) * K


def _sum_lower(a, b, K, alpha):
    """``sum_{i=a}^{b-1} max(K, i + alpha)``, elementwise (``a <= b``)."""
    m = torch.minimum(torch.maximum(K - alpha, a), b)  # rows [m, b) on the diagonal
    n = b - m
    return (m - a) * K + n * alpha + (m + b - 1) * n // 2


def _overlap_pairs(a, b, starts, ends):
    """All ``(query, interval)`` pairs with ``[a, b)`` meeting ``[starts, ends)``.

    ``starts``/``ends`` are sorted and disjoint. Returns two int64 index tensors.
    """
    first = torch.searchsorted(ends, a, right=True)
    last = torch.searchsorted(starts, b, right=False)
    counts = (last - first).clamp(min=0)
    qi = torch.repeat_interleave(torch.arange(a.numel()), counts)
    offsets = torch.cumsum(counts, 0) - counts
    ii = first[qi] + (torch.arange(qi.numel()) - offsets[qi])
    return qi, ii


def _merge_intervals(lo, hi):
    """Sorted union of intervals ``[lo, hi)`` (touching ones merge)."""
    if lo.numel() == 0:
        return lo, hi
    order = torch.argsort(lo, stable=True)
    lo, hi = lo[order], hi[order]
    reach = torch.cummax(hi, 0).values
    new = torch.ones_like(lo, dtype=torch.bool)
    new[1:] = lo[1:] > reach[:-1]
    last = torch.ones_like(new)
    last[:-1] = new[1:]
    return lo[new], reach[last]


def _expand(starts, lengths):
    """Concatenation of ``arange(starts[i], starts[i] + lengths[i])``."""
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    piece = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    return starts[piece] + (torch.arange(total) - offsets[piece])


def _runs(sorted_ids):
    """Runs of consecutive integers in a sorted id list: ``(first_id, last_id + 1, position of first)``."""
    if sorted_ids.numel() == 0:
        e = torch.zeros(0, dtype=torch.int64)
        return e, e, e
    new = torch.ones_like(sorted_ids, dtype=torch.bool)
    new[1:] = sorted_ids[1:] != sorted_ids[:-1] + 1
    pos = new.nonzero().flatten()
    end_pos = torch.cat([pos[1:], torch.tensor([sorted_ids.numel()])])
    return sorted_ids[pos], sorted_ids[end_pos - 1] + 1, pos


def _refine(owner, area, W, per):
    """Improve an assignment by swapping chunks out of the most loaded rank while its load drops.

    Each accepted swap lowers the larger load of the pair below the old
    maximum, so the sorted load vector decreases and the loop would end by
    itself; it stops after ``_SWAPS_PER_RANK`` swaps per rank. For a chunk
    ``c`` of the most loaded rank ``M`` and another rank ``r``, the best
    partner ``d`` has the area nearest to ``area[c] - (load[M] - load[r]) / 2``
    (the larger load of the pair is V-shaped in the area moved), so each
    step is a batched ``searchsorted``, not a search over all pairs.
    Deterministic (first minimum on ties).
    """
    n = owner.numel()
    for _ in range(_SWAPS_PER_RANK * W):
        chunks = torch.argsort(owner * n + torch.arange(n)).view(W, per)
        A = area[chunks]  # (W, per)
        loads = A.sum(1)
        M = int(torch.argmax(loads))
        sorted_a, order = torch.sort(A, dim=1, stable=True)
        # Float64 holds the areas exactly (far below 2**53 cells).
        target = A[M].double()[None, :] - (loads[M] - loads).double()[:, None] / 2  # (W, per)
        pos = torch.searchsorted(sorted_a.double().contiguous(), target.contiguous())
        cand = torch.stack([pos - 1, pos]).clamp(0, per - 1)  # (2, W, per): neighbours of the target
        a_d = torch.gather(sorted_a.expand(2, W, per), 2, cand)
        moved = A[M][None, None, :] - a_d
        pair_max = torch.maximum(loads[M] - moved, loads[None, :, None] + moved)
        pair_max[:, M, :] = loads[M]
        best = int(torch.argmin(pair_max))
        if int(pair_max.view(-1)[best]) >= int(loads[M]):
            break
        k, rest = divmod(best, W * per)
        r, i = divmod(rest, per)
        c = int(chunks[M, i])
        d = int(chunks[r, order[r, cand[k, r, i]]])
        owner = owner.clone()
        owner[c], owner[d] = r, M
    return owner


@dataclass(frozen=True)
class LocalRanges:
    """One rank's mask in local coordinates: three slice lists, int32 host tensors.

    Query rows are the rank's tokens in dispatch order (`(T_local,)`). Key
    coordinates differ per list:

    - ``local``: keys are the rank's own tokens (`k_local`);
    - ``remote``: keys are the received buffer (`k_remote`, in receive order);
    - ``combined``: keys are ``cat([k_local, k_remote])``.

    Each list is ``(q_ranges (S, 2), k_ranges (S, 2), mask_types (S,))``.
    """

    local: tuple
    remote: tuple
    combined: tuple


class ContextParallelPlan:
    """Where every chunk lives, what each rank receives and sends, and the balance of the work.

    Build it with :func:`plan_context_parallel`. Host tensors only; every rank
    of a group builds the same plan from the same mask without communicating.

    Attributes:
        total_seqlen: ``T``, the tokens of the global sequence.
        world_size: ``W``, ranks of the context-parallel group.
        chunk_size: tokens per chunk.
        num_chunks: chunks of the padded sequence, a multiple of ``W``.
        padded_seqlen: ``num_chunks * chunk_size >= T``.
        local_seqlen: tokens per rank, ``padded_seqlen / W``.
        chunk_owner: `(num_chunks,)` int64, the rank of each chunk.
        chunk_area: `(num_chunks,)` int64, covered cells of each chunk's rows.
        strategy: ``"greedy"`` or ``"contiguous"``: which assignment was kept.
    """

    def __init__(self, q_ranges, k_ranges, mask_types, total_seqlen, world_size, chunk_size=None):
        T, W = int(total_seqlen), int(world_size)
        if W < 1:
            raise ValueError(f"world_size must be >= 1, got {W}")
        if T < 1:
            raise ValueError(f"total_seqlen must be >= 1 token, got {T}")
        C = default_chunk_size(T, W) if chunk_size is None else int(chunk_size)
        if C < 1:
            raise ValueError(f"chunk_size must be >= 1 token, got {chunk_size}")
        RangeMask(_i64(q_ranges).to(torch.int32), _i64(k_ranges).to(torch.int32), _i64(mask_types).to(torch.int32)
                  ).validate(T, T)
        self.total_seqlen, self.world_size, self.chunk_size = T, W, C
        self.num_chunks = -(-(-(-T // C)) // W) * W
        self.padded_seqlen = self.num_chunks * C
        self.local_seqlen = self.padded_seqlen // W
        self.chunks_per_rank = self.num_chunks // W
        self._sl = _slice_table(q_ranges, k_ranges, mask_types, T)
        self.chunk_area = self._chunk_areas()
        self.chunk_owner, self.strategy = self._assign()
        # Position of each chunk among its owner's chunks (chunks are kept in global order locally).
        order = torch.argsort(self.chunk_owner * self.num_chunks + torch.arange(self.num_chunks))
        self._chunks = order.view(W, self.chunks_per_rank)
        self.chunk_slot = torch.empty_like(order)
        self.chunk_slot[order] = torch.arange(self.num_chunks) % self.chunks_per_rank
        self._pairs = [self._rank_pairs(r) for r in range(W)]
        self._recv = [self._receive_pieces(r) for r in range(W)]

    # ------------------------------------------------------------ assignment

    def _chunk_areas(self):
        sl, C = self._sl, self.chunk_size
        if sl.n == 0:
            return torch.zeros(self.num_chunks, dtype=torch.int64)
        c0 = sl.qa // C
        counts = (sl.qb - 1) // C - c0 + 1
        si = torch.repeat_interleave(torch.arange(sl.n), counts)
        c = c0[si] + (torch.arange(si.numel()) - (torch.cumsum(counts, 0) - counts)[si])
        a = torch.maximum(sl.qa[si], c * C)
        b = torch.minimum(sl.qb[si], (c + 1) * C)
        cells = _sum_upper(a, b, sl.ke[si], sl.beta[si]) - _sum_lower(a, b, sl.ks[si], sl.alpha[si])
        return torch.zeros(self.num_chunks, dtype=torch.int64).index_add_(0, c, cells)

    def _assign(self):
        W, per = self.world_size, self.chunks_per_rank
        contiguous = torch.arange(self.num_chunks) // per
        if W == 1:
            return contiguous, "contiguous"
        area = self.chunk_area.tolist()
        owner = [0] * self.num_chunks
        # Largest chunk first (ties: lower chunk id) to the least-loaded rank
        # with room (ties: lower rank): the classic LPT heuristic with the
        # constraint that every rank takes the same number of chunks; then
        # swaps out of the most loaded rank while they lower it.
        heap = [(0, r) for r in range(W)]
        taken = [0] * W
        for c in sorted(range(self.num_chunks), key=lambda c: -area[c]):
            load, r = heapq.heappop(heap)
            owner[c] = r
            taken[r] += 1
            if taken[r] < per:
                heapq.heappush(heap, (load + area[c], r))
        greedy = _refine(torch.tensor(owner, dtype=torch.int64), self.chunk_area, W, per)
        # Keep the contiguous split when it is as balanced: it moves fewer keys
        # for local masks (documents, windows) and costs nothing otherwise.
        if self._max_area(greedy) < self._max_area(contiguous):
            return greedy, "greedy"
        return contiguous, "contiguous"

    def _max_area(self, owner):
        return int(torch.zeros(self.world_size, dtype=torch.int64).index_add_(0, owner, self.chunk_area).max())

    # ------------------------------------------------------------ per rank

    def rank_chunks(self, rank: int) -> torch.Tensor:
        """`(chunks_per_rank,)` int64: the chunks of ``rank``, in global (and local) order."""
        return self._chunks[self._rank(rank)]

    def local_index(self, rank: int) -> torch.Tensor:
        """`(local_seqlen,)` int64: the global position of each local token (``>= T`` for padding)."""
        ch = self.rank_chunks(rank)
        C = self.chunk_size
        return (ch[:, None] * C + torch.arange(C)[None, :]).reshape(-1)

    def _rank(self, rank):
        r = int(rank)
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return r

    def _row_runs(self, r):
        """Runs of consecutive owned chunks: global rows ``[g0, g1)`` at local row ``l0``."""
        first, end, pos = _runs(self.rank_chunks(r))
        C = self.chunk_size
        return first * C, end * C, pos * C

    def _rank_pairs(self, r):
        """(slice, row run) pairs of rank ``r``: rows ``[a, b)`` and the key interval ``[lo, hi)`` they read."""
        sl = self._sl
        g0, g1, l0 = self._row_runs(r)
        si, ri = _overlap_pairs(sl.qa, sl.qb, g0, g1)
        a = torch.maximum(sl.qa[si], g0[ri])
        b = torch.minimum(sl.qb[si], g1[ri])
        lo = torch.maximum(sl.ks[si], a + sl.alpha[si])
        hi = torch.minimum(sl.ke[si], b - 1 + sl.beta[si])
        return si, ri, a, b, lo, hi

    def needed_intervals(self, rank: int) -> torch.Tensor:
        """`(n, 2)` int64: the sorted, disjoint global key intervals the rows of ``rank`` read."""
        *_, lo, hi = self._pairs[self._rank(rank)]
        s, e = _merge_intervals(lo, hi)
        return torch.stack([s, e], 1)

    def _receive_pieces(self, r):
        """Keys rank ``r`` reads but does not own, split by chunk: ``(source, start, end, chunk)``, buffer order."""
        C = self.chunk_size
        need = self.needed_intervals(r)
        s, e = need[:, 0], need[:, 1]
        c0 = s // C
        counts = (e - 1) // C - c0 + 1 if s.numel() else s
        pi = torch.repeat_interleave(torch.arange(s.numel()), counts)
        c = c0[pi] + (torch.arange(pi.numel()) - (torch.cumsum(counts, 0) - counts)[pi])
        ps = torch.maximum(s[pi], c * C)
        pe = torch.minimum(e[pi], (c + 1) * C)
        src = self.chunk_owner[c]
        keep = src != r
        src, ps, pe, c = src[keep], ps[keep], pe[keep], c[keep]
        # all_to_all lays out what arrives source by source; each source sends in global order.
        order = torch.argsort(src * (self.padded_seqlen + 1) + ps)
        return src[order], ps[order], pe[order], c[order]

    def recv_intervals(self, rank: int) -> torch.Tensor:
        """`(n, 3)` int64 rows ``(source, start, end)``: the global key intervals ``rank`` receives, in buffer order."""
        src, ps, pe, _ = self._recv[self._rank(rank)]
        return torch.stack([src, ps, pe], 1)

    def recv_splits(self, rank: int) -> list:
        """Tokens ``rank`` receives from each source rank (``W`` ints)."""
        src, ps, pe, _ = self._recv[self._rank(rank)]
        return torch.zeros(self.world_size, dtype=torch.int64).index_add_(0, src, pe - ps).tolist()

    def send_splits(self, rank: int) -> list:
        """Tokens ``rank`` sends to each destination rank (``W`` ints)."""
        r = self._rank(rank)
        return [self.recv_splits(d)[r] for d in range(self.world_size)]

    def send_index(self, rank: int) -> torch.Tensor:
        """`(sum(send_splits),)` int64: local positions of the keys ``rank`` sends, destination by destination.

        For each destination, the keys are in global order, which is the order
        in which the destination's receive buffer expects them.
        """
        r, C = self._rank(rank), self.chunk_size
        parts = []
        for d in range(self.world_size):
            src, ps, pe, c = self._recv[d]
            mine = src == r
            ps, pe, c = ps[mine], pe[mine], c[mine]
            parts.append(_expand(self.chunk_slot[c] * C + (ps - c * C), pe - ps))
        return torch.cat(parts)

    def local_ranges(self, rank: int) -> LocalRanges:
        """The mask of ``rank`` in local coordinates (see :class:`LocalRanges`)."""
        r = self._rank(rank)
        sl = self._sl
        si, ri, a, b, lo, hi = self._pairs[r]
        g0, g1, l0 = self._row_runs(r)
        # Key segments: runs of owned chunks (stage 0) and runs of received
        # keys that are contiguous both globally and in the buffer (stage 1).
        src, ps, pe, _ = self._recv[r]
        n = src.numel()
        if n:
            new = torch.ones(n, dtype=torch.bool)
            new[1:] = (src[1:] != src[:-1]) | (ps[1:] != pe[:-1])
            pos = new.nonzero().flatten()
            last = torch.cat([pos[1:] - 1, torch.tensor([n - 1])])
            boff = torch.cumsum(pe - ps, 0) - (pe - ps)
            r_g0, r_g1, r_off = ps[pos], pe[last], boff[pos]
        else:
            r_g0 = r_g1 = r_off = torch.zeros(0, dtype=torch.int64)
        seg_g0 = torch.cat([g0, r_g0])
        seg_g1 = torch.cat([g1, r_g1])
        seg_off = torch.cat([l0, r_off])
        seg_stage = torch.cat([torch.zeros_like(g0), torch.ones_like(r_g0)])
        order = torch.argsort(seg_g0)
        seg_g0, seg_g1, seg_off, seg_stage = seg_g0[order], seg_g1[order], seg_off[order], seg_stage[order]

        pi, gi = _overlap_pairs(lo, hi, seg_g0, seg_g1)
        s = si[pi]
        a, b = a[pi], b[pi]
        ks, ke, alpha, beta = sl.ks[s], sl.ke[s], sl.alpha[s], sl.beta[s]
        K0 = torch.maximum(ks, seg_g0[gi])
        K1 = torch.minimum(ke, seg_g1[gi])
        # Rows i >= p1 have the lower bound on the diagonal (i + alpha >= K0),
        # rows i < p2 the upper one (i + beta <= K1); elsewhere the bound is
        # the rectangle's edge. Each row band is one slice of a single type.
        p1 = K0 - alpha
        p2 = K1 - beta + 1
        lo_p, hi_p = torch.minimum(p1, p2), torch.maximum(p1, p2)
        aA, bA = a, torch.minimum(b, lo_p)
        aB, bB = torch.maximum(a, lo_p), torch.minimum(b, hi_p)
        aC, bC = torch.maximum(a, hi_p), b
        mid_band = p1 <= p2  # middle band: both diagonals (BI) or neither (FULL)
        bands = [
            (aA, bA, K0, bA - 1 + beta, torch.full_like(a, CAUSAL)),
            (aB, bB, torch.where(mid_band, aB + alpha, K0), torch.where(mid_band, bB - 1 + beta, K1),
             torch.where(mid_band, BI_CAUSAL, FULL)),
            (aC, bC, aC + alpha, K1, torch.full_like(a, INV_CAUSAL)),
        ]
        qa, qb, kc, kd, ty = (torch.stack([band[j] for band in bands], 1).reshape(-1) for j in range(5))
        rep = torch.arange(pi.numel()).repeat_interleave(3)
        keep = (qb > qa) & (kd > kc) & ((ty != BI_CAUSAL) | (kd - kc >= qb - qa))
        qa, qb, kc, kd, ty, rep = qa[keep], qb[keep], kc[keep], kd[keep], ty[keep], rep[keep]
        run = ri[pi][rep]
        seg = gi[rep]
        row_shift = l0[run] - g0[run]
        key_shift = seg_off[seg] - seg_g0[seg]
        stage = seg_stage[seg]
        q_loc = torch.stack([qa + row_shift, qb + row_shift], 1)
        k_loc = torch.stack([kc + key_shift, kd + key_shift], 1)

        def pick(mask, k_offset=0):
            return (q_loc[mask].to(torch.int32), (k_loc[mask] + k_offset).to(torch.int32), ty[mask].to(torch.int32))

        remote = stage == 1
        return LocalRanges(
            local=pick(~remote),
            remote=pick(remote),
            combined=(q_loc.to(torch.int32), (k_loc + remote[:, None] * self.local_seqlen).to(torch.int32),
                      ty.to(torch.int32)),
        )

    # ------------------------------------------------------------ figures

    def rank_area(self, contiguous: bool = False) -> torch.Tensor:
        """`(W,)` int64: covered cells of each rank's rows (``contiguous=True``: of the contiguous split)."""
        owner = torch.arange(self.num_chunks) // self.chunks_per_rank if contiguous else self.chunk_owner
        return torch.zeros(self.world_size, dtype=torch.int64).index_add_(0, owner, self.chunk_area)

    def imbalance(self, contiguous: bool = False) -> float:
        """Largest rank area over the mean rank area (1.0 is perfect; 1.0 for an empty mask)."""
        area = self.rank_area(contiguous).double()
        mean = float(area.mean())
        return float(area.max()) / mean if mean > 0 else 1.0

    @property
    def recv_tokens(self) -> torch.Tensor:
        """`(W,)` int64: key/value tokens each rank receives."""
        return torch.tensor([sum(self.recv_splits(r)) for r in range(self.world_size)], dtype=torch.int64)

    @property
    def send_tokens(self) -> torch.Tensor:
        """`(W,)` int64: key/value tokens each rank sends."""
        return torch.tensor([sum(self.send_splits(r)) for r in range(self.world_size)], dtype=torch.int64)

    @property
    def ring_tokens(self) -> torch.Tensor:
        """`(W,)` int64: what ring attention moves into each rank (every other rank's keys), for comparison."""
        return torch.full((self.world_size,), (self.world_size - 1) * self.local_seqlen, dtype=torch.int64)

    def traffic_bytes(self, heads_kv: int, head_dim: int, head_dim_v=None, dtype=torch.bfloat16) -> torch.Tensor:
        """`(W,)` int64: bytes of K and V each rank receives in the forward (the backward returns as many)."""
        dv = head_dim if head_dim_v is None else int(head_dim_v)
        per_token = int(heads_kv) * (int(head_dim) + dv) * torch.empty(0, dtype=dtype).element_size()
        return self.recv_tokens * per_token

    def figures(self) -> dict:
        """Balance and traffic figures as plain Python values (per-rank lists and summaries)."""
        recv = self.recv_tokens
        return {
            "total_seqlen": self.total_seqlen,
            "world_size": self.world_size,
            "chunk_size": self.chunk_size,
            "num_chunks": self.num_chunks,
            "local_seqlen": self.local_seqlen,
            "strategy": self.strategy,
            "rank_area": self.rank_area().tolist(),
            "imbalance": self.imbalance(),
            "contiguous_imbalance": self.imbalance(contiguous=True),
            "recv_tokens": recv.tolist(),
            "send_tokens": self.send_tokens.tolist(),
            "ring_tokens": self.ring_tokens.tolist(),
            "recv_over_ring": float(recv.sum()) / max(1, int(self.ring_tokens.sum())),
        }

    def summary(self) -> str:
        """A text table of the figures, one row per rank."""
        f = self.figures()
        lines = [
            f"T={self.total_seqlen} world={self.world_size} chunk={self.chunk_size} chunks={self.num_chunks} "
            f"local={self.local_seqlen} assignment={self.strategy}",
            f"area max/mean {f['imbalance']:.4f} (contiguous split {f['contiguous_imbalance']:.4f}); "
            f"received keys {f['recv_over_ring']:.3f} x a ring's",
            f"{'rank':>4} {'area (cells)':>16} {'area/mean':>9} {'recv tokens':>12} {'send tokens':>12} "
            f"{'ring recv':>10}",
        ]
        area = self.rank_area().double()
        mean = float(area.mean()) or 1.0
        for r in range(self.world_size):
            lines.append(
                f"{r:>4} {int(area[r]):>16} {float(area[r]) / mean:>9.4f} {f['recv_tokens'][r]:>12} "
                f"{f['send_tokens'][r]:>12} {f['ring_tokens'][r]:>10}"
            )
        return "\n".join(lines)


def plan_context_parallel(q_ranges, k_ranges, mask_types, total_seqlen: int, world_size: int,
                          chunk_size=None) -> ContextParallelPlan:
    """Plan a global self-attention mask over ``world_size`` ranks, on the host, without processes.

    Args:
        q_ranges, k_ranges: `(S, 2)` int32 global ranges; mask_types: `(S,)`
            int32 (any device; read on the host). Queries and keys share one
            token axis of ``total_seqlen`` tokens.
        total_seqlen: ``T``.
        world_size: ranks of the context-parallel group.
        chunk_size: tokens per chunk; ``None`` picks :func:`default_chunk_size`.

    Returns:
        A :class:`ContextParallelPlan` with the assignment, the communication
        lists, the local ranges of every rank and the balance and traffic
        figures.

    Raises:
        ValueError: a non-empty slice outside ``[0, T]``, an unknown type, or
            a bad size.
    """
    return ContextParallelPlan(q_ranges, k_ranges, mask_types, total_seqlen, world_size, chunk_size)
