"""The device-side plan: windows, canonical order, work estimate, and the Triton plan equal to the torch plan."""

import random

import pytest
import torch

from flashrange.kernels.plan import build_block_plan as build_plan
from flashrange.plan import build_block_plan_torch
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
    """The work estimate is the exact covered-cell count per block for these types."""
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
    expected = torch.sort(-work, stable=True).indices.to(torch.int32)
    assert torch.equal(plan.block_order, expected)


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


def test_triton_plan_sort_path_equals_counting_path(monkeypatch):
    """Past RANK_BY_COUNTING_MAX slices the Triton plan ranks by sorting; the plan must not change."""
    import flashrange.kernels.plan as triton_plan

    rng = random.Random(23)
    cases = [_random_slices(rng, rng.randint(1, 200), rng.randint(1, 200), rng.randint(1, 40), garbage=g)
             for g in (False, True, False)]
    for qr, kr, mt in cases:
        Tq = int(qr.clamp(min=0).max()) + 3
        Tk = int(kr.clamp(min=0).max()) + 5
        for transpose in (False, True):
            counting = build_plan(qr, kr, mt, Tq, Tk, 16, transpose=transpose, backend="triton")
            monkeypatch.setattr(triton_plan, "RANK_BY_COUNTING_MAX", 0)
            sorting = build_plan(qr, kr, mt, Tq, Tk, 16, transpose=transpose, backend="triton")
            monkeypatch.undo()
            for name, x, y in zip(counting._fields, counting, sorting):
                assert torch.equal(x, y), (transpose, name)
