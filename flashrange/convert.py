"""Masks from other libraries: a dense boolean matrix or a FlexAttention ``mask_mod`` turned into slices.

Users arriving from SDPA (a boolean ``attn_mask``) or from FlexAttention (a
``mask_mod`` function, or the ``BlockMask`` built from it) should not have to
rewrite their mask as ranges by hand. The converters here return the three
range tensors (``RangeMask.from_dense`` / ``RangeMask.from_mask_mod`` wrap
them in a mask) and go through one path:

1. each row's covered keys are cut into **runs** (maximal intervals of
   ``True``), a chunk of rows at a time, with vectorised torch ops on the
   mask's device;
2. a run on row ``i + 1`` **continues** a run on row ``i`` when its start
   and its end each move by 0 or 1 key; these links string the runs into
   chains (a run has at most one successor: two runs of one row are at least
   two keys apart);
3. each chain is cut greedily into stretches whose start and end move by the
   same amount on every row, and each stretch becomes one slice: both fixed
   is FULL, the end moving is CAUSAL, the start moving is INV_CAUSAL, both
   moving is BI_CAUSAL (a band).

A slice covers exactly the runs of its rows, so the result reproduces the
mask cell for cell and no two slices overlap. The greedy cut is optimal for
each chain (any part of a valid stretch is valid), so causal, sliding-window,
document, prefix-LM and block-sparse masks come back as the few slices their
builders would produce. Runs are never split, so a mask whose best cover
splits a row's run between two slices may get more slices than the best.

Rows are evaluated in chunks, and the runs do not depend on the chunking, so
``RangeMask.from_mask_mod`` gives the same slices as ``RangeMask.from_dense`` on the full
dense mask without ever holding it.
"""

from __future__ import annotations

import torch

from .constants import BI_CAUSAL, CAUSAL, FULL, INV_CAUSAL, MAX_TOKENS

__all__ = ["dense_to_ranges", "mask_mod_to_ranges"]

# Cells per chunk of rows. Bounds the booleans of one chunk and, more to the
# point, the int64 temporaries that FlexAttention-style mask_mods create
# (``q_idx - kv_idx`` is eight bytes a cell), while keeping chunks large
# enough that the per-chunk overhead is invisible.
_CHUNK_CELLS = 1 << 24

# Slice type of a stretch by how its runs move per row: index
# ``2 * (start moves) + (end moves)``.
_TYPE_OF_MOVE = (FULL, CAUSAL, INV_CAUSAL, BI_CAUSAL)


# --------------------------------------------------------------------- runs


def _row_runs(chunk: torch.Tensor):
    """Runs of ``True`` in each row of a bool chunk.

    Args:
        chunk: bool ``(C, Tk)``.

    Returns:
        ``rows, lo, hi``: int64 ``(R,)`` each, run ``r`` covering keys
        ``[lo[r], hi[r])`` of chunk row ``rows[r]``, ordered by row, then key.
    """
    C, Tk = chunk.shape
    dev = chunk.device
    if C == 0 or Tk == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        return empty, empty, empty
    # An edge sits between two keys that differ; a run starts or ends at each
    # edge, plus at the first / past the last key of a row whose border key is
    # covered. Comparing the two shifted views avoids copying the chunk into a
    # padded buffer (one pass over the cells fewer).
    inner_rows, inner_pos = (chunk[:, 1:] != chunk[:, :-1]).nonzero(as_tuple=True)
    first_rows = chunk[:, 0].nonzero().squeeze(1)
    last_rows = chunk[:, -1].nonzero().squeeze(1)
    rows = torch.cat([inner_rows, first_rows, last_rows])
    pos = torch.cat([inner_pos + 1, torch.zeros_like(first_rows), torch.full_like(last_rows, Tk)])
    # Interior edges come out of nonzero row-major already; one sort puts the
    # border edges in place. Edges then alternate start, end within each row.
    order = torch.argsort(rows * (Tk + 1) + pos)
    rows, pos = rows[order], pos[order]
    return rows[0::2], pos[0::2], pos[1::2]


# ------------------------------------------------------------------- slices


