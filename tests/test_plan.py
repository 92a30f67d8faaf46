"""The device-side plan: windows, canonical order, work estimate, and the Triton plan equal to the torch plan."""

import random

import pytest
import torch

import flashrange.kernels.plan as triton_plan
from flashrange.constants import CAUSAL, PLAN_BLOCK
from flashrange.kernels.plan import SMALL_PLAN_BLOCKS, SMALL_PLAN_SLICES
from flashrange.kernels.plan import build_block_plan as build_plan
from flashrange.plan import RangePlan, build_block_plan_torch
from golden import dense_counts

BACKENDS = [pytest.param("torch", id="torch"), pytest.param("triton", id="triton-interpreter")]


def _random_slices(rng, Tq, Tk, S, *, garbage):
    lo_q, hi_q = (-7, Tq + 7) if garbage else (0, Tq)
    lo_k, hi_k = (-7, Tk + 7) if garbage else (0, Tk)
    qr = [[rng.randint(lo_q, hi_q), rng.randint(lo_q, hi_q)] for _ in range(S)]
    kr = [[rng.randint(lo_k, hi_k), rng.randint(lo_k, hi_k)] for _ in range(S)]
    if not garbage:
        qr = [sorted(r) for r in qr]
        kr = [sorted(r) for r in kr]
    mt = [rng.randint(-1, 4) if garbage else rng.randint(0, 3) for _ in range(S)]
    return (
        torch.tensor(qr, dtype=torch.int32).reshape(S, 2),
        torch.tensor(kr, dtype=torch.int32).reshape(S, 2),
        torch.tensor(mt, dtype=torch.int32).reshape(S),
    )


