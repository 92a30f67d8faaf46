"""Backward timing on a GPU: flashrange vs cuDNN SDPA vs compiled FlexAttention.

    PYTHONPATH=. python scripts/bwd_timing.py [--only NAME,...] [--sweep] [--no-flex] [--json out.json]

For each case: backward alone and forward + backward, in ms and TFLOP/s
counted on the mask's real area (forward ``4 * area * D * Hq``; backward 2.5x
that; forward + backward 3.5x), and the peak memory a forward + backward
allocates beyond its inputs. flashrange's backward is also split into its two
kernels (dK/dV, dQ). Peers' backward is
their forward + backward minus their forward. FlexAttention's block mask is
built once, outside the timed region. ``--sweep`` times the launch configs of
the backward on a few cases.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch
import triton
from triton.testing import do_bench

import flashrange.ops  # noqa: F401
from flashrange.kernels import backward as bwd

FULL, CAUSAL, BI_CAUSAL = 0, 1, 3


def _doc_bounds(T, n_docs, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, T), n_docs - 1))
    return [0] + cuts + [T]


def make_case(kind, T, n_docs=0, window=0):
    """``(rows, area, flex mask_mod, sdpa is_causal or None)``; rows are ``(qs, qe, ks, ke, type)``."""
    if kind == "full":
        return [(0, T, 0, T, FULL)], T * T, (lambda b, h, qi, kj: qi >= 0), False
    if kind == "causal":
        return [(0, T, 0, T, CAUSAL)], T * (T + 1) // 2, (lambda b, h, qi, kj: qi >= kj), True
    if kind == "doc":
        bnd = _doc_bounds(T, n_docs, seed=n_docs)
        rows = [(a, b, a, b, CAUSAL) for a, b in zip(bnd[:-1], bnd[1:])]
        area = sum((b - a) * (b - a + 1) // 2 for a, b in zip(bnd[:-1], bnd[1:]))
        doc_id = torch.zeros(T, dtype=torch.int32, device="cuda")
        for i, (a, b) in enumerate(zip(bnd[:-1], bnd[1:])):
            doc_id[a:b] = i
        return rows, area, (lambda b, h, qi, kj: (doc_id[qi] == doc_id[kj]) & (qi >= kj)), None
    if kind == "window":
        # Query i sees keys i - W + 1 .. i (W keys, its own included).
        W = window
        rows = [(0, W, 0, W, CAUSAL), (W, T, 1, T, BI_CAUSAL)]
        area = W * (W + 1) // 2 + (T - W) * W
        return rows, area, (lambda b, h, qi, kj: (qi >= kj) & (qi - kj < W)), None
    raise ValueError(kind)


CASES = [
    # name, kind, T, H, D, extra
    ("full-8k-d128", "full", 8192, 16, 128, {}),
    ("causal-32k-d128", "causal", 32768, 16, 128, {}),
    ("doc16-32k-d128", "doc", 32768, 16, 128, {"n_docs": 16}),
    ("doc128-32k-d128", "doc", 32768, 16, 128, {"n_docs": 128}),
    ("window2048-32k-d128", "window", 32768, 16, 128, {"window": 2048}),
]

SWEEP = [
    bwd.BwdConfig(32, 128, 8, 2, 128, 64, 8, 2),
    bwd.BwdConfig(64, 128, 8, 2, 128, 32, 8, 3),
    bwd.BwdConfig(32, 64, 8, 2, 64, 64, 4, 2),
]


def bench(fn, grad_to_none=None):
    return do_bench(fn, warmup=20, rep=60, grad_to_none=grad_to_none)


def peak_extra_mb(fn):
    """MB allocated at peak by ``fn`` beyond what was live before it (its results included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _tensors(T, H, D, rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    t = torch.tensor(rows, dtype=torch.int32, device="cuda")
    return q, k, v, do, t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def time_ours(q, k, v, do, qr, kr, mt, scale, row, config=None, parts=True):
    fwd_op = torch.ops.flashrange.fwd
    out, lse = fwd_op(q, k, v, qr, kr, mt, scale, 0.0)
    dlse = torch.zeros_like(lse)
    row["ours_fwd_ms"] = bench(lambda: fwd_op(q, k, v, qr, kr, mt, scale, 0.0))
    row["ours_bwd_ms"] = bench(
        lambda: bwd.range_attention_backward_triton(do, q, k, v, out, lse, qr, kr, mt, scale, 0.0, dlse, config=config)
    )
    if parts:
        st = bwd._prepare(do, q, k, v, out, lse, qr, kr, mt, scale, 0.0, dlse, config)
        row["ours_pre_ms"] = bench(lambda: bwd._launch_preprocess(st))
        row["ours_dkdv_ms"] = bench(lambda: bwd._launch_dkdv(st))
        row["ours_dq_ms"] = bench(lambda: bwd._launch_dq(st))
    if config is None:
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

        def fb():
            o, _ = fwd_op(qg, kg, vg, qr, kr, mt, scale, 0.0)
            o.backward(do)

        row["ours_fwdbwd_ms"] = bench(fb, grad_to_none=[qg, kg, vg])
        row["ours_peak_extra_mb"] = peak_extra_mb(fb)


def time_cudnn(q, k, v, do, scale, is_causal, row):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh, doh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, do))
    qg, kg, vg = (x.detach().requires_grad_() for x in (qh, kh, vh))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        row["cudnn_fwd_ms"] = bench(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale))

        def fb():
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=is_causal, scale=scale).backward(doh)

        row["cudnn_fwdbwd_ms"] = bench(fb, grad_to_none=[qg, kg, vg])
        row["cudnn_peak_extra_mb"] = peak_extra_mb(fb)


