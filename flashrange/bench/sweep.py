"""Launch-config sweep (``flashrange bench --sweep``): every forward and backward config on the sweep cases.

The defaults of :func:`flashrange.kernels.forward.default_config` and
:func:`flashrange.kernels.backward.default_config` are fixed per head dim
and dtype (on Hopper their schedule also follows the mean slot length,
which never changes the bits: never a per-mask choice of arithmetic, so
that results stay bitwise reproducible); this sweep is how they are chosen.
On each case tagged ``sweep`` (the masks BENCHMARKS.md reports) it times the Triton forward with every
configuration :func:`~flashrange.kernels.forward.configs_for` allows, and
the Triton backward with each candidate :class:`~flashrange.kernels.backward.BwdConfig`,
with the benchmark's one timing function and the mask's plan built once.
Each config's output is checked against the default config's; a config
that disagrees (or fails to build) never wins. The best config per head
dim is the one with the lowest geometric mean of its time relative to the
fastest config of each case.
"""

from __future__ import annotations

import math
import sys

import torch

from .contenders import short_error
from .runner import TOLERANCE, case_flops, make_inputs, rel_err
from .timing import measure

__all__ = ["backward_candidates", "forward_candidates", "run_sweep", "best_per_head_dim"]


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def forward_candidates(D, Dv, dtype, device):
    """Forward configs to time: all that can run here (under the interpreter, only its own small ones)."""
    from ..kernels.forward import configs_for

    configs = configs_for(D, Dv, dtype, device_type=torch.device(device).type)
    if torch.device(device).type != "cuda":
        configs = [c for c in configs if c.name.startswith("cpu_")]
    return configs


def backward_candidates(D, Dv, dtype, device):
    """Backward configs to time: the default first, then shapes around it (duplicates dropped)."""
    from ..kernels.backward import BwdConfig, default_config

    device = torch.device(device)
    default = default_config(D, Dv, dtype, device)
    if device.type != "cuda":
        more = [BwdConfig(16, 32, 4, 1, 32, 16, 4, 1)]
    else:
        more = [
            BwdConfig(32, 128, 8, 3, 128, 64, 8, 3),
            BwdConfig(32, 128, 8, 2, 128, 64, 8, 2),
            BwdConfig(64, 128, 8, 3, 128, 64, 8, 3),
            BwdConfig(64, 128, 8, 2, 128, 32, 8, 3),
            BwdConfig(32, 64, 8, 2, 64, 64, 4, 2),
            BwdConfig(32, 64, 4, 2, 64, 32, 4, 2),
            BwdConfig(64, 64, 4, 3, 64, 64, 4, 3),
            BwdConfig(16, 64, 8, 2, 64, 32, 8, 2),
        ]
    out = [default]
    for c in more:
        if c not in out:
            out.append(c)
    return out


def _bwd_name(c) -> str:
    return (f"kv_m{c.kv_block_m}_n{c.kv_block_n}_w{c.kv_warps}_s{c.kv_stages}"
            f"+q_m{c.q_block_m}_n{c.q_block_n}_w{c.q_warps}_s{c.q_stages}")


def _sweep_config(rows, name, what, call, err_of, tol, st, budget, device) -> None:
    """Append config ``name``'s row to ``rows``: the error ``err_of(call())`` against the reference and the time of
    ``call``; a config that does not build says so in its note, one past ``tol`` is marked WRONG."""
    row = {"config": name, "time": None, "err": None, "note": ""}
    rows.append(row)
    if budget.skips(row):
        return
    _say(f"sweep {what} {name}")
    try:
        row["err"] = err_of(call())
        row["time"] = measure(call, device=device, warmup=st.warmup, reps=st.reps).as_dict()
    except Exception as e:  # noqa: BLE001 (a config that does not build is a result)
        row["note"] = short_error(e)
    if row["err"] is not None and not row["err"] <= tol:
        row["note"] = (row["note"] + " " if row["note"] else "") + f"WRONG (err {row['err']:.1e})"


