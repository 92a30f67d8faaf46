"""Forward timing on a GPU: flashrange vs cuDNN SDPA vs FlexAttention, plus plan cost and a config sweep.

    PYTHONPATH=. python scripts/fwd_timing.py [--sweep] [--json out.json] [--only NAME,...]

TFLOP/s count the mask's real area: ``4 * area * D * Hq / time`` (forward).
FlexAttention is compiled, its block mask built once outside the timed
region ("kernel-only"); ``create_block_mask`` is timed on its own.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch
import triton
from triton.testing import do_bench

from flashrange.kernels import forward as fwd
from flashrange.plan import build_plan

CAUSAL, BI_CAUSAL, FULL = 1, 3, 0


def doc_bounds(T, n_docs, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n_docs - 1))
    return [0] + cuts + [T]


def make_case(kind, T, n_docs=0, window=0):
    """``(q_ranges, k_ranges, types, area, flex mask_mod, sdpa is_causal or None)``."""
    if kind in ("full", "causal"):
        r = torch.tensor([[0, T]], dtype=torch.int32)
        t = torch.tensor([FULL if kind == "full" else CAUSAL], dtype=torch.int32)
        area = T * T if kind == "full" else T * (T + 1) // 2
        if kind == "full":
            def mod(b, h, qi, kj):
                return qi >= 0
        else:
            def mod(b, h, qi, kj):
                return qi >= kj
        return r, r.clone(), t, area, mod, kind == "causal"
    if kind == "doc":
        bounds = doc_bounds(T, n_docs, seed=n_docs)
        r = torch.tensor([[a, b] for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.int32)
        t = torch.full((n_docs,), CAUSAL, dtype=torch.int32)
        area = sum((b - a) * (b - a + 1) // 2 for a, b in zip(bounds[:-1], bounds[1:]))
        doc_id = torch.zeros(T, dtype=torch.int32, device="cuda")
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            doc_id[a:b] = i

        def mod(b, h, qi, kj):
            return (doc_id[qi] == doc_id[kj]) & (qi >= kj)
        return r, r.clone(), t, area, mod, None
    if kind == "window":
        W = window
        qr = torch.tensor([[0, W], [W, T]], dtype=torch.int32)
        kr = torch.tensor([[0, W], [0, T]], dtype=torch.int32)
        t = torch.tensor([CAUSAL, BI_CAUSAL], dtype=torch.int32)
        area = W * (W + 1) // 2 + (T - W) * (W + 1)

        def mod(b, h, qi, kj):
            return (qi >= kj) & (qi - kj <= W)
        return qr, kr, t, area, mod, None
    raise ValueError(kind)


CASES = [
    # name, kind, T, Hq, D, extra
    ("full-8k-d128", "full", 8192, 16, 128, {}),
    ("causal-8k-d128", "causal", 8192, 16, 128, {}),
    ("causal-32k-d128", "causal", 32768, 16, 128, {}),
    ("doc16-32k-d128", "doc", 32768, 16, 128, {"n_docs": 16}),
    ("doc128-32k-d128", "doc", 32768, 16, 128, {"n_docs": 128}),
    ("window2048-32k-d128", "window", 32768, 16, 128, {"window": 2048}),
    ("full-8k-d64", "full", 8192, 16, 64, {}),
    ("causal-8k-d64", "causal", 8192, 16, 64, {}),
    ("full-4k-d256", "full", 4096, 16, 256, {}),
]
SWEEP = {"full-8k-d128", "causal-32k-d128", "doc16-32k-d128", "doc128-32k-d128", "window2048-32k-d128",
         "full-8k-d64", "causal-8k-d64", "full-4k-d256"}


# Cases with no bar against FlexAttention: skip its (slow) compile there.
NO_FLEX = {"causal-8k-d64", "full-4k-d256"}


def bench(fn, reps=None):
    return do_bench(fn, warmup=25, rep=reps or 100)


def time_case(name, kind, T, H, D, extra, *, flex=True, sdpa=True, config=None):
    dtype = torch.bfloat16
    qr, kr, mt, area, mod, is_causal = make_case(kind, T, **extra)
    qr, kr, mt = qr.cuda(), kr.cuda(), mt.cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
    scale = D ** -0.5
    flops = 4 * area * D * H
    row = {"case": name, "T": T, "H": H, "D": D, "area": area}

    def ours():
        return fwd.range_attention_forward_triton(q, k, v, qr, kr, mt, scale, 0.0, config=config)

    out, lse = ours()
    ms = bench(ours)
    row["flashrange_ms"] = ms
    row["flashrange_tflops"] = flops / ms * 1e-9
    cfg = config or fwd.default_config(D, D, dtype)
    row["config"] = cfg if isinstance(cfg, str) else cfg.name
    row["nan"] = bool(torch.isnan(out).any())

    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    if sdpa and is_causal is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F

        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale)
                ms_c = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale))
            row["cudnn_ms"] = ms_c
            row["cudnn_tflops"] = flops / ms_c * 1e-9
            row["max_diff_vs_cudnn"] = (ref[0].transpose(0, 1).float() - out.float()).abs().max().item()
        except Exception as e:  # noqa: BLE001
            row["cudnn_error"] = repr(e)[:200]
    if flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex_c = _flex_compiled()
            bm = create_block_mask(mod, None, None, T, T, device="cuda")
            fo = flex_c(qh, kh, vh, block_mask=bm, scale=scale)
            ms_f = bench(lambda: flex_c(qh, kh, vh, block_mask=bm, scale=scale))
            ms_bm = bench(lambda: create_block_mask(mod, None, None, T, T, device="cuda"), reps=30)
            row["flex_ms"] = ms_f
            row["flex_tflops"] = flops / ms_f * 1e-9
            row["flex_block_mask_ms"] = ms_bm
            row["max_diff_vs_flex"] = (fo[0].transpose(0, 1).float() - out.float()).abs().max().item()
        except Exception as e:  # noqa: BLE001
            row["flex_error"] = repr(e)[:300]
    return row


_FLEX = None


def _flex_compiled():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def plan_cost(S=4096, T=131072, block=128):
    bounds = doc_bounds(T, S, seed=0)
    r = torch.tensor([[a, b] for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.int32, device="cuda")
    t = torch.full((S,), CAUSAL, dtype=torch.int32, device="cuda")
    fn = lambda: build_plan(r, r, t, T, T, block)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    ms = bench(fn)
    # Host launch cost per call, and the GPU-only cost as one replayed graph.
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host_ms = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms_graph = bench(graph.replay)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda_ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    n_kernels = len(cuda_ev)
    per_kernel = {e.name[:40]: round(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total, 1)
                  for e in cuda_ev}
    print("plan kernels (us):", per_kernel, flush=True)
    return {"plan_S": S, "plan_T": T, "plan_ms": ms, "plan_host_ms": host_ms, "plan_graph_ms": ms_graph,
            "plan_kernels": n_kernels}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time every config on a few cases")
    ap.add_argument("--no-main", action="store_true", help="skip the default-config table with peers")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--json", default="")
    ap.add_argument("--no-flex", action="store_true")
    args = ap.parse_args(argv)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    only = set(filter(None, args.only.split(",")))
    print(json.dumps(plan_cost()), flush=True)
    for name, kind, T, H, D, extra in CASES:
        if (only and name not in only) or args.no_main:
            continue
        row = time_case(name, kind, T, H, D, extra, flex=not args.no_flex and name not in NO_FLEX,
                        sdpa=not args.no_sdpa)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.sweep:
        for name, kind, T, H, D, extra in CASES:
            if name not in SWEEP or (only and name not in only):
                continue
            for cfg in fwd.configs_for(D, D, torch.bfloat16):
                try:
                    row = time_case(name, kind, T, H, D, extra, flex=False, sdpa=False, config=cfg.name)
                except Exception as e:  # noqa: BLE001
                    row = {"case": name, "config": cfg.name, "error": repr(e)[:300]}
                rows.append({"sweep": True, **row})
                print(json.dumps({"sweep": True, **row}), flush=True)
    print()
    hdr = f"{'case':22s} {'config':22s} {'ours ms':>8s} {'TF/s':>6s} {'cudnn':>6s} {'flex':>6s} {'x flex':>6s} {'bm ms':>6s}"
    print(hdr)
    for r in rows:
        if "error" in r:
            print(f"{r['case']:22s} {r['config']:22s} ERROR {r['error'][:80]}")
            continue
        cu = r.get("cudnn_tflops")
        fl = r.get("flex_tflops")
        if cu is None:
            cu = "-"
        if fl is None:
            fl = "-"
        print(f"{r['case']:22s} {r['config']:22s} {r['flashrange_ms']:8.3f} {r['flashrange_tflops']:6.0f} "
              f"{cu if cu == '-' else round(cu):>6} {fl if fl == '-' else round(fl):>6} "
              f"{'' if fl == '-' else round(r['flashrange_tflops'] / fl, 2):>6} "
              f"{'' if 'flex_block_mask_ms' not in r else round(r['flex_block_mask_ms'], 2):>6}"
              f"{'  NaN!' if r.get('nan') else ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
