"""``RangeMask``: a mask written as ranges, its builders, and tools to look at it.

A mask is three int32 tensors (docs/design.md §2): ``q_ranges (S, 2)``,
``k_ranges (S, 2)`` and ``mask_types (S,)``. Slice ``s`` is the rectangle
``[qs, qe) x [ks, ke)`` of the (query, key) plane, and its type says which
cells of the rectangle it covers (``Lq = qe - qs``, ``Lk = ke - ks``,
``i' = i - qs``, ``j' = j - ks``)::

    FULL (0)        CAUSAL (1)      INV_CAUSAL (2)   BI_CAUSAL (3)
    always          j' <= i'+Lk-Lq  j' >= i'         both
    # # # # # #     # # # . . .     # # # # # #      # # # . . .
    # # # # # #     # # # # . .     . # # # # #      . # # # . .
    # # # # # #     # # # # # .     . . # # # #      . . # # # .
    # # # # # #     # # # # # #     . . . # # #      . . . # # #

Builders (``RangeMask.causal(...)``, ``RangeMask.varlen(...)``...) run on the
host, produce non-overlapping slices and return a ``RangeMask`` on the device
you ask for. ``pad_to`` / ``bucketed`` append empty ``[0, 0)`` slices so that
the slice count, and therefore compiled graphs, stay fixed from step to step.

The device-side window decomposition (:func:`window_slices`) is shared with
the FlashAttention-style front-ends of :mod:`flashrange.compat`, which build
their ranges on the GPU with static shapes.
"""

from __future__ import annotations

import torch

from .constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, TYPE_NAMES
from .convert import dense_to_ranges, mask_mod_to_ranges
from .interface import plan_mask
from .reference import coverage_counts
from .validation import check_range_values, check_window
from .window import UNBOUNDED, window_slices

__all__ = ["RangeMask", "bucket_capacity"]

# Above this many pairs, the overlap check is done in chunks of slices.
_PAIR_CHUNK = 1 << 20


