"""Two small tables about fixed costs: host overhead per call, and the cost of planning a mask.

Host overhead (``flashrange bench --host``): on small problems the time a
call spends on the CPU (argument checks, planning launches, kernel
launches) can exceed the GPU work. Each way of calling flashrange's forward
is measured twice: GPU milliseconds with :func:`~flashrange.bench.timing.measure`
and CPU microseconds per call with
:func:`~flashrange.bench.timing.host_us_per_call`. SDPA's default backend
is the yardstick.

Plan cost (``flashrange bench --plan-cost``): :func:`flashrange.plan_mask`
alone, at growing slot counts over the same token count: seeded random
slices of every type, document-causal masks, and a few documents padded
with empty slices to a large capacity (what a compiled model with a fixed
capacity pays).
"""

from __future__ import annotations

import random
import sys

import torch

from ..mask import RangeMask
from .cases import by_name, doc_lengths
from .contenders import short_error
from .runner import make_inputs
from .timing import host_us_per_call, measure, synchronize

__all__ = ["HOST_CASES", "host_overhead", "plan_cost"]

HOST_CASES = ("causal-1k", "causal-4k", "full-8k")


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def _graph_replay(call, device):
    """A CUDA graph of ``call()`` (warmed on a side stream first) and its replay function."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph, graph.replay


def _time_variant(fn, device, warmup, reps):
    """``{"gpu": Timing dict, "host_us": float}`` for a warm ``fn``."""
    fn()
    synchronize(device)
    gpu = measure(fn, device=device, warmup=warmup, reps=reps).as_dict()
    host = host_us_per_call(fn, device=device, n=max(10, 2 * reps))
    return {"gpu": gpu, "host_us": host}


def host_overhead(device, dtype, *, tiny, warmup, reps, budget) -> list[dict]:
    """Rows ``{case, variant, gpu, host_us, note}`` for the forward of each host case, without grad."""
    import flashrange

    device = torch.device(device)
    cuda = device.type == "cuda"
    rows = []
    for name in HOST_CASES:
        case = by_name(name)
        case = case.tiny() if tiny else case
        if budget.spent():
            rows.append({"case": case.name, "variant": "*", "note": "skipped: time budget spent"})
            continue
        cm = case.build(device)
        qr, kr, mt = cm.mask.tensors()
        q, k, v, _ = make_inputs(case, device, dtype)
        T = case.T
        plan = flashrange.plan_mask(qr, kr, mt, T, T)
        raw_plan = list(torch.ops.flashrange.plan(qr, kr, mt, T, T))
        scale = case.D ** -0.5
        keep = []  # graphs and compiled functions must outlive their timing

        def compiled_call():
            fn = torch.compile(lambda q, k, v, a, b, c: flashrange.range_attention(q, k, v, a, b, c)[0],
                               fullgraph=True)
            return lambda: fn(q, k, v, qr, kr, mt)

        def reduce_overhead_call():
            # Inductor's CUDA graphs: a new step marked before each call, as a training loop does.
            fn = torch.compile(lambda q, k, v, a, b, c: flashrange.range_attention(q, k, v, a, b, c)[0],
                               mode="reduce-overhead", fullgraph=True)

            def call():
                torch.compiler.cudagraph_mark_step_begin()
                return fn(q, k, v, qr, kr, mt)

            return call

        def graph_call():
            graph, replay = _graph_replay(lambda: flashrange.range_attention(q, k, v, qr, kr, mt), device)
            keep.append(graph)
            return replay

        def sdpa_call():
            from torch.nn.functional import scaled_dot_product_attention

            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
            return lambda: scaled_dot_product_attention(qh, kh, vh, is_causal=bool(cm.sdpa_causal))

        variants = [
            ("eager public call", lambda: (lambda: flashrange.range_attention(q, k, v, qr, kr, mt)), None),
            ("public call, plan=", lambda: (lambda: flashrange.range_attention(q, k, v, qr, kr, mt, plan=plan)), None),
            ("raw op", lambda: (lambda: torch.ops.flashrange.fwd(q, k, v, qr, kr, mt, raw_plan, scale, 0.0)), None),
            ("torch.compile(fullgraph=True)", compiled_call,
             None if cuda else "GPU only here (the CPU run checks the harness)"),
            ("torch.compile(mode='reduce-overhead')", reduce_overhead_call, None if cuda else "needs CUDA"),
            ("CUDA graph replay", graph_call, None if cuda else "needs CUDA"),
            ("sdpa (yardstick)", sdpa_call, None),
        ]
        for label, build, why in variants:
            row = {"case": case.name, "variant": label, "gpu": None, "host_us": None, "note": why or ""}
            rows.append(row)
            if why:
                continue
            _say(f"host overhead: {case.name}: {label}")
            try:
                row.update(_time_variant(build(), device, warmup, reps))
            except Exception as e:  # noqa: BLE001 (one variant failing is a result)
                row["note"] = short_error(e)
        del keep
    return rows


def _random_slices(T, S, seed):
    """``S`` seeded slices of every type, each within ``[0, T)`` on both axes (overlaps allowed)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(S):
        lq = rng.randint(1, max(1, min(T, 4 * T // S)))
        lk = rng.randint(1, max(1, min(T, 4 * T // S)))
        qs = rng.randrange(0, T - lq + 1)
        ks = rng.randrange(0, T - lk + 1)
        rows.append((qs, qs + lq, ks, ks + lk, rng.randrange(4)))
    t = torch.tensor(rows, dtype=torch.int32)
    return RangeMask(t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous())


def _documents(T, n, seed):
    bounds = [0]
    for L in doc_lengths(T, n, seed):
        bounds.append(bounds[-1] + L)
    return RangeMask.varlen(bounds, causal=True)


def plan_cost(device, *, tiny, warmup, reps, budget) -> list[dict]:
    """Rows ``{mask, T, slices, nonempty, gpu, host_us, graph, note}`` for :func:`flashrange.plan_mask`."""
    import flashrange

    device = torch.device(device)
    cuda = device.type == "cuda"
    # Tiny: the same shapes of problem, a sixty-fourth of the slots, for the CPU harness check.
    T = 2048 if tiny else 131072
    shrink = 64 if tiny else 1
    specs = [(f"random slices, all types ({S // shrink})", lambda S=S: _random_slices(T, S // shrink, seed=S))
             for S in (64, 4096, 65536)]
    n_docs = 65536 // shrink
    specs.append((f"document-causal, {n_docs} documents", lambda: _documents(T, n_docs, seed=65536)))
    few = max(1, 64 // shrink)
    cap = 131072 // shrink
    specs.append((f"{few} documents padded to {cap} slots", lambda: _documents(T, few, seed=64).pad_to(cap)))
    rows = []
    for label, make in specs:
        row = {"mask": label, "T": T, "slices": None, "nonempty": None, "gpu": None, "host_us": None,
               "graph": None, "note": ""}
        rows.append(row)
        if budget.skips(row):
            continue
        _say(f"plan cost: {label}")
        try:
            mask = make().to(device)
            qr, kr, mt = mask.tensors()
            row["slices"] = mask.num_slices
            row["nonempty"] = int(((qr[:, 1] > qr[:, 0]) & (kr[:, 1] > kr[:, 0])).sum())

            def call():
                return flashrange.plan_mask(qr, kr, mt, T, T)

            row.update(_time_variant(call, device, warmup, reps))
            if cuda:
                graph, replay = _graph_replay(call, device)
                row["graph"] = measure(replay, device=device, warmup=warmup, reps=reps).as_dict()
                del graph
        except Exception as e:  # noqa: BLE001
            row["note"] = short_error(e)
    return rows
