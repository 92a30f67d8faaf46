"""The attention table: every selected case through every contender, timed and checked.

Per case: the mask is built once (:mod:`flashrange.bench.cases`), seeded
inputs are drawn once, and a baseline result is computed — flashrange's
reference (float32 math) where it is cheap enough, otherwise flashrange's
raw op. Then each contender (:mod:`flashrange.bench.contenders`) runs in
turn: one untimed call (compilation, autotuning) whose output and
gradients are compared with the baseline, then the forward, the backward
and forward+backward, each through :func:`flashrange.bench.timing.measure`.

The backward is timed the same way for every contender: the forward runs
once outside the timed region and each repetition calls
``torch.autograd.grad(out, inputs, dout, retain_graph=True)`` on that graph.
A contender whose graph cannot be retained reports no backward time
(forward+backward is still timed as a whole).
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from .contenders import Flex, short_error, time_create_block_mask
from .timing import measure, sm_clock_mhz, synchronize

__all__ = [
    "Settings",
    "TOLERANCE",
    "DIRECTIONS",
    "FLOP_FACTOR",
    "case_flops",
    "make_inputs",
    "rel_err",
    "run_table",
    "case_record",
    "note_low_clocks",
]

# Relative L2 difference allowed between a contender and the baseline: two
# correct low-precision results differ by a few output roundings.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-3}
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
# Backward counts 2.5x the forward's FLOPs (dQ, dK, dV and the recomputed
# scores), forward+backward 3.5x, as FlashAttention's benchmarks count them.
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}

# The float32 reference is the baseline while it stays cheap: its cost grows
# with T * T * Hq (it computes every score of a row block) and its host loop
# with the slice count.
_REFERENCE_MAX_CELLS = 1 << 31
_REFERENCE_MAX_SLICES = 256


@dataclass
class Settings:
    """How the table runs: device, dtype, repetitions, and what to skip."""

    device: torch.device
    dtype: torch.dtype
    warmup: int = 3
    reps: int = 15
    backward: bool = True
    check_only: bool = False
    fail_fast: bool = False


def case_flops(case, area: int) -> dict:
    """FLOPs per direction on the mask's real area: ``2 * area * Hq * (D + Dv)`` forward (``4 * area * D * Hq``)."""
    fwd = 2.0 * area * case.Hq * (case.D + case.head_dim_v)
    return {d: fwd * f for d, f in FLOP_FACTOR.items()}


def make_inputs(case, device, dtype):
    """Seeded ``q, k, v, dout`` in the packed `(T, H, D)` layout (drawn on the CPU: identical on every machine)."""
    g = torch.Generator(device="cpu").manual_seed(1234 + case.T + case.Hq + case.D)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    q = randn(case.T, case.Hq, case.D)
    k = randn(case.T, case.Hkv, case.D)
    v = randn(case.T, case.Hkv, case.head_dim_v)
    dout = randn(case.T, case.Hq, case.head_dim_v)
    return q, k, v, dout


def rel_err(a, b) -> float:
    """Relative L2 difference of ``a`` to ``b`` (``inf`` when ``a`` is not finite)."""
    a, b = a.float(), b.float()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - b).norm()) / max(float(b.norm()), 1e-30)


def _free(device, collect=False):
    # gc.collect is slow once Dynamo has run: only between cases.
    if collect:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _baseline(case, cm, inputs):
    """``{"name", "out", "grads"}``: the result every contender is compared with."""
    q, k, v, dout = inputs
    qr, kr, mt = cm.mask.tensors()
    scale = case.D ** -0.5
    cheap = (case.T * case.T * case.Hq <= _REFERENCE_MAX_CELLS and cm.mask.num_slices <= _REFERENCE_MAX_SLICES)
    if cheap or q.device.type != "cuda":
        from ..reference import range_attention_backward, range_attention_forward

        qf, kf, vf = q.float(), k.float(), v.float()
        out, lse = range_attention_forward(qf, kf, vf, qr, kr, mt, scale, 0.0)
        grads = range_attention_backward(dout.float(), qf, kf, vf, out, lse, qr, kr, mt, scale, 0.0)
        return {"name": "reference (float32 math)", "out": out, "grads": list(grads)}
    import flashrange  # noqa: F401 (registers the ops)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    plan = list(torch.ops.flashrange.plan(qr, kr, mt, case.T, case.T))
    out = torch.ops.flashrange.fwd(*leaves, qr, kr, mt, plan, scale, 0.0)[0]
    grads = torch.autograd.grad(out, leaves, dout)
    return {"name": "flashrange raw op", "out": out.detach(), "grads": [g.detach() for g in grads]}