def _slices_from_runs(rows, lo, hi, Tq: int, Tk: int):
    """Fewest slices covering exactly the given runs, none overlapping.

    Args:
        rows, lo, hi: int64 ``(R,)`` runs ordered by row, then key (as
            :func:`_row_runs` returns them, rows made global).
        Tq, Tk: the mask's size.

    Returns:
        ``q_ranges (S, 2)``, ``k_ranges (S, 2)``, ``mask_types (S,)`` int32 on
        the runs' device, ordered by query start, then key start.
    """
    n = rows.numel()
    dev = rows.device
    if n == 0:
        z2 = torch.zeros(0, 2, dtype=torch.int32, device=dev)
        return z2, z2.clone(), torch.zeros(0, dtype=torch.int32, device=dev)
    idx = torch.arange(n, device=dev)

    # Link each run to the run of the next row whose start is the same or one
    # key later: the first run at or after that key, found by one search.
    key = rows * (Tk + 1) + lo
    cand = torch.searchsorted(key, (rows + 1) * (Tk + 1) + lo).clamp(max=n - 1)
    dlo, dhi = lo[cand] - lo, hi[cand] - hi
    linked = (rows[cand] == rows + 1) & (dlo >= 0) & (dlo <= 1) & (dhi >= 0) & (dhi <= 1)
    prev = torch.full((n,), -1, dtype=torch.int64, device=dev)
    prev[cand[linked]] = idx[linked]

    # Chain of each run = its first run, by pointer doubling over the
    # predecessor links (a chain has at most one run per row, so a fixed
    # number of doublings covers the longest one without reading values).
    root = torch.where(prev >= 0, prev, idx)
    for _ in range(max(Tq, 1).bit_length()):
        root = root[root]
    # Runs are ordered by row, so a stable sort by chain keeps each chain's
    # runs consecutive and in row order.
    order = torch.sort(root, stable=True).indices
    R, L, H = rows[order], lo[order], hi[order]
    head = prev[order] < 0

    # Move of each run relative to the run above it in its chain
    # (meaningless at chain heads): 2 * (start moved) + (end moved).
    move = torch.zeros(n, dtype=torch.int64, device=dev)
    move[1:] = 2 * (L[1:] - L[:-1]) + (H[1:] - H[:-1])

    # Greedy cut of every chain, vectorised. Group a chain's consecutive equal
    # moves into "move groups". A greedy stretch takes the moves of one group:
    # all of them plus the row above the group ("entered first"), or all but
    # the first, whose row then opens the stretch (that first move was the
    # boundary with the stretch before). A chain's first group is entered
    # first, and so is any group right after a skipped one. A group of a
    # single move that is not entered first is skipped: its move is a
    # boundary and its row opens the next group's stretch. So along a streak
    # of single-move groups, skipped and entered-first alternate, starting
    # with skipped unless the streak opens its chain; longer groups are never
    # skipped.
    nonhead = ~head
    prev_head = torch.ones(n, dtype=torch.bool, device=dev)
    prev_head[1:] = head[:-1]
    prev_move = torch.full((n,), -1, dtype=torch.int64, device=dev)
    prev_move[1:] = move[:-1]
    grp_start = nonhead & (prev_head | (move != prev_move))
    next_is_new = torch.ones(n, dtype=torch.bool, device=dev)
    next_is_new[:-1] = head[1:] | grp_start[1:]
    grp_first = grp_start.nonzero().squeeze(1)  # position of each group's first move
    grp_last = (nonhead & next_is_new).nonzero().squeeze(1)  # and of its last
    opens_chain = prev_head[grp_first]
    single = grp_last == grp_first
    g = grp_first.numel()
    gidx = torch.arange(g, device=dev)
    prev_single = torch.zeros(g, dtype=torch.bool, device=dev)
    prev_single[1:] = single[:-1]
    streak_open = single & (opens_chain | ~prev_single)
    open_at = torch.cummax(torch.where(streak_open, gidx, torch.zeros_like(gidx)), 0).values
    parity = (gidx - open_at) % 2
    skipped = single & torch.where(opens_chain[open_at], parity == 1, parity == 0)
    prev_skipped = torch.zeros(g, dtype=torch.bool, device=dev)
    prev_skipped[1:] = skipped[:-1]
    entered_first = opens_chain | prev_skipped

    starts_mask = head.clone()
    starts_mask[grp_first[~entered_first]] = True
    starts = starts_mask.nonzero().squeeze(1)
    ends = torch.empty_like(starts)
    ends[:-1] = starts[1:] - 1
    ends[-1] = n - 1

    # One slice per stretch: rows [R[s], R[e] + 1), keys from the first run's
    # start l0 to the last run's end; the type follows the move inside the
    # stretch (a single row is FULL). With n rows and first end h0, a moving
    # end gives ke = h0 + n - 1, so Lk - Lq = h0 - 1 - l0 and the CAUSAL bound
    # j' <= i' + Lk - Lq ends local row i' at h0 + i', as the runs do; a
    # moving start is INV_CAUSAL's j' >= i'; BI_CAUSAL is both.
    one_row = starts == ends
    inner_move = move[(starts + 1).clamp(max=n - 1)]
    types = torch.tensor(_TYPE_OF_MOVE, dtype=torch.int64, device=dev)[inner_move.clamp(0, 3)]
    types = torch.where(one_row, torch.full_like(types, FULL), types)
    qs, qe = R[starts], R[ends] + 1
    ks, ke = L[starts], H[ends]
    by_pos = torch.argsort(qs * (Tk + 1) + ks)
    q_ranges = torch.stack([qs, qe], 1)[by_pos].to(torch.int32)
    k_ranges = torch.stack([ks, ke], 1)[by_pos].to(torch.int32)
    return q_ranges, k_ranges, types[by_pos].to(torch.int32)


