"""GPU time of ``flashrange.plan_mask`` for a few masks, eager and inside a CUDA graph.

    python scripts/plan_cost.py               (CUDA required; well under a minute)
    python scripts/plan_cost.py --profile     (also the per-kernel table of each case)
    python scripts/plan_cost.py --against prev  (also the graph time of ab/prev's plan builder, for A/B;
                                                 "equal" then also checks its plan)

Per case: the Triton plan is compared with ``build_plan_torch`` (bitwise),
then timed with CUDA events: the median over many eager calls (the host's
launch gaps included, as a caller sees them), the median over many replays
of a CUDA graph that captured the call (GPU work alone), and the host time per
eager call. Masks at 131072 tokens unless named.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# Run from anywhere without an installed flashrange: the repository's own copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _docs(T, n, seed):
    """``n`` causal documents tiling ``[0, T)`` in token order (seeded lengths, each at least 1)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n - 1))
    b = [0] + cuts + [T]
    r = torch.tensor([[b[i], b[i + 1]] for i in range(n)], dtype=torch.int32)
    return r, r.clone(), torch.ones(n, dtype=torch.int32)


def _causal(T):
    r = torch.tensor([[0, T]], dtype=torch.int32)
    return r, r.clone(), torch.ones(1, dtype=torch.int32)


def _two_token_docs(T):
    r = torch.arange(0, T, 2, dtype=torch.int32).repeat_interleave(2).view(-1, 2) + torch.tensor([0, 2])
    r = r.to(torch.int32)
    return r, r.clone(), torch.ones(r.shape[0], dtype=torch.int32)


def _padded(T, n_valid, slots, scatter, seed):
    """``n_valid`` documents in ``slots`` slots; the others ``[0, 0)`` FULL, after them or scattered among them."""
    qr, kr, mt = _docs(T, n_valid, seed)
    pq = torch.zeros(slots, 2, dtype=torch.int32)
    pk = torch.zeros(slots, 2, dtype=torch.int32)
    pm = torch.zeros(slots, dtype=torch.int32)
    where = sorted(random.Random(seed).sample(range(slots), n_valid)) if scatter else list(range(n_valid))
    pq[where], pk[where], pm[where] = qr, kr, mt
    return pq, pk, pm


def _shuffled(qr, kr, mt, seed):
    perm = torch.randperm(mt.shape[0], generator=torch.Generator().manual_seed(seed))
    return qr[perm].contiguous(), kr[perm].contiguous(), mt[perm].contiguous()


def _random_slices(T, S, seed):
    """Seeded random slices of every type, as the bench's plan-cost table."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, T, (S, 2), generator=g).sort(1).values.to(torch.int32)
    b = torch.randint(0, T, (S, 2), generator=g).sort(1).values.to(torch.int32)
    return a, b, torch.randint(0, 4, (S,), generator=g, dtype=torch.int32)


def cases():
    T = 131072
    short = 32768
    # Documents in 32768 tokens around the one-program plan's slot limit (128): with one empty slot
    # after them the same documents take the general plan's launches.
    around_limit = [(f"{n} docs in 32k{extra}", short, _padded(short, n, n + pad, False, n))
                    for n in (16, 64, 128) for pad, extra in ((0, ""), (129 - n, f", {129 - n} empty after"))]
    return around_limit + [
        ("causal 1k, 1 slice", 1024, _causal(1024)),
        ("causal 8k, 1 slice", 8192, _causal(8192)),
        ("causal 32k, 1 slice", short, _causal(short)),
        ("16 docs in 8k", 8192, _docs(8192, 16, 8)),
        ("64 random slices", T, _random_slices(T, 64, 1)),
        ("4096 docs", T, _docs(T, 4096, 2)),
        ("4096 random slices", T, _random_slices(T, 4096, 3)),
        ("65536 docs (2 tokens each)", T, _two_token_docs(T)),
        ("65536 docs, shuffled", T, _shuffled(*_two_token_docs(T), seed=4)),
        ("65536 random slices", T, _random_slices(T, 65536, 5)),
        ("131072 slots, 64 docs first", T, _padded(T, 64, 131072, False, 6)),
        ("131072 slots, 64 docs scattered", T, _padded(T, 64, 131072, True, 7)),
    ]


def _graph_of(fn):
    """A CUDA graph that replays ``fn`` (warmed on a side stream first, as capture needs), and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def _events_median(fn, reps):
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="print each case's per-kernel CUDA time")
    parser.add_argument("--against", metavar="NAME", help="also replay the plan builder of the copy in ab/NAME "
                        "(scripts/ab_export.sh) in a CUDA graph, beside this checkout's")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("plan_cost.py needs CUDA")
    import flashrange
    from flashrange.plan import build_plan_torch

    other = None
    if args.against:
        import importlib

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ab" / args.against))
        other = importlib.import_module(f"flashrange_{args.against}.kernels.plan").build_plan
    dev = torch.device("cuda")
    rows = []
    for name, T, (qr, kr, mt) in cases():
        qr, kr, mt = qr.to(dev), kr.to(dev), mt.to(dev)

        def call():
            return flashrange.plan_mask(qr, kr, mt, T, T)

        plan = call()
        want = build_plan_torch(qr, kr, mt, T, T)
        same = all(torch.equal(x, y) for x, y in zip(plan, want))
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        eager = _events_median(call, args.reps)
        t0 = time.perf_counter()
        for _ in range(args.reps):
            call()
        host = (time.perf_counter() - t0) / args.reps * 1e6
        torch.cuda.synchronize()
        graph, captured = _graph_of(call)
        same = same and all(torch.equal(x, y) for x, y in zip(captured, want))
        replay = _events_median(graph.replay, args.reps)
        replay_other = float("nan")
        if other is not None:
            graph_other, captured_other = _graph_of(lambda: other(qr, kr, mt, T, T))
            same = same and all(torch.equal(x, y) for x, y in zip(captured_other, want))
            replay_other = _events_median(graph_other.replay, args.reps)
            del graph_other
        n_valid = int(((qr[:, 1] > qr[:, 0]) & (kr[:, 1] > kr[:, 0])).sum())
        rows.append((name, T, mt.shape[0], n_valid, eager, replay, replay_other, host, same))
        print(f"done: {name}", file=sys.stderr, flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graph.replay()
                torch.cuda.synchronize()
            print(f"--- {name} (5 graph replays)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        del graph, captured
    print()
    against = f"{args.against} graph us" if args.against else ""
    print(f"{'mask':34s} {'T':>7s} {'slots':>7s} {'valid':>7s} {'eager GPU us':>13s} {'graph us':>9s} "
          f"{against:>{len(against)}s} {'host us':>8s}  equal")
    for name, T, S, n_valid, eager, replay, replay_other, host, same in rows:
        other_col = f"{replay_other:{len(against)}.1f}" if args.against else ""
        print(f"{name:34s} {T:7d} {S:7d} {n_valid:7d} {eager:13.1f} {replay:9.1f} {other_col} {host:8.1f}  "
              f"{'yes' if same else 'NO'}")
    if not all(r[-1] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
