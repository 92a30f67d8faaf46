"""``flashrange bench``: every contender in one process, on the same inputs, timed one way (docs/design.md §11).

Modules, each with one job:

- :mod:`~flashrange.bench.cases`: the registry of named cases and their masks;
- :mod:`~flashrange.bench.timing`: the one timing function, and the host-time helper;
- :mod:`~flashrange.bench.contenders`: flashrange (public call, with a plan,
  raw op) and its peers, each through its public API;
- :mod:`~flashrange.bench.runner`: the attention table, with a correctness
  check of every contender against a baseline;
- :mod:`~flashrange.bench.overhead`: host overhead per call and plan cost;
- :mod:`~flashrange.bench.e2e`: a transformers training step per attention implementation;
- :mod:`~flashrange.bench.sweep`: the launch-config sweep behind the kernels' defaults;
- :mod:`~flashrange.bench.report`: markdown, JSON, PNG.

``main(argv)`` is the command line (``flashrange bench --help``). Importing
this package needs no GPU; CUDA-only pieces load when used.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from importlib import metadata
from pathlib import Path

import torch

from . import report
from .cases import CASES, Case, select

__all__ = ["main", "CASES", "Case"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
_DISTRIBUTIONS = ("triton", "transformers", "flash-attn-4", "nvidia-cutlass-dsl", "flash-attn", "flash_attn_3",
                  "magi-attention")


def _parser():
    p = argparse.ArgumentParser(
        prog="flashrange bench",
        description="Times flashrange and every available peer on the same inputs, checks their outputs "
                    "against a baseline, and writes bench.json, bench.md and bench.png.",
    )
    p.add_argument("--cases", default="", metavar="GLOB",
                   help="comma-separated case names, globs or @tags (default: @table; @sweep with --sweep): "
                        + ", ".join(c.name for c in CASES))
    p.add_argument("--tiny", action="store_true", help="toy sizes of every case (CPU harness check)")
    p.add_argument("--quick", action="store_true", help="2 warm-ups and 5 timed repetitions per measurement")
    p.add_argument("--check", action="store_true",
                   help="correctness only: one call per contender and case, no timing (compiled Flex skipped "
                        "unless named in --contenders)")
    p.add_argument("--sweep", action="store_true", help="time every forward and backward launch config instead")
    p.add_argument("--host", action="store_true", help="add the host-overhead table")
    p.add_argument("--plan-cost", action="store_true", help="add the plan-cost table")
    p.add_argument("--e2e", action="store_true", help="add the transformers training-step table")
    p.add_argument("--no-table", action="store_true", help="skip the attention table (extra tables only)")
    p.add_argument("--contenders", default="", help="comma-separated contender names (default: all available)")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per measurement (default 3; CPU 1)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 15; CPU 3)")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for bench.json, bench.md, bench.png (default out/bench)")
    p.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                   help="seconds; once spent, no new work starts and the report is still written (0: none)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first result that fails its check")
    p.add_argument("--report-only", metavar="FILE", default=None,
                   help="re-render a saved bench.json (to stdout; and into --out when given) and exit")
    p.add_argument("--short", action="store_true", help="print the short table only")
    return p


def _versions(device):
    from .. import __version__

    v = {"flashrange": __version__, "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        v["cuda"] = torch.version.cuda
        v["cudnn"] = torch.backends.cudnn.version()
    for dist in _DISTRIBUTIONS:
        try:
            v[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return v


def _header(device, dtype, args):
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": name,
        "device_type": device.type,
        "dtype": str(dtype).replace("torch.", ""),
        "versions": _versions(device),
        "tiny": args.tiny,
        "check_only": args.check,
        "backward": not args.no_backward,
        "warmup": args.warmup,
        "reps": args.reps,
        "argv": args.argv,
    }


def _prepare_dynamo():
    """Every case compiles Flex anew: lift Dynamo's recompile limit, and fail rather than silently fall back."""
    import torch._dynamo.config as dcfg

    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, knob):
            setattr(dcfg, knob, max(getattr(dcfg, knob), 64))
            break
    if hasattr(dcfg, "fail_on_recompile_limit_hit"):
        dcfg.fail_on_recompile_limit_hit = True


def _pick_contenders(device, spec):
    from .contenders import contenders_for

    available = contenders_for(device)
    if not spec:
        return available
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    known = {c.name for c in available}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        print(f"flashrange bench: not available here, skipped: {', '.join(unknown)} "
              f"(available: {', '.join(sorted(known))})", file=sys.stderr)
    chosen = [c for c in available if c.name in wanted or c.name == "flashrange"]
    for c in chosen:
        c.forced = c.name in wanted
    return chosen