def _chunk_rows(chunk_rows, Tk: int) -> int:
    """Rows per chunk: the caller's choice, else as many as fit the cell budget."""
    if chunk_rows is None:
        return max(1, _CHUNK_CELLS // max(Tk, 1))
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int (rows evaluated at a time), got {chunk_rows!r}")
    return chunk_rows


def _check_sizes(Tq: int, Tk: int):
    for name, t in (("Tq", Tq), ("Tk", Tk)):
        if t < 0 or t > MAX_TOKENS:
            raise ValueError(f"{name} must be in [0, {MAX_TOKENS}] (int32 ranges), got {t}")


def _finish(runs, Tq: int, Tk: int, device):
    rows, lo, hi = (torch.cat(parts) for parts in zip(*runs))
    return tuple(t.to(device) for t in _slices_from_runs(rows, lo, hi, Tq, Tk))


# -------------------------------------------------------------------- dense


def dense_to_ranges(mask: torch.Tensor, *, device=None, chunk_rows: int | None = None):
    """Slices covering exactly the ``True`` cells of a dense boolean mask.

    ``True`` means "query ``i`` attends key ``j``", as in SDPA's boolean
    ``attn_mask`` and FlexAttention's ``create_mask``. The work runs on the
    mask's device with vectorised torch ops, a chunk of rows at a time, and
    reads only the resulting slices on the host.

    Args:
        mask: bool ``(Tq, Tk)`` on any device.
        device: device of the returned mask (default: the input's).
        chunk_rows: rows per chunk (default: a fixed cell budget); changes
            the temporary memory only, never the result.

    Returns:
        ``(q_ranges, k_ranges, mask_types)`` int32 on ``device``: non-overlapping, non-empty
        slices ordered by query start, then key start, such that
        ``RangeMask(*result).to_dense(Tq, Tk)`` equals ``mask``.

    Raises:
        ValueError: ``mask`` is not a bool tensor of two dimensions.
    """
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"mask must be a torch.Tensor of dtype bool and shape (Tq, Tk), got {type(mask).__name__}")
    if mask.dim() != 2:
        hint = ""
        if mask.dim() > 2:
            hint = " (a flashrange mask is shared by every head: pass one (Tq, Tk) mask, e.g. mask[0, 0])"
        raise ValueError(f"mask must have shape (Tq, Tk), got {tuple(mask.shape)}{hint}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be a bool tensor (True = attend, as SDPA's boolean attn_mask), got {mask.dtype}; "
            "convert an additive float mask with `mask == 0` and a 0/1 integer mask with `mask != 0`"
        )
    Tq, Tk = mask.shape
    _check_sizes(Tq, Tk)
    step = _chunk_rows(chunk_rows, Tk)
    runs = []
    for r0 in range(0, Tq, step):
        rows, lo, hi = _row_runs(mask[r0:r0 + step])
        runs.append((rows + r0, lo, hi))
    if not runs:
        runs.append(_row_runs(mask))
    return _finish(runs, Tq, Tk, mask.device if device is None else device)


# ----------------------------------------------------------------- mask_mod