CASES = [
    pytest.param(37, 41, 9, False, id="small"),
    pytest.param(130, 63, 23, True, id="garbage"),
    pytest.param(1, 17, 4, False, id="one-row"),
    pytest.param(200, 200, 0, False, id="no-slices"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose", [False, True], ids=["q-major", "k-major"])
@pytest.mark.parametrize("Tq,Tk,S,garbage", CASES)
def test_windows_cover_every_meeting_slice(Tq, Tk, S, garbage, transpose, backend):
    rng = random.Random(Tq * 1000 + S)
    qr, kr, mt = _random_slices(rng, Tq, Tk, S, garbage=garbage)
    block = 16
    plan = build_plan(qr, kr, mt, Tq, Tk, block, transpose=transpose, backend=backend)
    T = Tk if transpose else Tq
    n_blocks = max(1, -(-T // block))
    assert plan.block_lo.shape == plan.block_hi.shape == plan.block_order.shape == (n_blocks,)
    assert sorted(plan.block_order.tolist()) == list(range(n_blocks))
    cnt = dense_counts(qr, kr, mt, Tq, Tk)
    slices = plan.slices.tolist()
    for b in range(n_blocks):
        b0, b1 = b * block, min(T, (b + 1) * block)
        window = set(range(plan.block_lo[b].item(), plan.block_hi[b].item()))
        for idx, (qs, qe, ks, ke, t) in enumerate(slices):
            if t < 0:
                assert idx not in window
                continue
            single = dense_counts(
                torch.tensor([[qs, qe]], dtype=torch.int32), torch.tensor([[ks, ke]], dtype=torch.int32),
                torch.tensor([t], dtype=torch.int32), Tq, Tk,
            )
            part = single[:, b0:b1] if transpose else single[b0:b1]
            if bool(part.any()):
                assert idx in window, (b, idx)
    # Every covered cell belongs to some valid slice of the plan.
    total = sum(
        dense_counts(torch.tensor([[s[0], s[1]]], dtype=torch.int32), torch.tensor([[s[2], s[3]]], dtype=torch.int32),
                        torch.tensor([s[4]], dtype=torch.int32), Tq, Tk).sum().item()
        for s in slices if s[4] >= 0
    )
    assert total == cnt.sum().item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose", [False, True], ids=["q-major", "k-major"])
def test_canonical_order_ignores_permutation_and_padding(transpose, backend):
    rng = random.Random(5)
    qr, kr, mt = _random_slices(rng, 90, 70, 15, garbage=False)
    ref = build_plan(qr, kr, mt, 90, 70, 32, transpose=transpose, backend=backend)
    perm = torch.randperm(15, generator=torch.Generator().manual_seed(3))
    pad_q = torch.zeros(6, 2, dtype=torch.int32)
    qr2 = torch.cat([pad_q[:3], qr[perm], pad_q[3:]])
    kr2 = torch.cat([pad_q[:3], kr[perm], pad_q[3:]])
    mt2 = torch.cat([torch.zeros(3, dtype=torch.int32), mt[perm], torch.ones(3, dtype=torch.int32)])
    got = build_plan(qr2, kr2, mt2, 90, 70, 32, transpose=transpose, backend=backend)
    n_valid = int((ref.slices[:, 4] >= 0).sum())
    assert torch.equal(got.slices[:n_valid], ref.slices[:n_valid])
    assert bool((got.slices[n_valid:, 4] == -1).all())
    for name in ("block_lo", "block_hi", "block_order"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


@pytest.mark.parametrize("transpose", [False, True], ids=["q-major", "k-major"])
@pytest.mark.parametrize("mtype", [0, 1, 2], ids=["full", "causal", "inv-causal"])
def test_heaviest_blocks_first(mtype, transpose):
    """The work estimate is the exact covered-cell count per block for these types; blocks of one window
    start stay together, groups by their heaviest block."""
    qr = torch.tensor([[3, 70], [70, 101], [0, 5]], dtype=torch.int32)
    kr = torch.tensor([[0, 90], [10, 40], [50, 120]], dtype=torch.int32)
    mt = torch.full((3,), mtype, dtype=torch.int32)
    block = 16
    plan = build_block_plan_torch(qr, kr, mt, 101, 120, block, transpose=transpose)
    cnt = dense_counts(qr, kr, mt, 101, 120)
    per_pos = cnt.sum(0) if transpose else cnt.sum(1)
    n = plan.block_order.shape[0]
    work = torch.zeros(n * block, dtype=torch.int64)
    work[: per_pos.shape[0]] = per_pos
    work = work.view(n, block).sum(1)
    lo = plan.block_lo.tolist()
    group_work = {g: max(int(w) for w, l in zip(work, lo) if l == g) for g in lo}
    expected = sorted(range(n), key=lambda b: (-group_work[lo[b]], lo[b], -int(work[b]), b))
    assert plan.block_order.tolist() == expected


def _packed(lengths, mtype):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ranges = torch.tensor([[s, s + n] for s, n in zip(starts, lengths)], dtype=torch.int32)
    return ranges, ranges.clone(), torch.full((len(lengths),), mtype, dtype=torch.int32), sum(lengths)


# Causal documents of 4, 2 and 4 blocks (16 tokens each), in that order:
#   doc 0: blocks 0-3 | doc 1: blocks 4-5 | doc 2: blocks 6-9
# Each document's last block is its heaviest; documents 0 and 2 tie (the earlier first), document 1 last.
_DOCS_ORDER = [3, 2, 1, 0, 9, 8, 7, 6, 5, 4]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose", [False, True], ids=["q-major", "k-major"])
def test_documents_run_together(transpose, backend):
    qr, kr, mt, T = _packed([64, 32, 64], CAUSAL)
    plan = build_plan(qr, kr, mt, T, T, 16, transpose=transpose, backend=backend)
    # Key-major, a causal document's first key block is read by every query: heaviest first.
    expected = _DOCS_ORDER if not transpose else [0, 1, 2, 3, 6, 7, 8, 9, 4, 5]
    assert plan.block_order.tolist() == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_documents_order_past_one_scan_tile(backend):
    """More blocks than the block scan's tile (1024): the group maximum carries across tiles."""
    lengths = [16 * 300, 16 * 500, 16 * 700]
    qr, kr, mt, T = _packed(lengths, CAUSAL)
    plan = build_plan(qr, kr, mt, T, T, 16, backend=backend)
    firsts = [0, 300, 800]
    expected = [b for d in (2, 1, 0) for b in range(firsts[d] + lengths[d] // 16 - 1, firsts[d] - 1, -1)]
    assert plan.block_order.tolist() == expected


def test_triton_plan_equals_torch_plan_fuzz():
    rng = random.Random(11)
    for it in range(30):
        Tq, Tk = rng.randint(1, 260), rng.randint(1, 260)
        S = rng.randint(0, 40)
        qr, kr, mt = _random_slices(rng, Tq, Tk, S, garbage=bool(it % 2))
        if it % 3 == 0 and S >= 2:  # duplicated slices: ties in the canonical key
            qr[: S // 2], kr[: S // 2], mt[: S // 2] = qr[S - S // 2 :][: S // 2], kr[S - S // 2 :][: S // 2], mt[S - S // 2 :][: S // 2]
        for transpose in (False, True):
            for block in (16, 64):
                a = build_plan(qr, kr, mt, Tq, Tk, block, transpose=transpose, backend="torch")
                b = build_plan(qr, kr, mt, Tq, Tk, block, transpose=transpose, backend="triton")
                for name, x, y in zip(a._fields, a, b):
                    assert torch.equal(x, y), (it, transpose, block, name)


def test_unknown_backend_is_rejected():
    z = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend must be"):
        build_plan(z, z, torch.zeros(1, dtype=torch.int32), 4, 4, 16, backend="cuda")


def _assert_plans_equal(qr, kr, mt, Tq, Tk, block=PLAN_BLOCK, what=""):
    """The Triton plan (both halves) equals the torch plan, bit for bit; returns the Triton plan."""
    want = [*build_block_plan_torch(qr, kr, mt, Tq, Tk, block),
            *build_block_plan_torch(qr, kr, mt, Tq, Tk, block, transpose=True)]
    got = triton_plan.build_plan_triton(qr, kr, mt, Tq, Tk, block)
    for name, x, y in zip(RangePlan._fields, want, got):
        assert torch.equal(x, y), (what, name)
    return got


def _documents(T, n, seed):
    """``n`` causal documents tiling ``[0, T)`` in token order: slices in canonical order."""
    rng = random.Random(seed)
    bounds = [0] + sorted(rng.sample(range(1, T), n - 1)) + [T]
    r = torch.tensor([bounds[:-1], bounds[1:]], dtype=torch.int32).T.contiguous()
    return r, r.clone(), torch.full((n,), CAUSAL, dtype=torch.int32)


def _launches(monkeypatch):
    """Record the names of the kernels the Triton plan launches (the launches still run)."""
    names = []
    real = triton_plan.launch

    def record(kernel, grid, args, **kw):
        names.append(kernel.fn.__name__)
        real(kernel, grid, args, **kw)

    monkeypatch.setattr(triton_plan, "launch", record)
    return names


@pytest.mark.parametrize("chunk,fan_in", [(128, 64), (8, 2), (4, 4)], ids=["default", "chunk8-fan2", "chunk4-fan4"])
def test_general_path_equals_torch_plan_fuzz(monkeypatch, chunk, fan_in):
    """The many-slot path forced on small inputs; small chunks and fan-ins give many merge levels,
    runs cut anywhere, chunks with one class only, and runs sorted or not."""
    monkeypatch.setattr(triton_plan, "SMALL_PLAN_SLICES", -1)
    monkeypatch.setattr(triton_plan, "_BLOCK_C", chunk)
    monkeypatch.setattr(triton_plan, "_BLOCK_F", fan_in)
    rng = random.Random(chunk * 100 + fan_in)
    for it in range(8):
        Tq, Tk = rng.randint(1, 300), rng.randint(1, 300)
        S = rng.choice([0, 1, 3, rng.randint(0, 120)])
        qr, kr, mt = _random_slices(rng, Tq, Tk, S, garbage=bool(it % 2))
        if it % 3 == 0 and S >= 2:  # duplicated slices: ties in the key, across runs
            h = S // 2
            qr[:h], kr[:h], mt[:h] = qr[S - h:].clone(), kr[S - h:].clone(), mt[S - h:].clone()
        if it % 4 == 2 and S >= 2:  # already in canonical order: the sorted shortcut
            s = build_block_plan_torch(qr, kr, mt, Tq, Tk).slices
            qr, kr, mt = s[:, 0:2].contiguous(), s[:, 2:4].contiguous(), s[:, 4].contiguous()
        _assert_plans_equal(qr, kr, mt, Tq, Tk, (16, 64)[it % 2], what=it)


def test_general_path_invalid_slots_keep_slot_order_on_key_ties(monkeypatch):
    """Never-visited slots sort by (major end, minor end, type) and then by slot, not by their other
    bounds: slots equal in that key but not in their rows must stay in slot order through every merge."""
    monkeypatch.setattr(triton_plan, "SMALL_PLAN_SLICES", -1)
    monkeypatch.setattr(triton_plan, "_BLOCK_C", 4)
    monkeypatch.setattr(triton_plan, "_BLOCK_F", 2)
    rng = random.Random(17)
    rows = []
    for i in range(90):
        if i % 7 == 3:
            a = rng.randrange(0, 50)
            rows.append([a, a + 5, a, a + 5, CAUSAL])
        else:  # empty: qs >= qe, same (qe, ke, type) for many, different qs and ks
            rows.append([rng.randrange(30, 40), 30, rng.randrange(0, 60), rng.choice([20, 25]), rng.choice([0, 9])])
    t = torch.tensor(rows, dtype=torch.int32)
    _assert_plans_equal(t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous(), 60, 64, 16)


def test_many_documents_in_order_and_shuffled():
    """More than 8192 valid slices at a real size (no patched threshold): documents in canonical
    order (the sorted shortcut), then shuffled among garbage slots (merging); same valid slices."""
    T, n = 16900, 8450
    qr, kr, mt = _documents(T, n, seed=1)
    ordered = _assert_plans_equal(qr, kr, mt, T, T, what="in order")
    g = torch.Generator().manual_seed(2)
    junk = 300
    jq = torch.randint(-9, T + 9, (junk, 2), generator=g, dtype=torch.int32)
    jk = torch.randint(-9, T + 9, (junk, 2), generator=g, dtype=torch.int32)
    jt = torch.randint(-2, 6, (junk,), generator=g, dtype=torch.int32)
    jt[jq[:, 1] > jq[:, 0]] = 7  # unknown type wherever the query range is not empty: all invalid
    perm = torch.randperm(n + junk, generator=g)
    qr2, kr2, mt2 = (torch.cat([a, b])[perm].contiguous() for a, b in ((qr, jq), (kr, jk), (mt, jt)))
    shuffled = _assert_plans_equal(qr2, kr2, mt2, T, T, what="shuffled")
    assert torch.equal(shuffled.q_slices[:n], ordered.q_slices)
    assert torch.equal(shuffled.k_slices[:n], ordered.k_slices)
    assert bool((shuffled.q_slices[n:, 4] == -1).all())
    for name in ("q_block_lo", "q_block_hi", "q_block_order", "k_block_lo", "k_block_hi", "k_block_order"):
        assert torch.equal(getattr(shuffled, name), getattr(ordered, name)), name


@pytest.mark.parametrize("layout", ["first", "scattered", "varied-padding"])
def test_many_empty_slots_few_valid(layout):
    """16384 slots of which 64 are documents: padding after them, scattered among them, or
    padding that differs from slot to slot (empty ranges at every position, some unknown types)."""
    T = S = 16384
    qr, kr, mt = _documents(T, 64, seed=3)
    pq = torch.zeros(S, 2, dtype=torch.int32)
    pk = torch.zeros(S, 2, dtype=torch.int32)
    pm = torch.zeros(S, dtype=torch.int32)
    if layout == "varied-padding":
        t = torch.arange(S, dtype=torch.int32)
        pq[:, 0], pq[:, 1], pk[:, 0], pk[:, 1] = t, t, (t * 7) % T, (t * 7) % T
        pm[:] = (t % 5).to(torch.int32)
    where = list(range(64)) if layout == "first" else sorted(random.Random(4).sample(range(S), 64))
    pq[where], pk[where], pm[where] = qr, kr, mt
    plan = _assert_plans_equal(pq, pk, pm, T, T, what=layout)
    assert int((plan.q_slices[:, 4] >= 0).sum()) == 64


@pytest.mark.parametrize("S,T", [(SMALL_PLAN_SLICES, SMALL_PLAN_BLOCKS * PLAN_BLOCK),
                                 (SMALL_PLAN_SLICES + 1, 3000),
                                 (40, SMALL_PLAN_BLOCKS * PLAN_BLOCK + 1)],
                         ids=["small-at-limits", "one-slot-over", "one-block-over"])
def test_single_launch_limits(monkeypatch, S, T):
    """One launch up to the small-plan limits; past the block limit the two block launches follow, past
    the slot limit the many-slot path runs; equal plans."""
    names = _launches(monkeypatch)
    rng = random.Random(S + T)
    qr, kr, mt = _random_slices(rng, T, T, S, garbage=True)
    _assert_plans_equal(qr, kr, mt, T, T, what=(S, T))
    blocks = ["_scan_blocks_kernel", "_order_blocks_kernel"]
    if S > SMALL_PLAN_SLICES:
        assert names == ["_count_kernel", "_partition_kernel", "_merge_kernel", *blocks]
    elif T > SMALL_PLAN_BLOCKS * PLAN_BLOCK:
        assert names == ["_plan_small_kernel", *blocks]
    else:
        assert names == ["_plan_small_kernel"]


def test_few_slices_many_blocks_fuzz(monkeypatch):
    """Slots ranked by one program, then the block launches (many blocks), forced on small inputs."""
    monkeypatch.setattr(triton_plan, "SMALL_PLAN_BLOCKS", 0)
    rng = random.Random(29)
    for it in range(10):
        Tq, Tk = rng.randint(1, 400), rng.randint(1, 400)
        qr, kr, mt = _random_slices(rng, Tq, Tk, rng.choice([0, 1, rng.randint(0, 60)]), garbage=bool(it % 2))
        _assert_plans_equal(qr, kr, mt, Tq, Tk, (16, 32)[it % 2], what=it)


def test_launch_count_grows_with_merge_levels_only(monkeypatch):
    """Past one merge level's reach (64 runs of two per 128-slot chunk) one more merge launch."""
    names = _launches(monkeypatch)
    S = 4097
    qr, kr, mt = _documents(8200, S, seed=5)
    triton_plan.build_plan_triton(qr, kr, mt, 8200, 8200)
    assert names == ["_count_kernel", "_partition_kernel", "_merge_kernel", "_merge_kernel", "_scan_blocks_kernel",
                     "_order_blocks_kernel"]