def _sweep_case(case, st, budget) -> dict:
    from ..constants import has_short_slices
    from ..interface import plan_mask
    from ..kernels.backward import default_config as bwd_default
    from ..kernels.backward import range_attention_backward_triton
    from ..kernels.forward import default_config as fwd_default
    from ..kernels.forward import range_attention_forward_triton

    device, dtype = st.device, st.dtype
    cm = case.build(device)
    qr, kr, mt = cm.mask.tensors()
    q, k, v, dout = make_inputs(case, device, dtype)
    D, Dv = case.D, case.head_dim_v
    scale = D ** -0.5
    plan = plan_mask(qr, kr, mt, case.T, case.T)
    flops = case_flops(case, cm.area)
    tol = TOLERANCE[dtype]
    short = has_short_slices(case.T, case.T, mt.shape[0])
    out_ref, lse_ref = range_attention_forward_triton(q, k, v, qr, kr, mt, scale, 0.0, plan=plan)
    dlse = torch.zeros_like(lse_ref)
    grads_ref = range_attention_backward_triton(dout, q, k, v, out_ref, lse_ref, qr, kr, mt, scale, 0.0, dlse,
                                                plan=plan)
    rec = {"case": case.name, "T": case.T, "Hq": case.Hq, "D": D, "Dv": Dv, "area": cm.area, "flops": flops,
           "fwd_default": fwd_default(D, Dv, dtype, device_type=device.type, short_slices=short).name,
           "bwd_default": _bwd_name(bwd_default(D, Dv, dtype, device, short_slices=short)), "fwd": [], "bwd": []}
    for cfg in forward_candidates(D, Dv, dtype, device):
        def call(cfg=cfg):
            return range_attention_forward_triton(q, k, v, qr, kr, mt, scale, 0.0, plan=plan, config=cfg)

        _sweep_config(rec["fwd"], cfg.name, f"{case.name}: forward", call, lambda res: rel_err(res[0], out_ref),
                      tol, st, budget, device)
    for cfg in backward_candidates(D, Dv, dtype, device):
        def call(cfg=cfg):
            return range_attention_backward_triton(dout, q, k, v, out_ref, lse_ref, qr, kr, mt, scale, 0.0,
                                                   dlse, plan=plan, config=cfg)

        _sweep_config(rec["bwd"], _bwd_name(cfg), f"{case.name}: backward",
                      call, lambda res: max(rel_err(g, r) for g, r in zip(res, grads_ref)), tol, st, budget, device)
    return rec


def _usable(row, tol):
    return row.get("time") is not None and row.get("err") is not None and row["err"] <= tol


def best_per_head_dim(sweep: dict) -> list[dict]:
    """Per (head dim, direction): the config with the lowest geometric mean of ``ms / best ms of the case``.

    Only configs that ran correctly on every case of that head dim compete.
    """
    tol = TOLERANCE.get(getattr(torch, sweep.get("dtype", "bfloat16"), torch.bfloat16), 2e-2)
    out = []
    ran = [c for c in sweep["cases"] if not c.get("skipped")]
    for D, Dv in sorted({(c["D"], c["Dv"]) for c in ran}):
        cases = [c for c in ran if (c["D"], c["Dv"]) == (D, Dv)]
        for direction in ("fwd", "bwd"):
            rel: dict = {}
            for c in cases:
                rows = [r for r in c[direction] if _usable(r, tol)]
                if not rows:
                    continue
                fastest = min(r["time"]["median_ms"] for r in rows)
                for r in rows:
                    rel.setdefault(r["config"], []).append(r["time"]["median_ms"] / fastest)
            complete = {k: v for k, v in rel.items() if len(v) == len(cases)}
            if not complete:
                continue
            score = {k: math.exp(sum(math.log(x) for x in v) / len(v)) for k, v in complete.items()}
            best = min(score, key=score.get)
            default = cases[0][f"{direction}_default"]
            out.append({"D": D, "Dv": Dv, "direction": direction, "best": best, "score": score[best],
                        "default": default, "default_score": score.get(default), "cases": len(cases)})
    return out


def run_sweep(cases, st, budget) -> dict:
    """``{"dtype", "cases": [...], "best": [...]}`` for the ``sweep`` cases given."""
    res = {"dtype": str(st.dtype).replace("torch.", ""), "cases": [], "best": []}
    for case in cases:
        if budget.spent():
            res["cases"].append({"case": case.name, "skipped": "time budget spent", "D": case.D,
                                 "Dv": case.head_dim_v, "fwd": [], "bwd": []})
            continue
        try:
            res["cases"].append(_sweep_case(case, st, budget))
        except Exception as e:  # noqa: BLE001
            res["cases"].append({"case": case.name, "skipped": short_error(e), "D": case.D, "Dv": case.head_dim_v,
                                 "fwd": [], "bwd": []})
        if st.device.type == "cuda":
            torch.cuda.empty_cache()
    res["best"] = best_per_head_dim(res)
    return res
