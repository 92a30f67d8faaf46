"""A/B of kernel variants and launch configs on the GPU, through the launchers with a plan built once.

    PYTHONPATH=. python scripts/ab.py --cases causal-8k,doc128-32k \\
        --fwd main:default --fwd v1:default --bwd main:default --bwd "main:64,128,8,3,128,64,8,3,dkdv+dq+persistent"

A variant is ``PACKAGE:CONFIG``. ``PACKAGE`` is ``main`` (the checked-out flashrange) or a name exported by
``scripts/ab_export.sh REF NAME`` (carry ``ab``). ``CONFIG`` is ``default``, a forward config's name, or a
backward config as ``kv_m,kv_n,kv_w,kv_s,q_m,q_n,q_w,q_s[,flags]``, flags from
``dkdv+dq+persistent+dynamic+adaptive+atomic+fixed+chunksN`` or ``fused``.

First, correctness: with ``--fuzz N``, each variant on N random small masks (every type, overlaps, empty
slices, GQA, softcap) against the float64 reference, failing when its error passes twice the first variant's
plus a small floor; then on each case each variant against the first (bitwise equal or the relative error).
Then the timings, interleaved (every variant once per repetition, L2 flushed before each), median and
p20-p80 per variant. The table goes last; ``--out DIR`` also writes ``ab.json`` there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import sys

import torch

from flashrange.bench.cases import select
from flashrange.bench.runner import make_inputs, rel_err
from flashrange.bench.timing import L2_FLUSH_BYTES
from flashrange.reference import range_attention_backward, range_attention_forward

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def package(name):
    """The kernels of variant package ``name``: ``(forward module, backward module, plan builder)``."""
    if name == "main":
        prefix = "flashrange"
    else:
        sys.path.insert(0, os.path.join(ROOT, "ab", name))
        prefix = f"flashrange_{name}"
    fwd = importlib.import_module(prefix + ".kernels.forward")
    bwd = importlib.import_module(prefix + ".kernels.backward")
    plan = importlib.import_module(prefix + ".kernels.plan")
    return fwd, bwd, plan.build_plan


def backward_config(spec, config_cls):
    """``config_cls`` (a ``BwdConfig``) from ``kv_m,kv_n,kv_w,kv_s,q_m,q_n,q_w,q_s[,flags]``, flags any of
    ``dkdv``, ``dq``, ``persistent``, ``dynamic``, ``adaptive``, ``atomic`` (``atomic_dq``), ``fixed``
    (``fixed_point_dq``), ``fused``,
    ``chunksN`` (``kv_head_chunks=N``) joined by ``+``. ``atomic`` and ``fixed`` name fields that only an
    export of 86d768d or earlier (back to 0b7ae86) has: the five-matmul backward at head dim 64, removed
    after its timings (BENCHMARKS.md, twenty-ninth session)."""
    parts = spec.split(",")
    flags = set(parts[8].split("+")) if len(parts) > 8 else set()
    chunks = [int(f[len("chunks"):]) for f in flags if f.startswith("chunks")]
    # Only when asked for: an exported earlier flashrange's BwdConfig may not have the field.
    extra = {name: True for flag, name in (("adaptive", "adaptive"), ("atomic", "atomic_dq"),
                                           ("fixed", "fixed_point_dq"), ("rows", "row_intervals")) if flag in flags}
    return config_cls(*[int(x) for x in parts[:8]], gluon_dkdv="dkdv" in flags, gluon_dq="dq" in flags,
                      persistent="persistent" in flags, dynamic="dynamic" in flags, fused_dq="fused" in flags,
                      kv_head_chunks=chunks[0] if chunks else 1, **extra)


class Variant:
    def __init__(self, spec, direction):
        self.spec = spec
        pkg, _, cfg = spec.partition(":")
        self.fwd, self.bwd, self.build_plan = package(pkg)
        self.direction = direction
        if cfg in ("", "default"):
            self.config = None
        elif direction == "fwd":
            self.config = cfg
        else:
            self.config = backward_config(cfg, self.bwd.BwdConfig)

    def prepare(self, q, k, v, dout, ranges, T, scale, softcap):
        """A no-argument callable of this variant on these inputs, and its result."""
        qr, kr, mt = ranges
        plan = self.build_plan(qr, kr, mt, T, T)
        if self.direction == "fwd":
            def call():
                return self.fwd.range_attention_forward_triton(q, k, v, qr, kr, mt, scale, softcap, plan=plan,
                                                               config=self.config)
        else:
            out, lse = self.fwd.range_attention_forward_triton(q, k, v, qr, kr, mt, scale, softcap, plan=plan)

            def call():
                return self.bwd.range_attention_backward_triton(dout, q, k, v, out, lse, qr, kr, mt, scale,
                                                                softcap, None, plan=plan, config=self.config)
        return call, call()


def _slice_rows(g, T):
    """Random slices over ``T`` tokens from the tests' generator (``tests/golden.py``): every type, overlaps,
    length-1 slices, tensor edges, empty slices."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        from golden import random_slice_rows
    finally:
        sys.path.pop(0)
    rng = random.Random(int(torch.randint(0, 2**31, (1,), generator=g)))
    rows = random_slice_rows(T, T, int(torch.randint(1, 12, (1,), generator=g)), rng, n_empty=2, random_types=True)
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def fuzz(variants, n, dtype, fuzz_d, device):
    g = torch.Generator().manual_seed(7)
    failures = 0
    for i in range(n):
        T = int(torch.randint(40, 700, (1,), generator=g))
        hkv = int(torch.randint(1, 3, (1,), generator=g))
        hq = hkv * int(torch.randint(1, 4, (1,), generator=g))
        D = fuzz_d
        softcap = 0.0 if i % 3 else 20.0
        x = [torch.randn(T, h, D, generator=g) for h in (hq, hkv, hkv)]
        dout = torch.randn(T, hq, D, generator=g)
        ranges = [r.to(device) for r in _slice_rows(g, T)]
        gold_in = [t.double() for t in x]
        out_g, lse_g = range_attention_forward(*gold_in, *[r.cpu() for r in ranges], D ** -0.5, softcap)
        dev = [t.to(device, dtype) for t in x]
        if variants[0].direction == "bwd":
            gq, gk, gv = range_attention_backward(dout.double(), *gold_in, out_g, lse_g, *[r.cpu() for r in ranges],
                                                  D ** -0.5, softcap)
            golds = (gq, gk, gv)
        else:
            golds = (out_g,)
        errs = []
        for var in variants:
            _, res = var.prepare(*dev, dout.to(device, dtype), ranges, T, D ** -0.5, softcap)
            res = res if var.direction == "bwd" else res[:1]
            errs.append(max(rel_err(r.cpu(), gd) for r, gd in zip(res, golds)))
        for var, e in zip(variants[1:], errs[1:]):
            if not e <= 2 * errs[0] + 1e-3:
                failures += 1
                print(f"!!! fuzz {i} {var.spec}: error {e:.2e} against {errs[0]:.2e} of {variants[0].spec}")
    print(f"fuzz: {n} masks x {len(variants)} variants, {failures} failures")
    return failures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="bench case names, globs or @tags; none: only the fuzz")
    ap.add_argument("--fuzz-d", type=int, default=128, help="head dim of the fuzz's inputs")
    ap.add_argument("--device", default="cuda", help="cpu (with TRITON_INTERPRET=1) runs the fuzz only")
    ap.add_argument("--fwd", action="append", default=[])
    ap.add_argument("--bwd", action="append", default=[])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fuzz", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if args.device == "cuda" else None
    results, failures = [], 0
    for direction, specs in (("fwd", args.fwd), ("bwd", args.bwd)):
        if not specs:
            continue
        variants = [Variant(s, direction) for s in specs]
        if args.fuzz:
            failures += fuzz(variants, args.fuzz, dtype, args.fuzz_d, args.device)
        for case in (select(args.cases) if args.cases else []):
            cm = case.build("cuda")
            q, k, v, dout = make_inputs(case, "cuda", dtype)
            ranges = cm.mask.tensors()
            calls, outs = [], []
            for var in variants:
                call, res = var.prepare(q, k, v, dout, ranges, case.T, case.D ** -0.5, 0.0)
                calls.append(call)
                outs.append(res if direction == "bwd" else res[:2])
            checks = []
            for var, res in zip(variants, outs):
                same = all(torch.equal(a, b) for a, b in zip(res, outs[0]))
                err = max(rel_err(a, b) for a, b in zip(res, outs[0]))
                checks.append("bitwise" if same else f"rel {err:.1e}")
                if not err <= 2e-2:
                    failures += 1
                    print(f"!!! {case.name} {direction} {var.spec}: relative error {err:.2e} to {variants[0].spec}")
            for c in calls:
                c()
            times = [[] for _ in variants]
            for _ in range(args.reps):
                for j, c in enumerate(calls):
                    flush.zero_()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    c()
                    e.record()
                    times[j].append((s, e))
            torch.cuda.synchronize()
            for var, ts, chk in zip(variants, times, checks):
                ms = sorted(s.elapsed_time(e) for s, e in ts)
                rec = {"dir": direction, "case": case.name, "variant": var.spec, "median_ms": statistics.median(ms),
                       "p20": ms[len(ms) // 5], "p80": ms[(4 * len(ms)) // 5], "check": chk}
                results.append(rec)
                print(f"{direction} {case.name:18s} {var.spec:60s} {rec['median_ms']:8.3f} ms  ({chk})", flush=True)
            del calls, outs
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ab.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\n| dir | case | " + " | ".join(dict.fromkeys(r["variant"] for r in results)) + " |")
    for key in dict.fromkeys((r["dir"], r["case"]) for r in results):
        row = {r["variant"]: r for r in results if (r["dir"], r["case"]) == key}
        print(f"| {key[0]} | {key[1]} | " + " | ".join(
            f"{row[v]['median_ms']:.3f}" if v in row else "–" for v in dict.fromkeys(r["variant"] for r in results))
            + " |")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