_FLEX = None


def time_flex(q, k, v, do, scale, mod, row):
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    T = q.shape[0]
    qh, kh, vh, doh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, do))
    qg, kg, vg = (x.detach().requires_grad_() for x in (qh, kh, vh))
    bm = create_block_mask(mod, None, None, T, T, device="cuda")
    row["flex_fwd_ms"] = bench(lambda: _FLEX(qh, kh, vh, block_mask=bm, scale=scale))

    def fb():
        _FLEX(qg, kg, vg, block_mask=bm, scale=scale).backward(doh)

    row["flex_fwdbwd_ms"] = bench(fb, grad_to_none=[qg, kg, vg])
    row["flex_peak_extra_mb"] = peak_extra_mb(fb)


def run_case(name, kind, T, H, D, extra, *, flex=True):
    rows, area, mod, is_causal = make_case(kind, T, **extra)
    q, k, v, do, qr, kr, mt = _tensors(T, H, D, rows)
    scale = D ** -0.5
    flops = 4 * area * D * H
    row = {"case": name, "T": T, "H": H, "D": D, "area": area, "fwd_gflop": flops * 1e-9,
           "inputs_mb": 3 * q.numel() * 2 / 2**20}
    for label, fn in (("ours", lambda: time_ours(q, k, v, do, qr, kr, mt, scale, row)),
                      ("cudnn", lambda: is_causal is not None and time_cudnn(q, k, v, do, scale, is_causal, row)),
                      ("flex", lambda: flex and time_flex(q, k, v, do, scale, mod, row))):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            row[f"{label}_error"] = repr(e)[:300]
    for who in ("ours", "cudnn", "flex"):
        if f"{who}_fwdbwd_ms" in row:
            row[f"{who}_fwdbwd_tflops"] = 3.5 * flops / row[f"{who}_fwdbwd_ms"] * 1e-9
            if f"{who}_bwd_ms" not in row and f"{who}_fwd_ms" in row:
                row[f"{who}_bwd_ms"] = row[f"{who}_fwdbwd_ms"] - row[f"{who}_fwd_ms"]
        if f"{who}_bwd_ms" in row:
            row[f"{who}_bwd_tflops"] = 2.5 * flops / row[f"{who}_bwd_ms"] * 1e-9
    return row


def sweep(names):
    out = []
    for name, kind, T, H, D, extra in CASES:
        if name not in names:
            continue
        rows, area, _, _ = make_case(kind, T, **extra)
        q, k, v, do, qr, kr, mt = _tensors(T, H, D, rows)
        flops = 4 * area * D * H
        for cfg in SWEEP:
            row = {"sweep": True, "case": name, "config": list(cfg)}
            try:
                time_ours(q, k, v, do, qr, kr, mt, D ** -0.5, row, config=cfg)
                row["ours_bwd_tflops"] = 2.5 * flops / row["ours_bwd_ms"] * 1e-9
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def _f(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


def table(rows):
    lines = [
        "| case | ours bwd ms | ours bwd TF/s | dK/dV ms | dQ ms | ours fwd+bwd ms | ours fwd+bwd TF/s"
        " | cuDNN fwd+bwd TF/s | Flex fwd+bwd TF/s | x Flex | x cuDNN | Flex bwd TF/s | cuDNN bwd TF/s"
        " | peak extra MB ours / cuDNN / Flex |",
        "|" + "---|" * 14,
    ]
    for r in rows:
        if r.get("sweep"):
            continue
        o, c, fl = r.get("ours_fwdbwd_tflops"), r.get("cudnn_fwdbwd_tflops"), r.get("flex_fwdbwd_tflops")
        lines.append(
            f"| {r['case']} | {_f(r.get('ours_bwd_ms'), '{:.2f}')} | {_f(r.get('ours_bwd_tflops'))}"
            f" | {_f(r.get('ours_dkdv_ms'), '{:.2f}')} | {_f(r.get('ours_dq_ms'), '{:.2f}')}"
            f" | {_f(r.get('ours_fwdbwd_ms'), '{:.2f}')} | {_f(o)} | {_f(c)} | {_f(fl)}"
            f" | {_f(o / fl if o and fl else None, '{:.2f}')} | {_f(o / c if o and c else None, '{:.2f}')}"
            f" | {_f(r.get('flex_bwd_tflops'))} | {_f(r.get('cudnn_bwd_tflops'))}"
            f" | {_f(r.get('ours_peak_extra_mb'))} / {_f(r.get('cudnn_peak_extra_mb'))} / {_f(r.get('flex_peak_extra_mb'))} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--sweep", default="", help="comma-separated case names to sweep launch configs on")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    try:
        from flashrange.kernels.forward import range_attention_forward_triton  # noqa: F401

        fwd_name = "Triton forward"
    except ImportError:
        fwd_name = "reference forward (Triton forward not importable)"
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"flashrange forward: {fwd_name}", flush=True)
    only = set(filter(None, args.only.split(",")))
    rows = []
    for name, kind, T, H, D, extra in CASES:
        if only and name not in only:
            continue
        row = run_case(name, kind, T, H, D, extra, flex=not args.no_flex)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.sweep:
        rows += sweep(set(args.sweep.split(",")))
    print()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