def bucket_capacity(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)``: the slice capacity of a bucket."""
    n = int(n)
    if n < 0:
        raise ValueError(f"the slice count must be >= 0, got {n}")
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _as_int32(x, name, device):
    """Lists / tuples become int32 tensors; tensors are kept (no copy) unless moved."""
    if isinstance(x, torch.Tensor):
        return x if device is None else x.to(device)
    try:
        t = torch.tensor(x, dtype=torch.int32, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be a tensor or a nested list of ints, got {x!r}") from e
    if name != "mask_types" and t.numel() == 0:
        t = t.reshape(0, 2)
    return t


def _tri(n):
    """``n (n + 1) / 2`` elementwise (int64)."""
    return n * (n + 1) // 2


def _cu_seqlens(cu, name):
    """Host int64 tensor from a list / tensor of cumulative lengths, checked."""
    t = torch.as_tensor(cu).detach().to("cpu", torch.int64).reshape(-1)
    if t.numel() < 1:
        raise ValueError(f"{name} must hold at least one value (0), got an empty sequence")
    if int(t[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {t.tolist()[:8]}")
    if t.numel() > 1 and bool((t[1:] < t[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (cumulative lengths), got {t.tolist()[:16]}")
    return t


class RangeMask:
    """A mask written as ranges: ``q_ranges (S, 2)``, ``k_ranges (S, 2)``, ``mask_types (S,)`` int32.

    Args:
        q_ranges, k_ranges: tensors or nested lists ``[[start, end), ...]``.
        mask_types: tensor or list of types (0 FULL, 1 CAUSAL, 2 INV_CAUSAL,
            3 BI_CAUSAL); ``None`` means all FULL.
        device: where to put the tensors (lists default to the CPU).

    Lists are converted to int32; tensors are kept as given (no copy, so that
    in-place updates of a captured mask are seen) and must already be int32.
    The constructor checks shapes and dtypes only (free); :meth:`validate`
    checks the values against the tensor sizes.

    Use it with :func:`flashrange.range_attention` as
    ``range_attention(q, k, v, *mask.tensors())``.
    """

    def __init__(self, q_ranges, k_ranges, mask_types=None, *, device=None):
        q_ranges = _as_int32(q_ranges, "q_ranges", device)
        k_ranges = _as_int32(k_ranges, "k_ranges", device)
        if mask_types is None:
            n = q_ranges.shape[0] if q_ranges.dim() > 0 else 0
            mask_types = torch.full((n,), FULL, dtype=torch.int32, device=q_ranges.device)
        mask_types = _as_int32(mask_types, "mask_types", device)
        self.q_ranges, self.k_ranges, self.mask_types = q_ranges, k_ranges, mask_types
        self._check_static()

    # ------------------------------------------------------------------ basics

    def _check_static(self):
        """Shapes, dtypes and devices: raise ``ValueError`` saying what to fix."""
        for name in ("q_ranges", "k_ranges", "mask_types"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}; convert with {name}.to(torch.int32)")
        for name in ("q_ranges", "k_ranges"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[1] != 2:
                raise ValueError(f"{name} must have shape (S, 2) (one [start, end) per slice), got {tuple(t.shape)}")
        if self.mask_types.dim() != 1:
            raise ValueError(f"mask_types must have shape (S,), got {tuple(self.mask_types.shape)}")
        n = (self.q_ranges.shape[0], self.k_ranges.shape[0], self.mask_types.shape[0])
        if len(set(n)) != 1:
            raise ValueError(
                f"q_ranges, k_ranges and mask_types must describe the same number of slices, got {n[0]}, {n[1]}, {n[2]}"
            )
        devs = {self.q_ranges.device, self.k_ranges.device, self.mask_types.device}
        if len(devs) != 1:
            raise ValueError(
                f"q_ranges, k_ranges and mask_types must be on one device, got {self.q_ranges.device}, "
                f"{self.k_ranges.device}, {self.mask_types.device}; move the mask with mask.to(device)"
            )

    @property
    def num_slices(self) -> int:
        """``S``, empty slices included."""
        return self.q_ranges.shape[0]

    @property
    def device(self) -> torch.device:
        return self.q_ranges.device

    def tensors(self):
        """``(q_ranges, k_ranges, mask_types)``, ready for ``range_attention(q, k, v, *mask.tensors())``."""
        return self.q_ranges, self.k_ranges, self.mask_types

    def plan(self, Tq: int, Tk: int | None = None):
        """The :class:`~flashrange.plan.RangePlan` of this mask over ``Tq x Tk`` tokens.

        Build it once per step and pass it as ``plan=`` to every attention
        call that uses the mask (see :func:`flashrange.plan_mask`).
        """
        return plan_mask(self.q_ranges, self.k_ranges, self.mask_types, int(Tq), int(Tq if Tk is None else Tk))

    def to(self, device) -> "RangeMask":
        """The same mask on ``device`` (``self`` when already there)."""
        moved = tuple(t.to(device) for t in self.tensors())
        if all(m is t for m, t in zip(moved, self.tensors())):
            return self
        return RangeMask(*moved)

    def __len__(self) -> int:
        return self.num_slices

    def __repr__(self) -> str:
        rows = []
        for (qs, qe), (ks, ke), t in zip(self.q_ranges.tolist()[:8], self.k_ranges.tolist()[:8], self.mask_types.tolist()[:8]):
            rows.append(f"[{qs}, {qe}) x [{ks}, {ke}) {TYPE_NAMES.get(t, t)}")
        more = ", ..." if self.num_slices > 8 else ""
        return f"RangeMask({self.num_slices} slices on {self.device}: " + "; ".join(rows) + more + ")"

    def pad_to(self, capacity: int) -> "RangeMask":
        """Append empty ``[0, 0)`` FULL slices up to ``capacity`` slices.

        Padding changes no output bit; a fixed capacity keeps compiled graphs
        (and CUDA graphs) valid while the number of real slices changes.
        """
        capacity = int(capacity)
        if capacity < self.num_slices:
            raise ValueError(
                f"cannot pad {self.num_slices} slices to a capacity of {capacity}: the capacity must be "
                f">= the slice count (use bucketed() or a larger capacity)"
            )
        extra = capacity - self.num_slices
        if extra == 0:
            return self
        dev = self.device
        pad2 = torch.zeros(extra, 2, dtype=torch.int32, device=dev)
        return RangeMask(
            torch.cat([self.q_ranges, pad2]),
            torch.cat([self.k_ranges, pad2]),
            torch.cat([self.mask_types, torch.full((extra,), FULL, dtype=torch.int32, device=dev)]),
        )

    def bucketed(self, min_capacity: int = 1) -> "RangeMask":
        """Pad to the next power of two (at least ``min_capacity``): ``log2(max)`` compilations at most."""
        return self.pad_to(bucket_capacity(max(self.num_slices, int(min_capacity))))

    def _extent(self):
        """``(Tq, Tk)`` just large enough for every slice (host sync)."""
        if self.num_slices == 0:
            return 0, 0
        return int(self.q_ranges[:, 1].max().clamp(min=0)), int(self.k_ranges[:, 1].max().clamp(min=0))

    def _sizes(self, Tq, Tk):
        eq, ek = self._extent() if Tq is None or Tk is None else (0, 0)
        return (eq if Tq is None else int(Tq)), (ek if Tk is None else int(Tk))

    # ----------------------------------------------------------------- looking

    def coverage(self, Tq=None, Tk=None) -> torch.Tensor:
        """Int32 ``(Tq, Tk)``: how many slices cover each cell (dense: small masks only).

        ``Tq``/``Tk`` default to the largest range ends.
        """
        Tq, Tk = self._sizes(Tq, Tk)
        return coverage_counts(self.q_ranges, self.k_ranges, self.mask_types, Tq, Tk)

    def to_dense(self, Tq=None, Tk=None) -> torch.Tensor:
        """Bool ``(Tq, Tk)``: which cells any slice covers (dense: small masks only)."""
        return self.coverage(Tq, Tk) > 0

    def area(self) -> int:
        """Covered cells, overlaps counted as often as they are covered (FLOP counts).

        Closed form per slice, no dense matrix: fine for any length. Empty
        slices and unknown types count 0. Reads the result on the host.
        """
        if self.num_slices == 0:
            return 0
        qr, kr, mt = self.q_ranges.long(), self.k_ranges.long(), self.mask_types
        lq = (qr[:, 1] - qr[:, 0]).clamp(min=0)
        lk = (kr[:, 1] - kr[:, 0]).clamp(min=0)
        off = lk - lq
        # CAUSAL and INV_CAUSAL both drop a triangle of side max(Lk - Lq, 0)
        # from a triangle of side Lk (rows are clipped by Lq).
        tri = _tri(lk) - _tri(off.clamp(min=0))
        cells = torch.zeros_like(lq)
        cells = torch.where(mt == FULL, lq * lk, cells)
        cells = torch.where((mt == CAUSAL) | (mt == INV_CAUSAL), tri, cells)
        cells = torch.where(mt == BI_CAUSAL, lq * (off + 1).clamp(min=0), cells)
        cells = torch.where((lq > 0) & (lk > 0), cells, torch.zeros_like(cells))
        return int(cells.sum())

    def row_spans(self):
        """Per slice, the key interval of row ``i`` is ``[max(ks, i + alpha), min(ke, i + beta))``.

        Returns int64 host tensors ``qs, qe, ks, ke, alpha, beta`` (``alpha``
        / ``beta`` are +-unbounded where that side is not diagonal); empty
        slices and unknown types get ``qe = qs``.
        """
        qr, kr = self.q_ranges.cpu().long(), self.k_ranges.cpu().long()
        mt = self.mask_types.cpu().long()
        qs, qe, ks, ke = qr[:, 0], qr[:, 1], kr[:, 0], kr[:, 1]
        big = torch.full_like(qs, UNBOUNDED)
        diag_lo = (mt == INV_CAUSAL) | (mt == BI_CAUSAL)
        diag_hi = (mt == CAUSAL) | (mt == BI_CAUSAL)
        alpha = torch.where(diag_lo, ks - qs, -big)
        beta = torch.where(diag_hi, ke - qe + 1, big)
        valid = (mt >= FULL) & (mt <= BI_CAUSAL) & (qe > qs) & (ke > ks)
        qe = torch.where(valid, qe, qs)
        return qs, qe, ks, ke, alpha, beta

    def overlaps(self):
        """First pair of slices covering a common cell: ``(s, t, (i, j))``, or ``None``.

        Exact and dense-free: each slice covers, on row ``i``, the keys
        ``[max(ks, i + alpha), min(ke, i + beta))``, so two slices meet iff an
        integer row solves four linear inequalities. ``O(S^2)`` pairs, in chunks.
        """
        qs, qe, ks, ke, alpha, beta = self.row_spans()
        n = qs.numel()
        if n < 2:
            return None
        step = max(1, _PAIR_CHUNK // n)
        idx = torch.arange(n)
        for a0 in range(0, n, step):
            a = slice(a0, min(n, a0 + step))
            r0 = torch.maximum(qs[a, None], qs[None, :])
            r1 = torch.minimum(qe[a, None], qe[None, :])
            k_lo = torch.maximum(ks[a, None], ks[None, :])
            k_hi = torch.minimum(ke[a, None], ke[None, :])
            al = torch.maximum(alpha[a, None], alpha[None, :])
            be = torch.minimum(beta[a, None], beta[None, :])
            # Rows with i + al < k_hi and k_lo < i + be, inside [r0, r1).
            i0 = torch.maximum(r0, k_lo - be + 1)
            i1 = torch.minimum(r1, k_hi - al)
            hit = (i0 < i1) & (k_lo < k_hi) & (al < be) & (idx[a, None] < idx[None, :])
            if bool(hit.any()):
                s, t = (int(x) for x in hit.nonzero()[0])
                i = int(i0[s, t])
                j = int(torch.maximum(k_lo[s, t], i + al[s, t]))
                return a0 + s, t, (i, j)
        return None

    def validate(self, Tq: int, Tk: int, strict: bool = False) -> "RangeMask":
        """Check the mask against tensor sizes; raise ``ValueError`` saying what is wrong.

        Checks dtypes, shapes and devices, then every slice: known type,
        ranges inside ``[0, Tq]`` / ``[0, Tk]``, start <= end. With
        ``strict=True`` also rejects two slices covering the same cell
        (builders never produce that; overlaps are legal but count twice).
        Reads the tensors on the host. Returns ``self``.
        """
        self._check_static()
        check_range_values(self.q_ranges, self.k_ranges, self.mask_types, int(Tq), int(Tk))
        if strict:
            hit = self.overlaps()
            if hit is not None:
                s, t, (i, j) = hit
                raise ValueError(
                    f"slices {s} and {t} overlap: both cover cell (query {i}, key {j}); overlapping cells "
                    "count twice in the softmax. Split or trim one of them (or pass strict=False if intended)"
                )
        return self

    def plot(self, path, Tq=None, Tk=None, title=None, outline=True):
        """Write a PNG picture of the mask to ``path`` and return the path.

        Cells covered twice are drawn darker; with ``outline`` the rectangle
        of each non-empty slice is outlined (up to 256 slices). Large masks
        are averaged into pixels (no dense matrix). ``Tq``/``Tk`` default to
        the largest range ends. Needs matplotlib (``pip install matplotlib``).
        """
        from .picture import plot_mask

        Tq, Tk = self._sizes(Tq, Tk)
        return plot_mask(self, path, Tq, Tk, title=title, outline=outline)

    # ---------------------------------------------------------------- builders

    @classmethod
    def _from_rows(cls, rows, device):
        """From host rows ``(qs, qe, ks, ke, type)``, dropping empty ones."""
        rows = [r for r in rows if r[1] > r[0] and r[3] > r[2]]
        q = [[r[0], r[1]] for r in rows]
        k = [[r[2], r[3]] for r in rows]
        t = [r[4] for r in rows]
        return cls(
            torch.tensor(q, dtype=torch.int32).reshape(-1, 2),
            torch.tensor(k, dtype=torch.int32).reshape(-1, 2),
            torch.tensor(t, dtype=torch.int32).reshape(-1),
            device=device,
        )

    @classmethod
    def _from_tensors(cls, q_ranges, k_ranges, mask_types, device):
        keep = (q_ranges[:, 1] > q_ranges[:, 0]) & (k_ranges[:, 1] > k_ranges[:, 0])
        return cls(q_ranges[keep], k_ranges[keep], mask_types[keep], device=device)

    @classmethod
    def full(cls, Tq: int, Tk: int | None = None, *, device=None) -> "RangeMask":
        """Every query attends every key: one FULL slice.

        ::

            # # # # #
            # # # # #
            # # # # #
        """
        Tq, Tk = _lengths(Tq, Tk)
        return cls._from_rows([(0, Tq, 0, Tk, FULL)], device)

    @classmethod
    def causal(cls, Tq: int, Tk: int | None = None, *, device=None) -> "RangeMask":
        """Causal, aligned to the bottom-right corner as FlashAttention-3: ``j <= i + Tk - Tq``.

        ::

            Tq=3, Tk=5        Tq=5, Tk=3 (top rows see nothing)
            # # # . .         . . .
            # # # # .         . . .
            # # # # #         # . .
                              # # .
                              # # #
        """
        Tq, Tk = _lengths(Tq, Tk)
        return cls._from_rows([(0, Tq, 0, Tk, CAUSAL)], device)

    @classmethod
    def varlen(cls, cu_seqlens_q, cu_seqlens_k=None, causal: bool = False, window_size=(-1, -1), *, device=None):
        """Document mask from cumulative lengths, with FA3's causal / window per document.

        Document ``b`` is queries ``[cu_q[b], cu_q[b+1])`` by keys
        ``[cu_k[b], cu_k[b+1])`` (``cu_seqlens_k`` defaults to
        ``cu_seqlens_q``). Inside it, with ``off = Lk - Lq``, local query ``i``
        attends local key ``j`` when
        ``i + off - left <= j <= i + off + right`` (``window_size = (left,
        right)``, ``-1`` unbounded; ``causal`` sets ``right = 0``): exactly
        FlashAttention-3's ``flash_attn_varlen_func``. At most 3 slices per
        document (1 without a window).

        ::

            cu_seqlens=[0, 3, 5], causal=True
            # . . . .
            # # . . .
            # # # . .
            . . . # .
            . . . # #
        """
        cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
        cu_k = cu_q if cu_seqlens_k is None else _cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
        if cu_k.numel() != cu_q.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
                f"{cu_q.numel() - 1} and {cu_k.numel() - 1}"
            )
        left, right = check_window(window_size)
        if causal:
            right = 0
        qr, kr, mt = window_slices(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], left, right)
        return cls._from_tensors(qr, kr, mt, device)

    @classmethod
    def sliding_window(cls, T: int, window: int, causal: bool = True, *, device=None) -> "RangeMask":
        """Sliding window of ``window`` keys.

        ``causal=True``: query ``i`` attends keys ``i - window + 1 .. i`` (its
        own key and the ``window - 1`` before it), FA3's
        ``window_size=(window - 1, 0)``. ``causal=False``: keys
        ``i - window + 1 .. i + window - 1``, ``window_size=(window - 1,
        window - 1)``. At most 3 slices.

        ::

            T=6, window=3, causal=True
            # . . . . .
            # # . . . .
            # # # . . .
            . # # # . .
            . . # # # .
            . . . # # #
        """
        T, _ = _lengths(T, None)
        window = int(window)
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys per query, its own included), got {window}")
        ws = (window - 1, 0) if causal else (window - 1, window - 1)
        return cls.varlen([0, T], window_size=ws, device=device)

    @classmethod
    def prefix_lm(cls, T: int, prefix_len: int, *, device=None) -> "RangeMask":
        """Prefix-LM: the first ``prefix_len`` tokens attend each other fully, the rest causally.

        Every query sees the whole prefix; a query after it also sees the
        non-prefix keys up to itself. Two slices.

        ::

            T=5, prefix_len=2
            # # . . .
            # # . . .
            # # # . .
            # # # # .
            # # # # #
        """
        T, _ = _lengths(T, None)
        p = int(prefix_len)
        if not 0 <= p <= T:
            raise ValueError(f"prefix_len must be in [0, T={T}], got {p}")
        return cls._from_rows([(0, T, 0, p, FULL), (p, T, p, T, CAUSAL)], device)

    @classmethod
    def block_causal(cls, T: int, block_size: int, *, device=None) -> "RangeMask":
        """Block-causal (chunked-causal): full attention inside a block and to every earlier block.

        Query block ``b`` attends keys ``[0, end of block b)``. One slice per
        block. (For local chunks that see only themselves, see
        :meth:`chunked_causal`.)

        ::

            T=5, block_size=2
            # # . . .
            # # . . .
            # # # # .
            # # # # .
            # # # # #
        """
        T, _ = _lengths(T, None)
        bs = _block(block_size)
        return cls._from_rows([(s, min(s + bs, T), 0, min(s + bs, T), FULL) for s in range(0, T, bs)], device)

    @classmethod
    def chunked_causal(cls, T: int, chunk_size: int, *, device=None) -> "RangeMask":
        """Local chunks (Llama-4 style): causal attention inside each chunk, nothing across chunks.

        Query ``i`` attends key ``j`` when both are in the same chunk of
        ``chunk_size`` tokens and ``j <= i``. One CAUSAL slice per chunk.
        (For full attention to earlier blocks, see :meth:`block_causal`.)

        ::

            T=5, chunk_size=2
            # . . . .
            # # . . .
            . . # . .
            . . # # .
            . . . . #
        """
        T, _ = _lengths(T, None)
        cs = _block(chunk_size, "chunk_size")
        return cls._from_rows([(s, min(s + cs, T), s, min(s + cs, T), CAUSAL) for s in range(0, T, cs)], device)

    @classmethod
    def shared_question(cls, question_len: int, answer_lens, causal: bool = True, *, device=None) -> "RangeMask":
        """One question followed by several answers that each see the question and themselves.

        Tokens are ``[question, answer_0, answer_1, ...]``. The question
        attends itself (causally when ``causal``); answer ``a`` attends the
        whole question and itself (causally when ``causal``), never another
        answer. ``1 + 2 * len(answer_lens)`` slices.

        ::

            question_len=2, answer_lens=[2, 1], causal=True
            # . . . .
            # # . . .
            # # # . .
            # # # # .
            # # . . #
        """
        qlen = int(question_len)
        if qlen < 0:
            raise ValueError(f"question_len must be >= 0, got {qlen}")
        lens = [int(x) for x in (answer_lens.tolist() if isinstance(answer_lens, torch.Tensor) else answer_lens)]
        if any(x < 0 for x in lens):
            raise ValueError(f"answer_lens must be >= 0, got {lens}")
        own = CAUSAL if causal else FULL
        rows = [(0, qlen, 0, qlen, own)]
        start = qlen
        for n in lens:
            rows.append((start, start + n, 0, qlen, FULL))
            rows.append((start, start + n, start, start + n, own))
            start += n
        return cls._from_rows(rows, device)

    @classmethod
    def block_sparse(cls, blocks, block_size: int, Tq: int, Tk: int | None = None, *, device=None) -> "RangeMask":
        """FULL blocks from a list of ``(q_block, k_block)`` pairs.

        Block ``(b, c)`` covers queries ``[b * bs, (b + 1) * bs)`` by keys
        ``[c * bs, (c + 1) * bs)``, clipped to ``Tq`` / ``Tk``. Duplicate pairs
        count once. Adjacent key blocks of a query block merge into one slice,
        then query blocks with the same key runs merge vertically.

        ::

            blocks=[(0, 0), (1, 0), (1, 1), (2, 2)], block_size=1
            # . .
            # # .
            . . #
        """
        Tq, Tk = _lengths(Tq, Tk)
        bs = _block(block_size)
        nq, nk = -(-Tq // bs), -(-Tk // bs)
        if isinstance(blocks, torch.Tensor):
            blocks = blocks.tolist()
        pairs = set()
        for p in blocks:
            try:
                b, c = (int(x) for x in p)
            except (TypeError, ValueError) as e:
                raise ValueError(f"blocks must be (q_block, k_block) pairs of ints, got {p!r}") from e
            if not (0 <= b < nq and 0 <= c < nk):
                raise ValueError(
                    f"block ({b}, {c}) is outside the {nq} x {nk} grid of {bs}-token blocks for Tq={Tq}, Tk={Tk}"
                )
            pairs.add((b, c))
        runs_of = {}
        for b, c in sorted(pairs):
            runs = runs_of.setdefault(b, [])
            if runs and runs[-1][1] == c:
                runs[-1][1] = c + 1
            else:
                runs.append([c, c + 1])
        rows = []
        prev_b, prev_runs, start_b = None, None, None
        for b in sorted(runs_of) + [None]:
            runs = runs_of.get(b)
            if prev_b is not None and (b != prev_b + 1 or runs != prev_runs):
                for c0, c1 in prev_runs:
                    rows.append((start_b * bs, min((prev_b + 1) * bs, Tq), c0 * bs, min(c1 * bs, Tk), FULL))
                start_b = b
            elif prev_b is None:
                start_b = b
            prev_b, prev_runs = b, runs
        return cls._from_rows(rows, device)

    @classmethod
    def from_dense(cls, mask: torch.Tensor, *, device=None, chunk_rows: int | None = None) -> "RangeMask":
        """Few non-overlapping slices covering exactly the ``True`` cells of a bool ``(Tq, Tk)`` mask.

        ``True`` = attend (SDPA's boolean ``attn_mask``). Each row's covered
        keys are cut into runs; runs of consecutive rows whose start and end
        move by 0 or 1 key per row become one FULL, CAUSAL, INV_CAUSAL or
        BI_CAUSAL slice, so ``to_dense(Tq, Tk)`` of the result equals
        ``mask``. Vectorised on the mask's device; the result goes to
        ``device`` (default: the mask's). See
        :func:`flashrange.convert.dense_to_ranges`.

        ::

            mask (prefix-LM)       slices
            # # . . .              [0, 2) x [0, 2) FULL
            # # . . .              [2, 5) x [0, 5) CAUSAL
            # # # . .
            # # # # .
            # # # # #
        """
        return cls(*dense_to_ranges(mask, device=device, chunk_rows=chunk_rows))

    @classmethod
    def from_mask_mod(cls, mask_mod, Tq: int | None = None, Tk: int | None = None, *, device=None,
                      chunk_rows: int | None = None) -> "RangeMask":
        """Slices of a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` or ``BlockMask``, exact per token.

        Evaluated at ``b = h = 0``, a chunk of rows at a time (never the
        whole dense mask), by broadcasting ``q_idx (C, 1)`` against
        ``kv_idx (1, Tk)``, or under ``torch.vmap`` as FlexAttention's
        ``create_mask`` when that fails. Gives the same slices as
        :meth:`from_dense` of the dense evaluation. ``device`` is where the
        mask_mod runs (that of the tensors it closes over) and where the
        result lives. See :func:`flashrange.convert.mask_mod_to_ranges`.

        ::

            mask_mod = lambda b, h, q, kv: (kv <= q) & (q - kv < 3)   Tq = Tk = 6
            # . . . . .            [0, 3) x [0, 3) CAUSAL
            # # . . . .            [3, 6) x [1, 6) BI_CAUSAL
            # # # . . .
            . # # # . .
            . . # # # .
            . . . # # #
        """
        return cls(*mask_mod_to_ranges(mask_mod, Tq, Tk, device=device, chunk_rows=chunk_rows))


def _lengths(Tq, Tk):
    Tq = int(Tq)
    Tk = Tq if Tk is None else int(Tk)
    if Tq < 0 or Tk < 0:
        raise ValueError(f"lengths must be >= 0, got Tq={Tq}, Tk={Tk}")
    return Tq, Tk


def _block(size, name="block_size"):
    size = int(size)
    if size < 1:
        raise ValueError(f"{name} must be >= 1, got {size}")
    return size