def _report_only(args):
    data = report.load(args.report_only)
    print(report.short_table(data) if args.short else report.markdown_report(data))
    if args.out:
        report.write(data, args.out)
    return 1 if data.get("failures") or data.get("errors") else 0


def main(argv=None) -> int:
    """``flashrange bench``; returns 0, or 1 when a check fails or flashrange errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    if args.report_only:
        return _report_only(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flashrange bench: --device cuda but no CUDA GPU is visible; use --tiny on the CPU")
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("flashrange bench: the full-size cases need a CUDA GPU; on the CPU add --tiny "
                         "(toy sizes: a check of the harness, not a benchmark)")
    if args.sweep and device.type != "cuda":
        from ..kernels.common import interpreting

        if not interpreting():
            raise SystemExit("flashrange bench --sweep times the Triton kernels: it needs a CUDA GPU "
                             "(or TRITON_INTERPRET=1 with --tiny, a check of the harness)")
    dtype = _DTYPES[args.dtype]
    # On the CPU the times only show that the harness runs: few repetitions.
    few = args.quick or device.type != "cuda"
    args.warmup = args.warmup if args.warmup is not None else (1 if device.type != "cuda" else 2 if few else 3)
    args.reps = args.reps if args.reps is not None else (3 if device.type != "cuda" else 5 if few else 15)
    if args.warmup < 0 or args.reps < 1:
        raise SystemExit("flashrange bench: --warmup must be >= 0 and --reps >= 1")
    try:
        cases = select(args.cases, "sweep" if args.sweep else "table")
    except ValueError as e:
        raise SystemExit(f"flashrange bench: {e}") from None
    if args.tiny:
        cases = [c.tiny() for c in cases]
    out_dir = Path(args.out or "out/bench")

    from .runner import Settings, run_table
    from .timing import Budget

    st = Settings(device=device, dtype=dtype, warmup=args.warmup, reps=args.reps, backward=not args.no_backward,
                  check_only=args.check, fail_fast=args.fail_fast)
    budget = Budget(args.time_budget)
    data = {"header": _header(device, dtype, args), "cases": [], "failures": [], "errors": []}
    h = data["header"]
    print(f"flashrange bench: {h['device_name']} | " + " | ".join(f"{k} {v}" for k, v in h["versions"].items())
          + f" | dtype {h['dtype']} | {h['date']}", flush=True)
    if device.type != "cuda":
        print(f"flashrange bench: {report.CPU_BANNER}", flush=True)
    _prepare_dynamo()

    try:
        if args.sweep:
            from .sweep import run_sweep

            data["sweep"] = run_sweep(cases, st, budget)
        else:
            if args.plan_cost:
                from .overhead import plan_cost

                data["plan_cost"] = plan_cost(device, tiny=args.tiny, warmup=st.warmup, reps=st.reps, budget=budget)
            if args.host:
                from .overhead import host_overhead

                data["host"] = host_overhead(device, dtype, tiny=args.tiny, warmup=st.warmup, reps=st.reps,
                                             budget=budget)
            if not args.no_table:
                contenders = _pick_contenders(device, args.contenders)
                print("contenders: " + ", ".join(c.name for c in contenders), flush=True)
                run_table(cases, contenders, st, data, budget,
                          on_case_done=lambda: report.write(data, out_dir, with_plot=False))
            if args.e2e:
                from .e2e import run_e2e

                data["e2e"] = run_e2e(device, dtype, tiny=args.tiny, warmup=min(st.warmup, 2),
                                      reps=min(st.reps, 5), budget=budget)
    except KeyboardInterrupt:
        # timeout -s INT: keep what was measured.
        data["interrupted"] = True
        data["errors"].append("interrupted: later work missing")
    data["wall_s"] = budget.elapsed()
    report.write(data, out_dir)
    print(report.short_table(data) if args.short else report.markdown_report(data), flush=True)
    print(f"flashrange bench: results in {out_dir}/bench.json, bench.md" + (", bench.png" if data["cases"] else ""),
          flush=True)
    if data["failures"] or data["errors"]:
        print("!!! flashrange bench: " + "; ".join(data["errors"] + data["failures"])[:2000], file=sys.stderr)
        return 1
    return 0
