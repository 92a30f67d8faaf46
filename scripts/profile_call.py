"""Per-kernel GPU time of the public call (forward, then forward + backward) on bench cases.

    PYTHONPATH=. python scripts/profile_call.py --cases doc128-32k,full-8k [--reps 10]

Each case: the bench's inputs and mask, a few warm calls, then ``--reps`` calls of
``flashrange.range_attention`` (and of its backward) under ``torch.profiler``; the table lists
every CUDA kernel's time per call, so the plan, the delta preprocess and the gradient kernels
show up separately, and each attention kernel's TFLOP/s on its own matmuls.

Each call is first timed as the bench times it (median and spread). With ``--plan`` each case also
runs with ``plan=`` (built once, as a model's layers share one): the bench's "with a plan" forward +
backward has run 5 ms above the public call on causal-32k and GQA 16k while its forward and backward
alone did not (BENCHMARKS.md, twenty-sixth session), and the per-kernel tables say whether kernels slow
down or the GPU waits.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flashrange
from flashrange.bench.cases import select
from flashrange.bench.runner import case_flops, make_inputs
from flashrange.bench.timing import measure


# Matmuls per tile of each attention kernel; one matmul over the mask's area taken as half a forward (exact when
# D = Dv).
_MATMULS = {"range_attn_fwd_sm90_ws_kernel": 2, "_range_attn_fwd_kernel": 2, "bwd_dq_sm90_kernel": 3,
            "_bwd_dq_kernel": 3, "bwd_dkdv_sm90_kernel": 4, "_bwd_dkdv_kernel": 4, "_bwd_fused_kernel": 5}


def _kernel_table(prof, reps):
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = ev.cuda_time_total
        if us > 0 and ev.count > 0 and not ev.key.startswith(("cudaLaunch", "cuLaunch", "Memcpy", "Memset")):
            rows.append((us / reps, ev.count // reps, ev.key))
    rows.sort(reverse=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--plan", action="store_true", help="also the call with a plan built once")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    for case in select(args.cases):
        built = case.build(dev)
        mask, area = built.mask, built.area
        q, k, v, dout = make_inputs(case, dev, torch.bfloat16)
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)

        calls = [("", {})]
        if args.plan:
            calls.append((" with a plan", {"plan": flashrange.plan_mask(*mask.tensors(), case.T, case.T)}))
        for suffix, kwargs in calls:
            _profile_case(case, area, mask, q, k, v, dout, kwargs, suffix, args.reps)


def _profile_case(case, area, mask, q, k, v, dout, kwargs, suffix, reps):
    """One call's time per call (the bench's timing), then its per-kernel table under the profiler, forward and
    forward + backward; ``kwargs`` go to ``range_attention`` (``plan=``)."""

    def fwd():
        return flashrange.range_attention(q, k, v, *mask.tensors(), **kwargs)[0]

    def step():
        # The gradients returned, not accumulated into .grad (no extra adds in the table).
        torch.autograd.grad(fwd(), (q, k, v), dout)

    for label, fn in (("forward", fwd), ("forward + backward", step)):
        # Timed as the bench times it (its one timing function: L2 flushed, warm-up included).
        t = measure(fn, device=q.device, warmup=3, reps=reps)
        print(f"--- {case.name}, {label}{suffix}: ms per call, median {t.median_ms:.3f}, p20 {t.p20_ms:.3f}, "
              f"p80 {t.p80_ms:.3f}, min {t.min_ms:.3f}, max {t.max_ms:.3f}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        rows = _kernel_table(prof, reps)
        print(f"--- {case.name}, {label}{suffix}: GPU us per call, kernels per call, TFLOP/s on the kernel's "
              "matmuls")
        matmul = case_flops(case, area)["fwd"] / 2
        for us, n, name in rows[:12]:
            rate = f"{_MATMULS[name] * matmul / us / 1e6:7.0f}" if name in _MATMULS else " " * 7
            print(f"{us:10.1f} {n:4d} {rate}  {name[:100]}")
        print(f"{sum(r[0] for r in rows):10.1f}       (sum)")


if __name__ == "__main__":
    main()
