"""Per-kernel GPU time of the public call (forward, then forward + backward) on bench cases.

    PYTHONPATH=. python scripts/profile_call.py --cases doc128-32k,full-8k [--reps 10]

Each case: the bench's inputs and mask, a few warm calls, then ``--reps`` calls of
``flashrange.range_attention`` (and of its backward) under ``torch.profiler``; the table lists
every CUDA kernel's time per call, so the plan, the delta preprocess and the gradient kernels
show up separately, and each attention kernel's TFLOP/s on its own matmuls.

Each call is first timed as the bench times it (median and spread). With ``--plan`` each case also
runs with ``plan=`` (built once, as a model's layers share one). With ``--variants``, forward + backward
of the public call, the call with a plan, the plan cloned per call, the plan with the forward's
recorded launch forgotten per call, and the raw op, in interleaved rounds with the SM clock read after
each call, then each alone as the bench times it. That is how the bench's "with a plan" forward +
backward, 5 ms above the public call on causal-32k and GQA 16k in two sessions, was found to be the GPU
lowering its clock under sustained load (readings of 1185-1710 MHz against 1980), which slows whichever
contender runs then: interleaved, every variant had the same median and the same slow tail
(BENCHMARKS.md, twenty-seventh session).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import flashrange
from flashrange.bench.cases import select
from flashrange.bench.runner import case_flops, make_inputs
from flashrange.bench.timing import L2_FLUSH_BYTES, measure, sm_clock_mhz


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
    ap.add_argument("--variants", action="store_true",
                    help="instead: forward + backward of the public call, the call with a plan and three variants "
                         "of it, timed in interleaved rounds and then each in a run of its own")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.variants:
        for case in select(args.cases):
            _variants(case, dev, args.reps)
        return
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


def _variants(case, dev, reps):
    """Forward + backward per call of the public call and of the call with a plan, with the variants that
    tell apart what the planned call changes: the plan's tensors made anew for each call (cloned, so
    the same values at new addresses), the forward's recorded launches forgotten before each call (the
    full launch path every time), and the raw op with the same plan. First interleaved rounds (each
    variant once per round, L2 flushed, a sync and an SM clock reading after each call), then each
    variant alone as the bench times it (``measure``: every repetition queued before one sync)."""
    from flashrange.kernels import forward as kfwd

    built = case.build(dev)
    mask = built.mask
    tensors = mask.tensors()
    q, k, v, dout = make_inputs(case, dev, torch.bfloat16)
    leaves = tuple(t.detach().requires_grad_(True) for t in (q, k, v))
    plan = flashrange.plan_mask(*tensors, case.T, case.T)
    op_plan = list(plan)
    scale = case.D ** -0.5

    def public():
        return flashrange.range_attention(*leaves, *tensors)[0]

    def planned():
        return flashrange.range_attention(*leaves, *tensors, plan=plan)[0]

    def fresh_plan():
        return flashrange.range_attention(*leaves, *tensors, plan=type(plan)(*(t.clone() for t in plan)))[0]

    def unrecorded():
        kfwd._RECIPES.clear()
        return flashrange.range_attention(*leaves, *tensors, plan=plan)[0]

    def raw_op():
        return torch.ops.flashrange.fwd(*leaves, *tensors, op_plan, scale, 0.0)[0]

    variants = [("public", public), ("plan", planned), ("plan cloned per call", fresh_plan),
                ("plan, launch unrecorded", unrecorded), ("raw op", raw_op)]
    steps = {name: (lambda f=f: torch.autograd.grad(f(), leaves, dout)) for name, f in variants}
    for step in steps.values():
        step()
    torch.cuda.synchronize()
    buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    times = {name: [] for name in steps}
    clocks = {name: [] for name in steps}
    for r in range(reps):
        order = list(steps.items())
        order = order[r % len(order):] + order[:r % len(order)]  # each variant takes every position in turn
        for name, step in order:
            buf.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
            clocks[name].append(sm_clock_mhz(dev))
    print(f"--- {case.name}, forward + backward, {reps} interleaved rounds, synced per call: ms (median, min, max), "
          "SM MHz after the call (min, max)")
    for name in steps:
        xs = sorted(times[name])
        cs = [c for c in clocks[name] if c is not None]
        clock = f"{min(cs)}-{max(cs)}" if cs else "n/a"
        print(f"    {name:28s} {statistics.median(xs):8.3f} {xs[0]:8.3f} {xs[-1]:8.3f}   {clock}")
    print(f"--- {case.name}, forward + backward, each alone as the bench times it (measure, {reps} reps): ms "
          "(median, p20, p80, max), SM MHz after")
    for name, step in steps.items():
        t = measure(step, device=dev, warmup=3, reps=reps)
        print(f"    {name:28s} {t.median_ms:8.3f} {t.p20_ms:8.3f} {t.p80_ms:8.3f} {t.max_ms:8.3f}   {sm_clock_mhz(dev)}")


if __name__ == "__main__":
    main()
