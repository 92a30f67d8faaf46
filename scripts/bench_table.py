"""The wide table of BENCHMARKS.md from a ``flashrange bench`` result: ms of every contender, ratios to flashrange.

    python scripts/bench_table.py out/bench/bench.json

Columns: flashrange's public call (forward, forward+backward, forward spread p20-p80 in percent of the
median), the public call given a plan built once (``flashrange+plan``: a model's layers share one plan), the
raw op, cuDNN, FlashAttention-4 and FlexAttention (forward / forward+backward ms), the peers' ms over
flashrange's (above 1: flashrange faster), flashrange's peak extra memory of one fwd+bwd, and the lowest and
highest SM clock read after the case's contenders' timings (a wide range: the GPU lowered its clock for some
of them, and their times carry it; BENCHMARKS.md "Method").
"""

from __future__ import annotations

import json
import sys


def _ms(res, direction):
    r = (res or {}).get(direction) or {}
    return r.get("median_ms")


def _fmt(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}"


def table(path):
    data = json.load(open(path))
    head = ("| case | fwd ms | f+b ms | fwd spread % | with a plan fwd / f+b | raw op fwd / f+b | cuDNN fwd / f+b "
            "| FA4 fwd / f+b | Flex fwd / f+b | fwd vs cuDNN | fwd vs FA4 | f+b vs cuDNN | f+b vs FA4 | peak MiB "
            "| SM MHz |")
    lines = [head, "|" + "---|" * 1 + "---:|" * 13 + "---|"]
    for case in data["cases"]:
        res = case["results"]
        fr = res.get("flashrange") or {}
        f, fb = _ms(fr, "fwd"), _ms(fr, "fwdbwd")
        spread = None
        if fr.get("fwd"):
            spread = 100 * (fr["fwd"]["p80_ms"] - fr["fwd"]["p20_ms"]) / fr["fwd"]["median_ms"]

        def pair(name):
            r = res.get(name)
            return f"{_fmt(_ms(r, 'fwd'))} / {_fmt(_ms(r, 'fwdbwd'))}"

        def ratio(name, direction, mine):
            theirs = _ms(res.get(name), direction)
            return "–" if theirs is None or mine is None else f"{theirs / mine:.2f}"

        peak = fr.get("peak_mem_bytes")
        clocks = [r["sm_mhz"] for r in res.values() if r.get("sm_mhz")]
        clock = f"{min(clocks)}-{max(clocks)}" if clocks else "–"
        lines.append(
            f"| {case['name']} | {_fmt(f)} | {_fmt(fb)} | {_fmt(spread, 0)} | {pair('flashrange+plan')} "
            f"| {pair('flashrange-op')} "
            f"| {pair('sdpa-cudnn')} | {pair('fa4')} | {pair('flex')} | {ratio('sdpa-cudnn', 'fwd', f)} "
            f"| {ratio('fa4', 'fwd', f)} | {ratio('sdpa-cudnn', 'fwdbwd', fb)} | {ratio('fa4', 'fwdbwd', fb)} "
            f"| {_fmt(None if peak is None else peak / 2**20, 0)} | {clock} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