def _block_mask_parts(block_mask):
    """``(mask_mod, Tq, Tk, gate)`` of a FlexAttention ``BlockMask`` at batch 0, head 0.

    ``gate(q_idx, device)`` takes the ``(C,)`` query indices of a chunk and
    returns bool ``partial (C, Tk)`` and ``full (C, Tk)`` (``None`` when the
    BlockMask keeps no full blocks) on ``device``: whether each cell lies in
    a block where FlexAttention applies the mask_mod, and in a block it
    takes whole without calling the mask_mod.
    """
    Tq, Tk = (int(x) for x in block_mask.seq_lengths)
    q_block, kv_block = (int(x) for x in block_mask.BLOCK_SIZE)
    n_kv = -(-Tk // kv_block)
    dev = block_mask.kv_num_blocks.device

    def dense(num, indices):
        # Block-level (q blocks, kv blocks) bool of one (batch, head); slots
        # past a row's count (undefined values) go to a spare column.
        if num is None:
            return None
        num = num.reshape(-1, num.shape[-1])[0]
        indices = indices.reshape(-1, *indices.shape[-2:])[0].long()
        used = torch.arange(indices.shape[-1], device=dev) < num.unsqueeze(-1)
        cols = torch.where(used & (indices >= 0) & (indices < n_kv), indices, n_kv)
        out = torch.zeros(indices.shape[0], n_kv + 1, dtype=torch.bool, device=dev)
        out.scatter_(1, cols, True)
        return out[:, :n_kv]

    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)

    def gate(q_idx, device):
        qb = (q_idx.reshape(-1) // q_block).clamp(max=partial.shape[0] - 1).to(dev)
        kb = torch.arange(Tk, device=dev) // kv_block
        p = partial[qb][:, kb].to(device)
        f = None if full is None else full[qb][:, kb].to(device)
        return p, f

    return block_mask.mask_mod, Tq, Tk, gate


class _Evaluator:
    """Calls a mask_mod on a chunk of rows: broadcasting first, ``torch.vmap`` if that fails."""

    def __init__(self, mask_mod, Tk: int, device):
        self.mask_mod, self.Tk, self.device = mask_mod, Tk, device
        self.broadcast = True
        self.broadcast_error = None
        # b = h = 0, as FlexAttention passes them: int64 index tensors.
        self.zero = torch.zeros((), dtype=torch.int64, device=device)
        self.kv_idx = torch.arange(Tk, device=device).unsqueeze(0)

    def _check(self, out, C: int, how: str):
        if not isinstance(out, torch.Tensor):
            out = torch.as_tensor(out, device=self.device)
        if out.dtype != torch.bool:
            raise ValueError(f"mask_mod must return a bool tensor (True = attend), got {out.dtype} ({how})")
        try:
            fits = out.dim() <= 2 and torch.broadcast_shapes(out.shape, (C, self.Tk)) == (C, self.Tk)
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"mask_mod returned shape {tuple(out.shape)} for {C} x {self.Tk} cells ({how})")
        return out.to(self.device).expand(C, self.Tk)

    def __call__(self, r0: int, r1: int) -> torch.Tensor:
        C = r1 - r0
        if self.broadcast:
            q_idx = torch.arange(r0, r1, device=self.device).unsqueeze(1)
            try:
                out = self.mask_mod(self.zero, self.zero, q_idx, self.kv_idx)
                out = self._check(out, C, "q_idx (C, 1), kv_idx (1, Tk)")
            except Exception as e:  # noqa: BLE001 - any failure means: not written elementwise
                # Python control flow on a tensor, indexing that does not
                # broadcast, or a wrong output shape: evaluate it the way
                # FlexAttention's create_mask does instead, for this chunk
                # and every later one.
                self.broadcast = False
                self.broadcast_error = e
            else:
                return out
        from torch.nn.attention.flex_attention import create_mask

        def shifted(b, h, q, kv):
            return self.mask_mod(b, h, q + r0, kv)

        try:
            out = create_mask(shifted, 1, 1, C, self.Tk, device=self.device)[0, 0]
        except Exception as e:
            raise ValueError(
                f"could not evaluate mask_mod: on index tensors q_idx (C, 1), kv_idx (1, Tk) it raised "
                f"{self.broadcast_error!r}; under torch.vmap (as FlexAttention's create_mask) it raised {e!r}. "
                f"Index tensors were made on {self.device}: pass device= where the tensors it closes over live"
            ) from e
        return self._check(out, C, "under torch.vmap")


