"""Reports of a benchmark run: the markdown tables, the short table, the PNG plot, the files.

Everything here reads the JSON a run writes (``bench.json``) and nothing
else, so ``flashrange bench --report-only bench.json`` re-renders any saved
run. TFLOP/s are counted on the mask's real area (the case's ``flops``);
ratios are ``peer ms / flashrange ms`` (above 1: flashrange is faster). A
run on the CPU only checks the harness: its report says so and shows no
TFLOP/s.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

__all__ = [
    "ms",
    "tflops",
    "ratios",
    "markdown_report",
    "short_table",
    "plot",
    "write",
    "load",
    "CPU_BANNER",
]

_DIRECTIONS = ("fwd", "bwd", "fwdbwd")
_DIR_LABEL = {"fwd": "fwd", "bwd": "bwd", "fwdbwd": "f+b"}
_PEER_ORDER = ("flashrange+plan", "flashrange-op", "sdpa-cudnn", "sdpa-flash", "sdpa-math", "flex", "flex+mask",
               "fa4", "fa3", "fa2", "magi-ffa")

CPU_BANNER = (
    "No CUDA GPU: this run only checks the harness, at toy sizes (flashrange runs its reference path on the "
    "CPU; --sweep runs the Triton kernels under TRITON_INTERPRET=1). Its times are not benchmarks, and no "
    "TFLOP/s are reported."
)


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def _on_gpu(data) -> bool:
    return data.get("header", {}).get("device_type") == "cuda"


def ms(rec, direction):
    """Median milliseconds of ``direction`` in a result record, or ``None``."""
    t = (rec or {}).get(direction)
    return t.get("median_ms") if isinstance(t, dict) else None


def tflops(case_rec, rec, direction):
    t = ms(rec, direction)
    if t is None or t <= 0:
        return None
    return case_rec["flops"][direction] / (t * 1e-3) / 1e12


def ratios(case_rec) -> dict:
    """``{contender: {direction: its ms / flashrange's ms}}`` for every other contender with numbers."""
    res = case_rec.get("results", {})
    fr = res.get("flashrange", {})
    out = {}
    for name, rec in res.items():
        if name == "flashrange":
            continue
        r = {}
        for d in _DIRECTIONS:
            a, b = ms(rec, d), ms(fr, d)
            r[d] = a / b if (a is not None and b) else None
        out[name] = r
    return out


def _fmt(x, nd=2):
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}f}"


def _count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _fmt_err(x):
    return "" if x is None else f"{x:.1e}"


def _spread(rec):
    """Worst ``(p80 - p20) / median`` over the timed directions, in percent."""
    worst = None
    for d in _DIRECTIONS:
        t = rec.get(d)
        if isinstance(t, dict) and t.get("median_ms"):
            s = 100.0 * (t["p80_ms"] - t["p20_ms"]) / t["median_ms"]
            worst = s if worst is None else max(worst, s)
    return worst


def _note(rec):
    if rec.get("status") == "ok":
        return rec.get("note", "")
    return f"{rec.get('status')}: {rec.get('note', '')}"


def _header_lines(data):
    h = data["header"]
    versions = " | ".join(f"{k} {v}" for k, v in h.get("versions", {}).items() if v)
    lines = [
        f"{h['date']} | {h['device_name']} | dtype {h['dtype']}" + (" | tiny" if h.get("tiny") else "")
        + (" | check only" if h.get("check_only") else ""),
        "",
        versions,
    ]
    if not _on_gpu(data):
        lines += ["", f"**{CPU_BANNER}**"]
    return lines