def _host_syncs(fn):
    """Messages of the host syncs ``fn`` makes, seen through CUDA sync-debug "warn" mode (reported only)."""
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    # PyTorch words each sync as "called a synchronizing CUDA operation"; its one-time notice that the
    # mode is a prototype ("Synchronization debug mode is a prototype feature...") is not a sync.
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


def _run_contender(c, case, cm, inputs, base, st: Settings) -> dict:
    """One contender on one case; its own errors become the record's status, never an exception."""
    q, k, v, dout = inputs
    device = q.device
    rec = {"status": "ok", "note": "", "first_call_s": None, "err_out": None, "err_grad": None,
           "peak_mem_bytes": None, **{d: None for d in DIRECTIONS}}
    backward = st.backward
    if backward and not c.backward_on(device):
        backward, rec["note"] = False, f"forward only on {device.type}"
    fn = leaves = None
    try:
        c.extra = {}
        fn = c.make(case, cm)
        rec.update(c.extra)
        leaves = [c.to_layout(t).detach().requires_grad_(backward) for t in (q, k, v)]
        dout_l = c.to_layout(dout)
        t0 = time.perf_counter()
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dout_l) if backward else None
        synchronize(device)
        rec["first_call_s"] = time.perf_counter() - t0
        rec["err_out"] = rel_err(c.from_layout(out.detach()), base["out"])
        if grads is not None:
            rec["err_grad"] = max(rel_err(c.from_layout(g), r) for g, r in zip(grads, base["grads"]))
        del out, grads
        if device.type == "cuda" and c.is_flashrange:
            # docs/design.md §7: no host sync on the GPU path. Reported, never a switch.
            def one_step():
                o = fn(*leaves)
                if backward:
                    torch.autograd.grad(o, leaves, dout_l)

            syncs = _host_syncs(one_step)
            if syncs:
                rec["host_syncs"] = len(syncs)
                rec["note"] = (rec["note"] + " " if rec["note"] else "") + f"HOST SYNC: {syncs[0][:60]}"
        if st.check_only:
            return rec
        clocks = []
        rec["fwd"] = measure(lambda: fn(*leaves), device=device, warmup=st.warmup, reps=st.reps).as_dict()
        clocks.append(sm_clock_mhz(device))
        if backward:
            out = fn(*leaves)
            try:
                rec["bwd"] = measure(lambda: torch.autograd.grad(out, leaves, dout_l, retain_graph=True),
                                     device=device, warmup=st.warmup, reps=st.reps).as_dict()
            except RuntimeError as e:
                rec["note"] = (rec["note"] + " " if rec["note"] else "") + f"no bwd time ({short_error(e)[:60]})"
            del out
            clocks.append(sm_clock_mhz(device))
            rec["fwdbwd"] = measure(lambda: torch.autograd.grad(fn(*leaves), leaves, dout_l),
                                    device=device, warmup=st.warmup, reps=st.reps).as_dict()
            clocks.append(sm_clock_mhz(device))
        clocks = [c for c in clocks if c is not None]
        rec["sm_mhz"] = min(clocks) if clocks else None
        if device.type == "cuda":
            # Peak memory of one call (fwd+bwd when timed) above what was live before it.
            _free(device)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base_bytes = torch.cuda.memory_allocated(device)
            out = fn(*leaves)
            if backward:
                torch.autograd.grad(out, leaves, dout_l)
            del out
            torch.cuda.synchronize(device)
            rec["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device) - base_bytes
    except torch.cuda.OutOfMemoryError as e:
        rec.update(status="n/a", note=f"out of memory: {short_error(e)[:80]}")
    except Exception as e:  # noqa: BLE001 (a peer failing is a result, not a crash)
        rec.update(status="error" if c.is_flashrange else "n/a", note=short_error(e))
    finally:
        del fn, leaves
        _free(device)
    return rec


# A contender whose lowest SM clock reading after its timings is below this share of the case's highest
# reading gets a note: the GPU lowered its clock under sustained load while it ran (BENCHMARKS.md, twenty-seventh
# session: a "with a plan" forward + backward 16% slower than the public call was this, not the call).
LOW_CLOCK_SHARE = 0.9


def note_low_clocks(results: dict) -> None:
    """Add a note to each timed record of one case whose ``sm_mhz`` is below ``LOW_CLOCK_SHARE`` of the case's
    highest reading; records without a reading are left alone."""
    readings = [r["sm_mhz"] for r in results.values() if r.get("sm_mhz")]
    if not readings:
        return
    top = max(readings)
    for rec in results.values():
        mhz = rec.get("sm_mhz")
        if mhz and mhz < LOW_CLOCK_SHARE * top:
            note = f"SM clock {mhz} MHz after timing ({top} for another contender): throttled, compare with care"
            rec["note"] = (rec["note"] + " " if rec.get("note") else "") + note


def case_record(case, cm) -> dict:
    """The JSON record of a case before any result: its definition and mask statistics."""
    return {
        "name": case.name, "kind": case.kind, "tags": list(case.tags), "T": case.T, "Hq": case.Hq,
        "Hkv": case.Hkv, "D": case.D, "Dv": case.head_dim_v, "description": cm.description,
        "slices": cm.mask.num_slices, "area": cm.area, "density": cm.area / float(case.T * case.T),
        "flops": case_flops(case, cm.area), "results": {}, "block_mask": None, "baseline": None,
    }


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def run_table(cases, contenders, st: Settings, data: dict, budget, *, on_case_done=None) -> None:
    """Run ``cases`` x ``contenders``; appends to ``data["cases"]``, ``data["failures"]``, ``data["errors"]``.

    Stops starting new cases when ``budget`` is spent (the rest are marked
    skipped) and, with ``st.fail_fast``, at the first mismatch.
    """
    tol = TOLERANCE[st.dtype]
    stop = None
    n = len(cases)
    for i, case in enumerate(cases, start=1):
        cm = case.build(st.device)
        crec = case_record(case, cm)
        data["cases"].append(crec)
        if stop or budget.spent():
            stop = stop or "time budget spent"
            crec["skipped"] = stop
            _say(f"[{i}/{n}] {case.name}: skipped ({stop})")
            continue
        t_case = time.perf_counter()
        inputs = make_inputs(case, st.device, st.dtype)
        try:
            base = _baseline(case, cm, inputs)
        except Exception as e:  # noqa: BLE001
            data["errors"].append(f"{case.name}/baseline: {short_error(e)}")
            crec["skipped"] = f"baseline failed: {short_error(e)}"
            continue
        crec["baseline"] = base["name"]
        for c in contenders:
            why = c.unsupported(case, cm, st.device, st.dtype)
            if why is None and st.check_only and c.compiles and not getattr(c, "forced", False):
                why = "not in --check (compiles per case; checked in the timed run)"
            if why is None and budget.spent():
                why, stop = "skipped: time budget spent", "time budget spent"
            if why is not None:
                crec["results"][c.name] = {"status": "n/a", "note": why}
                continue
            _say(f"[{i}/{n}] {case.name}: {c.name}")
            rec = _run_contender(c, case, cm, inputs, base, st)
            crec["results"][c.name] = rec
            if rec["status"] == "error":
                data["errors"].append(f"{case.name}/{c.name}: {rec['note']}")
                _say(f"!!! flashrange failed on {case.name} ({c.name}): {rec['note']}")
            for key in ("err_out", "err_grad"):
                e = rec.get(key)
                if e is not None and not e <= tol:
                    msg = f"{case.name}/{c.name}: {key} {e:.2e} > {tol:.0e} against the {base['name']}"
                    data["failures"].append(msg)
                    _say(f"!!! MISMATCH {msg}")
                    if st.fail_fast:
                        stop = "stopped at the first mismatch (--fail-fast)"
        note_low_clocks(crec["results"])
        if not st.check_only and not stop and not budget.spent() and any(
            isinstance(c, Flex) and crec["results"].get(c.name, {}).get("status") == "ok" for c in contenders
        ):
            crec["block_mask"] = time_create_block_mask(case, cm, st.device, warmup=st.warmup, reps=st.reps)
        crec["wall_s"] = time.perf_counter() - t_case
        del inputs, base
        _free(st.device, collect=True)
        if on_case_done is not None:
            on_case_done()