def mask_mod_to_ranges(mask_mod, Tq: int | None = None, Tk: int | None = None, *, device=None,
                       chunk_rows: int | None = None):
    """Slices covering exactly the cells a FlexAttention ``mask_mod`` (or ``BlockMask``) allows.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` is evaluated at every token
    pair, exactly (no block rounding), with ``b = h = 0``: a mask that depends
    on the batch entry or the head is converted for batch 0, head 0 (flashrange
    masks are shared by every head; convert one mask per batch entry
    yourself). Rows are evaluated a chunk at a time, so the dense
    ``Tq x Tk`` mask is never held; the slices are the same as
    :func:`dense_to_ranges` of the dense evaluation.

    The mask_mod is first called once per chunk with ``q_idx`` of shape
    ``(C, 1)`` and ``kv_idx`` of shape ``(1, Tk)`` (int64): mask_mods written
    with elementwise tensor ops, as FlexAttention asks, broadcast to the
    chunk's ``(C, Tk)`` cells. If that raises or returns the wrong shape, the
    chunk and every later one are evaluated under ``torch.vmap`` through
    FlexAttention's ``create_mask``, slower but as FlexAttention itself does.

    A ``BlockMask`` (from ``torch.nn.attention.flex_attention``) gives its
    ``mask_mod`` and its ``seq_lengths`` as ``(Tq, Tk)``, and is converted to
    the mask FlexAttention applies with it: the mask_mod inside its partial
    blocks, every cell of its full blocks, nothing elsewhere (for a
    ``create_block_mask`` result, the mask_mod itself).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)`` returning bool, or a
            ``BlockMask``.
        Tq: query tokens (FlexAttention's ``Q_LEN``); taken from a
            ``BlockMask``, required otherwise.
        Tk: key tokens (``KV_LEN``); default ``Tq``.
        device: where the index tensors are made and the mask_mod runs, and
            where the result lives: the device of the tensors the mask_mod
            closes over. Default: the ``BlockMask``'s device, else the CPU.
        chunk_rows: rows per chunk (default: a fixed cell budget); changes
            the temporary memory only, never the result.

    Returns:
        ``(q_ranges, k_ranges, mask_types)`` int32 on ``device``: non-overlapping, non-empty
        slices ordered by query start, then key start.

    Raises:
        ValueError: missing or negative sizes, sizes that contradict a
            ``BlockMask``, a mask_mod that does not return bool, or one that
            fails both ways of evaluation.
    """
    gate = None
    if hasattr(mask_mod, "mask_mod") and hasattr(mask_mod, "seq_lengths") and hasattr(mask_mod, "kv_num_blocks"):
        bm_Tq, bm_Tk = (int(x) for x in mask_mod.seq_lengths)
        if (Tq is not None and int(Tq) != bm_Tq) or (Tk is not None and int(Tk) != bm_Tk):
            raise ValueError(
                f"Tq={Tq}, Tk={Tk} contradict the BlockMask's seq_lengths ({bm_Tq}, {bm_Tk}); "
                "leave them out to use the BlockMask's"
            )
        if device is None:
            device = mask_mod.kv_num_blocks.device
        mask_mod, Tq, Tk, gate = _block_mask_parts(mask_mod)
    elif not callable(mask_mod):
        raise ValueError(
            f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) -> bool tensor or a FlexAttention "
            f"BlockMask, got {type(mask_mod).__name__}"
        )
    if Tq is None:
        raise ValueError("Tq (FlexAttention's Q_LEN) is required with a mask_mod function")
    Tq = int(Tq)
    Tk = Tq if Tk is None else int(Tk)
    _check_sizes(Tq, Tk)
    device = torch.device("cpu") if device is None else torch.device(device)
    step = _chunk_rows(chunk_rows, Tk)
    evaluate = _Evaluator(mask_mod, Tk, device)
    runs = []
    for r0 in range(0, Tq, step):
        r1 = min(Tq, r0 + step)
        chunk = evaluate(r0, r1)
        if gate is not None:
            partial, full = gate(torch.arange(r0, r1, device=device), device)
            chunk = chunk & partial
            if full is not None:
                chunk = chunk | full
        rows, lo, hi = _row_runs(chunk)
        runs.append((rows + r0, lo, hi))
    if not runs:
        runs.append(_row_runs(torch.zeros(0, Tk, dtype=torch.bool, device=device)))
    return _finish(runs, Tq, Tk, device)