def _case_section(c, gpu):
    lines = ["", f"### {c['name']}: T={c['T']} Hq={c['Hq']} Hkv={c['Hkv']} D={c['D']}"
             + (f" Dv={c['Dv']}" if c.get("Dv") != c["D"] else "")
             + f", {c['description']}, {c['slices']} slices, density {100 * c['density']:.1f}%", ""]
    if c.get("skipped"):
        return lines + [f"skipped: {c['skipped']}"]
    if c.get("baseline"):
        lines += [f"compared with: {c['baseline']}", ""]
    if gpu:
        lines += ["| contender | fwd ms | fwd TF/s | bwd ms | bwd TF/s | f+b ms | f+b TF/s | spread % | mem GiB "
                  "| err out | err grad | 1st call s | note |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    else:
        lines += ["| contender | fwd ms | bwd ms | f+b ms | err out | err grad | note |",
                  "|---|---:|---:|---:|---:|---:|---|"]
    for name, rec in c["results"].items():
        if rec.get("status") != "ok":
            lines.append(f"| {name} | n/a |" + " |" * (11 if gpu else 4) + f" {_note(rec)} |")
            continue
        if gpu:
            mem = rec.get("peak_mem_bytes")
            lines.append(
                f"| {name} | {_fmt(ms(rec, 'fwd'), 3)} | {_fmt(tflops(c, rec, 'fwd'), 1)} | "
                f"{_fmt(ms(rec, 'bwd'), 3)} | {_fmt(tflops(c, rec, 'bwd'), 1)} | "
                f"{_fmt(ms(rec, 'fwdbwd'), 3)} | {_fmt(tflops(c, rec, 'fwdbwd'), 1)} | {_fmt(_spread(rec), 0)} | "
                f"{_fmt(None if mem is None else mem / 2**30, 2)} | {_fmt_err(rec.get('err_out'))} | "
                f"{_fmt_err(rec.get('err_grad'))} | {_fmt(rec.get('first_call_s'), 1)} | {_note(rec)} |"
            )
        else:
            lines.append(
                f"| {name} | {_fmt(ms(rec, 'fwd'), 3)} | {_fmt(ms(rec, 'bwd'), 3)} | {_fmt(ms(rec, 'fwdbwd'), 3)} | "
                f"{_fmt_err(rec.get('err_out'))} | {_fmt_err(rec.get('err_grad'))} | {_note(rec)} |"
            )
    rat = {p: r for p, r in ratios(c).items() if any(v is not None for v in r.values())}
    if rat:
        lines += ["", "ms / flashrange ms (fwd / bwd / f+b; above 1: flashrange faster): " + "; ".join(
            f"{p} " + " / ".join(_fmt(r[d]) for d in _DIRECTIONS) for p, r in rat.items())]
    bm = c.get("block_mask")
    if bm and (bm.get("eager") or bm.get("compiled")):
        first = bm.get("compiled_first_call_s")
        lines.append(
            f"create_block_mask alone: eager {_fmt(ms(bm, 'eager'), 3)} ms, compiled {_fmt(ms(bm, 'compiled'), 3)} ms"
            + (f" (first compiled call {first:.1f} s)" if first else "") + (f"; {bm['note']}" if bm.get("note") else "")
        )
    return lines


def _host_section(rows):
    lines = ["", "## Host overhead per forward call", "",
             "GPU ms: CUDA events, median; host µs: CPU time per call of back-to-back calls (no sync).", "",
             "| case | call | GPU ms | host µs/call | note |", "|---|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['variant']} | {_fmt(ms(r, 'gpu'), 3)} | {_fmt(r.get('host_us'), 1)} | "
                     f"{r.get('note', '')} |")
    return lines


def _plan_section(rows):
    lines = ["", "## Plan cost (flashrange.plan_mask)", "",
             "| mask | T | slots | non-empty | GPU µs (p20–p80) | host µs/call | CUDA graph µs | note |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g = r.get("gpu")
        gpu = "n/a" if not g else f"{1e3 * g['median_ms']:.1f} ({1e3 * g['p20_ms']:.1f}–{1e3 * g['p80_ms']:.1f})"
        graph = ms(r, "graph")
        lines.append(f"| {r['mask']} | {r['T']} | {r.get('slices') or ''} | {r.get('nonempty') or ''} | {gpu} | "
                     f"{_fmt(r.get('host_us'), 1)} | {_fmt(None if graph is None else 1e3 * graph, 1)} | "
                     f"{r.get('note', '')} |")
    return lines


def _e2e_section(e2e):
    lines = ["", "## transformers training step (fwd + loss + bwd, no optimizer)", ""]
    if e2e.get("error"):
        return lines + [f"not run: {e2e['error']}"]
    m = e2e.get("model", {})
    lines += [
        f"Llama from config: {m.get('layers')} layers, hidden {m.get('hidden')}, {m.get('heads')} query / "
        f"{m.get('kv_heads')} key-value heads, {_count(m.get('params', 0))} parameters, eager, "
        f"use_cache=False, transformers {e2e.get('transformers')}; one packed row, position_ids restarting per "
        "document. 'sees documents': the loss is closer to flashrange's on the packed row than to flashrange's "
        "on the same tokens read as one document.",
        "",
        "| tokens | docs | attn_implementation | ms/step | loss | loss - flashrange's | sees documents | peak GiB "
        "| note |",
        "|---:|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for r in e2e.get("rows", []):
        diff = None if r.get("loss") is None or r.get("loss_flashrange") is None else r["loss"] - r["loss_flashrange"]
        seen = r.get("sees_documents")
        mem = r.get("peak_mem_bytes")
        lines.append(
            f"| {r['tokens']} | {r['docs']} | {r['impl']} | {_fmt(ms(r, 'step'), 1)} | {_fmt(r.get('loss'), 4)} | "
            f"{'' if diff is None else f'{diff:+.1e}'} | {'' if seen is None else ('yes' if seen else 'NO')} | "
            f"{_fmt(None if mem is None else mem / 2**30, 1)} | {r.get('note', '')} |"
        )
    controls = sorted({(r["tokens"], r.get("loss_one_document")) for r in e2e.get("rows", [])
                       if r.get("loss_one_document") is not None})
    for T, loss in controls:
        lines.append(f"\ncontrol, {T} tokens read as one document (flashrange): loss {loss:.4f}")
    return lines


def _sweep_section(sweep, gpu):
    lines = ["", f"## Launch-config sweep ({sweep.get('dtype')})"]
    for c in sweep.get("cases", []):
        lines += ["", f"### {c['case']}" + (f": skipped ({c['skipped']})" if c.get("skipped") else
                                            f": T={c['T']} Hq={c['Hq']} D={c['D']}")]
        if c.get("skipped"):
            continue
        for direction in ("fwd", "bwd"):
            default = c.get(f"{direction}_default")
            lines += ["", f"| {direction} config | ms | " + ("TF/s | " if gpu else "") + "err | note |",
                      "|---|---:|" + ("---:|" if gpu else "") + "---:|---|"]
            flops = c["flops"]["fwd" if direction == "fwd" else "bwd"]
            for r in sorted(c[direction], key=lambda r: ms(r, "time") or float("inf")):
                t = ms(r, "time")
                tf = None if not t else flops / (t * 1e-3) / 1e12
                mark = " (default)" if r["config"] == default else ""
                lines.append(f"| {r['config']}{mark} | {_fmt(t, 3)} | " + (f"{_fmt(tf, 0)} | " if gpu else "")
                             + f"{_fmt_err(r.get('err'))} | {r.get('note', '')} |")
    best = sweep.get("best", [])
    if best:
        lines += ["", "Best per head dim (geometric mean of ms / fastest ms per case; 1.00 = fastest everywhere):", ""]
        for b in best:
            lines.append(f"- D={b['D']} Dv={b['Dv']} {b['direction']}: {b['best']} ({b['score']:.3f}); default "
                         f"{b['default']} ({_fmt(b.get('default_score'), 3)}) over {b['cases']} cases")
    return lines


def markdown_report(data) -> str:
    """The full markdown: header, plan cost, host overhead, one table per case, e2e, sweep, short table last."""
    gpu = _on_gpu(data)
    lines = ["# flashrange bench", ""] + _header_lines(data)
    if data.get("cases"):
        clock = "CUDA events, L2 flushed before each" if gpu else "perf_counter"
        lines += ["", f"ms: median of the timed repetitions ({clock}); spread: worst "
                  "(p80 - p20) / median; " + ("TF/s on the mask's real area (fwd 2·area·Hq·(D+Dv), bwd 2.5x, "
                                               "f+b 3.5x); mem: peak extra GiB of one fwd+bwd; " if gpu else "")
                  + "err: relative L2 difference to the case's baseline (out / worst gradient); 1st call: wall time "
                  "of the untimed first call (compilation)."]
    if data.get("plan_cost"):
        lines += _plan_section(data["plan_cost"])
    if data.get("host"):
        lines += _host_section(data["host"])
    if data.get("cases"):
        lines += ["", "## Attention"]
        for c in data["cases"]:
            lines += _case_section(c, gpu)
    if data.get("e2e"):
        lines += _e2e_section(data["e2e"])
    if data.get("sweep"):
        lines += _sweep_section(data["sweep"], gpu)
    lines += ["", short_table(data)]
    return "\n".join(lines)


def _peers(data):
    seen = []
    for c in data.get("cases", []):
        for name in c.get("results", {}):
            if name != "flashrange" and name not in seen:
                seen.append(name)
    known = [p for p in _PEER_ORDER if p in seen]
    return known + [p for p in seen if p not in known]


def short_table(data) -> str:
    """A compact table: flashrange per case (TF/s on a GPU, ms on the CPU) and its ratio to every other contender."""
    gpu = _on_gpu(data)
    h = data["header"]
    lines = []
    if data.get("cases"):
        peers = _peers(data)
        unit = "TF/s" if gpu else "ms"
        lines += [
            f"flashrange bench: {h['device_name']}, {h['dtype']}, torch {h.get('versions', {}).get('torch')} "
            f"(flashrange {unit} fwd / f+b; other columns: their ms / flashrange ms, fwd / f+b, >1 = flashrange "
            "faster)",
            "",
            f"| case | flashrange {unit} | " + " | ".join(peers) + " |",
            "|---|---:|" + "---:|" * len(peers),
        ]
        for c in data["cases"]:
            if c.get("skipped"):
                lines.append(f"| {c['name']} | skipped |" + " |" * len(peers))
                continue
            fr = c["results"].get("flashrange", {})
            if fr.get("status") != "ok":
                cell = "ERROR" if fr.get("status") == "error" else "n/a"
            elif h.get("check_only"):
                cell = "checked"
            elif gpu:
                cell = f"{_fmt(tflops(c, fr, 'fwd'), 0)} / {_fmt(tflops(c, fr, 'fwdbwd'), 0)}"
            else:
                cell = f"{_fmt(ms(fr, 'fwd'), 2)} / {_fmt(ms(fr, 'fwdbwd'), 2)}"
            rat = ratios(c)
            cells = []
            for p in peers:
                r = rat.get(p)
                rec = c["results"].get(p, {})
                if r is None or (r["fwd"] is None and r["fwdbwd"] is None):
                    cells.append("ok" if h.get("check_only") and rec.get("status") == "ok" else "n/a")
                else:
                    cells.append(f"{_fmt(r['fwd'])} / {_fmt(r['fwdbwd'])}")
            lines.append(f"| {c['name']} | {cell} | " + " | ".join(cells) + " |")
    if not gpu:
        lines += ["", CPU_BANNER]
    n_checked = sum(1 for c in data.get("cases", []) for r in c.get("results", {}).values()
                    if r.get("err_out") is not None)
    bad = data.get("failures", [])
    errors = data.get("errors", [])
    if data.get("cases"):
        lines.append(
            f"correctness: {n_checked} results compared with each case's baseline: "
            + ("all within tolerance" if not bad else f"FAILED ({len(bad)}): " + "; ".join(bad)[:400])
        )
    if errors:
        lines.append(f"errors ({len(errors)}): " + "; ".join(errors)[:400])
    return "\n".join(lines)


def plot(data, path) -> None:
    """Bars per case and contender: TF/s (forward, fwd+bwd) on a GPU, milliseconds on the CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = _on_gpu(data)
    cases = [c for c in data.get("cases", []) if not c.get("skipped")]
    names = []
    for c in cases:
        for n, rec in c["results"].items():
            if rec.get("status") == "ok" and n not in names:
                names.append(n)
    cols = [d for d in ("fwd", "fwdbwd") if any(ms(r, d) for c in cases for r in c["results"].values())] or ["fwd"]
    fig, axes = plt.subplots(len(cols), 1, figsize=(max(8, 1.3 * len(cases) + 3), 4 * len(cols)), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, col in zip(axes[:, 0], cols):
        for j, n in enumerate(names):
            ys = []
            for c in cases:
                rec = c["results"].get(n, {})
                y = (tflops(c, rec, col) if gpu else ms(rec, col)) if rec.get("status") == "ok" else None
                ys.append(y or 0.0)
            ax.bar([i + j * width for i in range(len(cases))], ys, width, label=n)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([c["name"] for c in cases], rotation=30, ha="right", fontsize=8)
        what = "forward" if col == "fwd" else "fwd+bwd"
        ax.set_ylabel(f"{what} TFLOP/s" if gpu else f"{what} ms")
        ax.grid(axis="y", alpha=0.3)
        if names:
            ax.legend(fontsize=7, ncol=min(4, len(names)))
    h = data["header"]
    title = f"flashrange bench — {h['device_name']}, {h['dtype']}"
    if not gpu:
        title += " — CPU harness check, not a benchmark"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(data, out_dir, *, with_plot=True) -> None:
    """``bench.json``, ``bench.md`` and (with matplotlib, when there are cases) ``bench.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(data, indent=1, default=str))
    (out_dir / "bench.md").write_text(markdown_report(data) + "\n")
    if with_plot and data.get("cases") and not data["header"].get("check_only"):
        try:
            plot(data, out_dir / "bench.png")
        except Exception as e:  # noqa: BLE001 (no matplotlib: the tables and JSON are still written)
            print(f"flashrange bench: no plot ({type(e).__name__}: {e})", file=sys.stderr)
