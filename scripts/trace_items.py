"""Where the Hopper forward's time goes, work item by work item: SM clocks read by each consumer warpgroup.

    python scripts/trace_items.py --export     # here: ab/trace, HEAD's kernels with clock reads (carry "ab")
    TRITON_INTERPRET=0 PYTHONPATH=. python scripts/trace_items.py --build   # here, no GPU: build it for sm_90
    PYTHONPATH=. python scripts/trace_items.py --cases causal-8k,doc16-32k [--orders plan,bucketed]
                                               [--configs default,sm90pppmd_m128_n128_w4_s3] [--out DIR]
                                                # on the GPU

The exported copy (``ab/trace/flashrange_trace``, like ``scripts/ab_export.sh``'s) has its Gluon forward
consumers read ``%clock`` before waiting for an item's queries, after that wait, after the item's tile loop
and after its epilogue, and store those with the item's tile count, program and SM into a float32 buffer
(``kernels.forward.TRACE``) passed where the row-maxima pointer goes (it writes no max logits); nothing else
changes, and each case checks that the copy's output is bitwise flashrange's. The edits are made on the source text and fail loudly
when the kernel no longer has the lines they expect: re-export after changing the forward.

Printed per case: the shares of the warpgroups' time in tile loops, epilogues, between items (finding the
next item: its plan entries) and waiting for queries; then the median tile-loop cycles of single-slice items
by tile count, and the median cycles per tile of longer items by round of the persistent order. ``--orders``
also traces the same call with the plan's query blocks in other orders (``block_orders``: the outputs are the
same bits, the memory traffic and balance are not), and ``--configs`` with other persistent Gluon configs (the
dynamic schedule against the fixed share: which program runs which item). ``--out`` also writes every item's
clocks (``trace_<case>_<order>[_<config>].json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COPY = os.path.join(ROOT, "ab", "trace")
KERNELS = os.path.join(COPY, "flashrange_trace", "kernels")

_CLOCKS = '''@gluon.jit
def _clock(x):
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _smid(x):
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


'''

# (file, old text, new text): the copy's edits.
_EDITS = [
    ("forward.py", "lse if rowmax is None else rowmax", "(TRACE if TRACE is not None else lse) if rowmax is None else rowmax"),
    ("forward.py", "\ndef _recorded_args(", "\nTRACE = None  # trace_items.py: the clock buffer\n\n\ndef _recorded_args("),
    ("forward_sm90.py", "@gluon.jit\ndef _consume_tiles(", _CLOCKS + "@gluon.jit\ndef _consume_tiles("),
    ("forward_sm90.py",
     "    if q_held == 1:\n        _release_query(q_free, qh)\n\n    covered = l_i != 0.0",
     "    if q_held == 1:\n        _release_query(q_free, qh)\n    t_loop = _clock(n_blk)\n\n"
     "    covered = l_i != 0.0"),
    ("forward_sm90.py",
     "m_i * DEV_LN2, mask=mask_m)\n    return it, n_blk\n",
     "m_i * DEV_LN2, mask=mask_m)\n    return it, n_blk, t_loop\n"),
    ("forward_sm90.py",
     "    mbarrier.wait(q_ready.index(qh), phase)\n"
     "    it, n_blk = _consume_work(",
     "    t_wait = _clock(wi)\n"
     "    mbarrier.wait(q_ready.index(qh), phase)\n"
     "    t_start = _clock(wi)\n"
     "    it0 = it\n"
     "    it, n_blk, t_loop = _consume_work("),
    ("forward_sm90.py",
     "IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS, IS_ROW_INTERVAL, J)\n    return it, n_blk\n",
     "IS_KV_SPLIT, Q_BUFS, POLY_QUARTERS, IS_ROW_INTERVAL, J)\n"
     "    t_end = _clock(wi)\n"
     "    tr = ptrs[5] + (w.to(gl.int64) * 2 + J) * 8\n"
     "    gl.store(tr + 0, t_wait.to(gl.float32, bitcast=True))\n"
     "    gl.store(tr + 1, t_start.to(gl.float32, bitcast=True))\n"
     "    gl.store(tr + 2, t_loop.to(gl.float32, bitcast=True))\n"
     "    gl.store(tr + 3, t_end.to(gl.float32, bitcast=True))\n"
     "    gl.store(tr + 4, (it - it0).to(gl.float32, bitcast=True))\n"
     "    gl.store(tr + 5, gl.program_id(0).to(gl.float32, bitcast=True))\n"
     "    gl.store(tr + 6, _smid(wi).to(gl.float32, bitcast=True))\n"
     "    return it, n_blk\n"),
]


def traced_sources(kernels_dir):
    """``{file name: text}`` of the kernels in ``kernels_dir`` with the trace's edits made; exits with the edit
    that no longer applies when a kernel changed under it."""
    texts = {}
    for name, old, new in _EDITS:
        if name not in texts:
            with open(os.path.join(kernels_dir, name)) as f:
                texts[name] = f.read()
        if old not in texts[name]:
            sys.exit(f"trace_items.py: kernels/{name} no longer has the text this edit expects:\n{old}")
        texts[name] = texts[name].replace(old, new)
    return texts


def export():
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "ab_export.sh"), "HEAD", "trace"], check=True)
    for name, text in traced_sources(KERNELS).items():
        with open(os.path.join(KERNELS, name), "w") as f:
            f.write(text)
    print(f"traced copy in {COPY}")


def build():
    """Build the traced kernel for sm_90 without a GPU, as ``tests/sm90_builds.py`` does (checks the edits)."""
    import torch

    sys.path[:0] = [COPY, os.path.join(ROOT, "tests")]
    import sm90_builds as sb
    from flashrange_trace.kernels import forward as fwd

    from flashrange import plan_mask

    fwd._has_tma = lambda: True
    fwd._has_gluon_sm90 = lambda *args, **kwargs: True  # as on a Hopper GPU: the default takes the Gluon kernel
    T, Hq, D = 300, 4, 128
    q, k, v = sb._qkv(T, Hq, D, D, torch.bfloat16, False)
    qr, kr, mt = sb._ranges(sb._docs(T, 9))
    plan = plan_mask(qr, kr, mt, T, T)
    config = fwd._default_config.__wrapped__(D, D, torch.bfloat16, "cuda", False, -1)
    fwd.TRACE = torch.empty(T * Hq * 8)
    rec = sb._Recorder()
    fwd.launch = rec
    fwd._launch(q, k, v, torch.empty(T, Hq, D, dtype=torch.bfloat16), torch.empty(T, Hq), None, plan, D ** -0.5,
                0.0, config, fwd.plan_split(config.BLOCK_M), True, False, None)
    for kernel, args, num_warps, num_stages, maxnreg in rec.launches:
        assert args[5] is fwd.TRACE, "the trace buffer did not reach the kernel"
        compiled = sb.build(kernel, args, num_warps, num_stages, maxnreg)
        print(f"built {kernel.__name__} [{config.name}]: shared memory {compiled.metadata.shared} B"
              f"{sb._resources(compiled.asm['cubin'])}")


def _wrap(a, b):
    return (b - a) % (1 << 32)


def block_orders(plan_order, block_lo, window):
    """Orders of the plan's query blocks to trace beside the plan's own (``plan``), each a permutation of it;
    the kernels' outputs do not depend on the order, only their memory traffic and balance (``grouped`` is
    the plan's own order since the plan keeps each window's blocks together; it was traced against the
    plain heavy-first order of earlier plans):

    - ``grouped``: the blocks of one slice window (one document, for document masks) side by side, windows in
      the plan's order of their first block, each window's blocks in the plan's order;
    - ``bucketed``: the plan's order cut into runs of ``window`` blocks (about what runs at once), each run in block
      order, so that neighbouring blocks (which read the same keys) run together and the balance stays."""
    rank = {b: i for i, b in enumerate(plan_order)}
    groups = {}
    for b in plan_order:
        groups.setdefault(block_lo[b], []).append(b)
    grouped = [b for g in sorted(groups.values(), key=lambda g: rank[g[0]]) for b in g]
    bucketed = [b for i in range(0, len(plan_order), window) for b in sorted(plan_order[i:i + window])]
    return {"plan": list(plan_order), "grouped": grouped, "bucketed": bucketed}


def run(cases, orders, out_dir, configs=("default",)):
    import torch

    sys.path.insert(0, COPY)
    from flashrange_trace.kernels import forward as fwd
    from flashrange_trace.kernels.plan import build_plan

    import flashrange
    from flashrange.bench.cases import select
    from flashrange.bench.runner import make_inputs
    from flashrange.constants import PLAN_BLOCK

    for case in select(cases):
        cm = case.build("cuda")
        q, k, v, _ = make_inputs(case, "cuda", torch.bfloat16)
        qr, kr, mt = cm.mask.tensors()
        plan = build_plan(qr, kr, mt, case.T, case.T)
        want = flashrange.range_attention(q, k, v, qr, kr, mt)[0]
        lo, hi = plan.q_block_lo.tolist(), plan.q_block_hi.tolist()
        slices = plan.q_slices.tolist()
        for config_name, order_name in [(c, o) for c in configs for o in orders]:
            if config_name == "default":
                config = fwd.default_config(case.D, case.head_dim_v, q.dtype)
            else:
                config = next((c for c in fwd.FWD_CONFIGS if c.name == config_name), None)
                if config is None:
                    sys.exit(f"trace_items.py: no forward config {config_name!r}")
            if not (config.gluon and config.persistent):
                sys.exit(f"trace_items.py: {case.name} takes {config.name}, not the persistent Gluon forward (a "
                         "Hopper GPU, 2-byte dtype, head dim 64 or 128)")
            block_m = config.BLOCK_M
            split = PLAN_BLOCK // block_m
            n_work = -(-case.T // block_m) * case.Hq
            # Blocks running at once: one work item per SM, the heads of a block side by side.
            window = max(1, torch.cuda.get_device_properties(0).multi_processor_count // (case.Hq * split))
            order = block_orders(plan.q_block_order.tolist(), lo, window)[order_name]
            traced = plan._replace(q_block_order=torch.tensor(order, dtype=plan.q_block_order.dtype,
                                                              device=plan.q_block_order.device))
            fwd.TRACE = torch.zeros(n_work * 16, dtype=torch.float32, device="cuda")
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            for i in range(4):  # warm, then the last call's clocks are read and its time taken
                if i == 3:
                    events[0].record()
                got = fwd.range_attention_forward_triton(q, k, v, qr, kr, mt, case.D ** -0.5, 0.0, plan=traced,
                                                         config=config)[0]
            events[1].record()
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"{case.name}: the traced copy's output differs from flashrange's"
            label = order_name if config_name == "default" else f"{order_name}_{config.name}"
            _report(case, label, order, events[0].elapsed_time(events[1]), fwd.TRACE, n_work, lo, hi, slices,
                    split, block_m, out_dir)


def _report(case, label, order, ms, trace, n_work, lo, hi, slices, split, block_m, out_dir):
    import torch

    rec = trace.view(torch.int32).cpu().view(n_work, 2, 8).tolist()
    items = []
    for w in range(n_work):
        rank = w // case.Hq
        block = order[rank // split]
        r0 = (block * split + rank % split) * block_m
        n_slices = sum(1 for s in slices[lo[block]:hi[block]] if s[4] >= 0 and s[0] < r0 + block_m and s[1] > r0)
        for j in range(2):
            t = [x & 0xFFFFFFFF for x in rec[w][j]]
            items.append(dict(w=w, j=j, wait=t[0], start=t[1], loop=t[2], end=t[3], tiles=rec[w][j][4],
                              pid=rec[w][j][5], sm=rec[w][j][6], slices=n_slices))
    by_wg = {}
    for it in items:
        by_wg.setdefault((it["pid"], it["j"]), []).append(it)
    tot = dict(span=0, qwait=0, loop=0, epi=0, gap=0)
    by_round = {}
    for seq in by_wg.values():
        seq.sort(key=lambda it: it["w"])
        tot["span"] += _wrap(seq[0]["wait"], seq[-1]["end"])
        for i, it in enumerate(seq):
            tot["qwait"] += _wrap(it["wait"], it["start"])
            tot["loop"] += _wrap(it["start"], it["loop"])
            tot["epi"] += _wrap(it["loop"], it["end"])
            if i:
                tot["gap"] += _wrap(seq[i - 1]["end"], it["wait"])
            if it["tiles"] >= 6:
                by_round.setdefault(i, []).append(_wrap(it["start"], it["loop"]) / it["tiles"])
    n_items = len(items)
    share = {key: f"{100 * tot[key] / tot['span']:.1f}%" for key in ("loop", "epi", "gap", "qwait")}
    print(f"{case.name} [{label}] {ms:.3f} ms (traced): {n_items / len(by_wg):.1f} items per "
          f"warpgroup, {sum(it['tiles'] for it in items) / n_items:.2f} tiles per item; tile loops {share['loop']}, "
          f"epilogues {share['epi']}, between items {share['gap']}, query wait {share['qwait']}; epilogue "
          f"{tot['epi'] / n_items:.0f} cycles per item")
    loops = {}
    for it in items:
        if it["slices"] == 1:
            loops.setdefault(it["tiles"], []).append(_wrap(it["start"], it["loop"]))
    print("  single-slice tile loops, median cycles by tiles: "
          + ", ".join(f"{n}: {statistics.median(v):.0f}" for n, v in sorted(loops.items()) if len(v) >= 8))
    print("  items of 6+ tiles, median cycles per tile by round: "
          + ", ".join(f"{r}: {statistics.median(v):.0f}" for r, v in sorted(by_round.items()) if len(v) >= 8))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"trace_{case.name}_{label}.json"), "w") as f:
            json.dump(items, f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", action="store_true", help="write the traced copy under ab/trace (from HEAD)")
    ap.add_argument("--build", action="store_true", help="build the traced copy for sm_90 (no GPU needed)")
    ap.add_argument("--cases", default="causal-8k,full-8k,doc16-32k,doc128-32k,doc1024-32k,swa2048-32k")
    ap.add_argument("--orders", default="plan", help="block orders to trace, from plan (the plan's own), grouped, "
                    "bucketed (see block_orders)")
    ap.add_argument("--configs", default="default", help="persistent Gluon forward configs to trace (names, or "
                    "default)")
    ap.add_argument("--out", default=None, help="also write every item's clocks here")
    args = ap.parse_args(argv)
    if args.export:
        export()
    elif args.build:
        build()
    else:
        if not os.path.isdir(KERNELS):
            sys.exit("trace_items.py: no traced copy; run it with --export first (here) and carry ab")
        run(args.cases, args.orders.split(","), args.out, args.configs.split(","))


if __name__ == "__main__":
    main()
