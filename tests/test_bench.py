"""CPU checks of ``flashrange bench`` (docs/design.md §11) and of the ``flashrange`` command line.

The harness runs without a GPU at toy sizes (``--tiny``): flashrange's
reference path and SDPA's math backend run and are compared with the
float32 reference; CUDA-only peers read ``n/a``. Every registry case is
checked against its definition: the area at full size (closed forms written
here, not the library's), and at toy size every cell of the mask and of
each peer's form of it (Flex ``mask_mod``, SDPA ``is_causal``,
FlashAttention ``cu_seqlens`` / ``window_size``).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashrange import bench
from flashrange.bench import cases as bench_cases
from flashrange.bench import report, timing
from flashrange.bench.contenders import FlashRangePublic
from flashrange.bench.runner import TOLERANCE, case_flops, note_low_clocks
from golden import dense_counts

ROOT = Path(__file__).resolve().parents[1]

# Cases of the in-process run: SDPA's causal form, GQA, documents (FlashAttention's
# varlen form), a mask only ranges and Flex express. Every other case's mask is
# checked cell by cell below.
SMOKE_CASES = "causal-8k,full-16k-gqa32:8,doc16-32k,blockcausal-32k"


def _run(args, env_extra=None, shell=False):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, shell=shell,
                          executable="/bin/bash" if shell else None)


# ---------------------------------------------------------------------------
# The registry against its definition


def _expected_area(case):
    """Covered cells from the case's parameters, in closed form."""
    T = case.T
    tri = lambda n: n * (n + 1) // 2  # noqa: E731
    if case.kind == "full":
        return T * T
    if case.kind == "causal":
        return tri(T)
    if case.kind in ("document", "longshort"):
        return sum(tri(L) for L in case.doc_lengths())
    if case.kind == "window":
        W = case.window
        return tri(T) if T <= W else tri(W) + (T - W) * W
    if case.kind == "shared_question":
        Q = case.question
        return tri(Q) + sum(Q * L + tri(L) for L in case.answer_lengths())
    if case.kind == "block_causal":
        B = case.block
        return sum((min(s + B, T) - s) * min(s + B, T) for s in range(0, T, B))
    raise AssertionError(case.kind)


def _dense_definition(case):
    """Bool ``(T, T)``: which keys each query sees, written from the case's parameters."""
    T = case.T
    i = torch.arange(T).unsqueeze(1)
    j = torch.arange(T).unsqueeze(0)
    causal = j <= i
    if case.kind == "full":
        return torch.ones(T, T, dtype=torch.bool)
    if case.kind == "causal":
        return causal
    if case.kind in ("document", "longshort"):
        doc = torch.repeat_interleave(torch.arange(case.n_docs), torch.tensor(case.doc_lengths()))
        return causal & (doc.unsqueeze(1) == doc.unsqueeze(0))
    if case.kind == "window":
        return causal & (i - j < case.window)
    if case.kind == "shared_question":
        part = torch.repeat_interleave(torch.arange(case.n_answers + 1),
                                       torch.tensor([case.question] + case.answer_lengths()))
        return causal & ((part[j] == 0) | (part[j] == part[i]))
    if case.kind == "block_causal":
        return j // case.block <= i // case.block
    raise AssertionError(case.kind)


@pytest.mark.parametrize("case", bench_cases.CASES, ids=lambda c: c.name)
def test_case_area_matches_definition(case):
    if case.kind in ("document", "longshort"):
        lengths = case.doc_lengths()
        assert len(lengths) == case.n_docs and sum(lengths) == case.T and min(lengths) >= 1
        if case.kind == "longshort":
            assert lengths.count(case.long_doc) >= 1 and max(lengths) == case.long_doc
    cm = case.build("cpu")
    assert cm.area == cm.mask.area() == _expected_area(case)
    # Two matmuls over the covered cells: q k^T (D wide) and p v (Dv wide).
    assert case_flops(case, cm.area)["fwd"] == 2 * cm.area * case.Hq * (case.D + case.head_dim_v)


@pytest.mark.parametrize("case", [c.tiny() for c in bench_cases.CASES], ids=lambda c: c.name)
def test_tiny_mask_and_peer_forms_match_definition(case):
    cm = case.build("cpu")
    counts = cm.mask.coverage(case.T, case.T)
    assert int(counts.max()) <= 1, "benchmark masks must not overlap"
    want = _dense_definition(case)
    assert torch.equal(counts > 0, want)
    assert cm.area == int(want.sum()) == _expected_area(case)
    i = torch.arange(case.T).unsqueeze(1)
    j = torch.arange(case.T).unsqueeze(0)
    if cm.mask_mod is None:
        assert bool(want.all())
    else:
        b = h = torch.zeros((), dtype=torch.long)
        assert torch.equal(cm.mask_mod(b, h, i, j).expand(case.T, case.T), want)
    if cm.sdpa_causal is not None:
        assert torch.equal((j <= i) if cm.sdpa_causal else torch.ones_like(want), want)
    if cm.cu_seqlens is not None:
        cu = cm.cu_seqlens.tolist()
        doc = torch.bucketize(torch.arange(case.T), torch.tensor(cu[1:]), right=True)
        assert torch.equal((doc.unsqueeze(1) == doc.unsqueeze(0)) & (j <= i), want)
        assert cm.max_seqlen == max(b - a for a, b in zip(cu, cu[1:]))
    if cm.window:
        left = cm.window - 1  # FlashAttention's window_size=(left, 0) with causal=True
        assert torch.equal((j <= i) & (j >= i - left), want)


def test_registry_covers_the_brief():
    names = [c.name for c in bench_cases.CASES]
    assert len(names) == len(set(names))
    for want in ("full-8k", "causal-8k", "full-32k", "causal-32k", "full-8k-d64", "causal-8k-d64",
                 "full-16k-gqa32:8", "swa2048-32k", "sharedq-32k", "blockcausal-32k", "longshort-32k",
                 "causal-1k", "causal-2k", "causal-4k", "causal-128k"):
        assert want in names
    for n in (16, 128, 1024, 4096):
        assert f"doc{n}-32k" in names and bench_cases.by_name(f"doc{n}-128k").Hq == 8
    assert bench_cases.by_name("swa2048-32k").build("cpu").mask.area() == _expected_area(
        bench_cases.by_name("swa2048-32k"))
    assert {c.name for c in bench_cases.select("@small")} == {"causal-1k", "causal-2k", "causal-4k"}
    assert all("sweep" in c.tags for c in bench_cases.select(None, "sweep"))
    for c in bench_cases.CASES:
        t = c.tiny()
        assert t.Hq % t.Hkv == 0 and t.Hq // t.Hkv == c.Hq // c.Hkv and t.T % 2 == 1


# ---------------------------------------------------------------------------
# Timing


def test_timing_returns_median_and_spread():
    calls = []
    t = timing.measure(lambda: calls.append(1), device="cpu", warmup=2, reps=9)
    assert len(calls) == 11 and t.reps == 9 and t.clock == "perf_counter"
    assert 0 <= t.min_ms <= t.p20_ms <= t.median_ms <= t.p80_ms <= t.max_ms
    assert set(t.as_dict()) == {"median_ms", "p20_ms", "p80_ms", "min_ms", "max_ms", "reps", "clock"}
    assert timing.host_us_per_call(lambda: None, device="cpu", n=10) >= 0
    with pytest.raises(ValueError):
        timing.measure(lambda: None, device="cpu", reps=0)


def test_sm_clock_is_none_off_cuda():
    assert timing.sm_clock_mhz("cpu") is None


def test_low_clock_notes_flag_only_the_throttled_contender():
    """A record whose clock reading after its timings is below 90% of the case's highest gets a note that names
    both readings; others, records without a reading and their earlier notes stay as they were."""
    results = {
        "flashrange": {"status": "ok", "note": "", "sm_mhz": 1710},
        "flashrange+plan": {"status": "ok", "note": "earlier", "sm_mhz": 1245},
        "flashrange-op": {"status": "ok", "note": "", "sm_mhz": 1560},
        "fa4": {"status": "n/a", "note": "not installed"},
        "cpu-run": {"status": "ok", "note": "", "sm_mhz": None},
    }
    note_low_clocks(results)
    assert results["flashrange+plan"]["note"].startswith("earlier SM clock 1245 MHz after timing (1710 ")
    assert "throttled" in results["flashrange+plan"]["note"]
    assert results["flashrange"]["note"] == "" and results["flashrange-op"]["note"] == ""
    assert results["fa4"]["note"] == "not installed" and results["cpu-run"]["note"] == ""
    untouched = {"flashrange": {"status": "ok", "note": "x"}}
    note_low_clocks(untouched)
    assert untouched["flashrange"]["note"] == "x"


# ---------------------------------------------------------------------------
# The command, end to end on the CPU


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--tiny", "--warmup", "0", "--reps", "1", "--cases", SMOKE_CASES, "--host", "--plan-cost", "--e2e",
            "--contenders", "flashrange+plan,flashrange-op,sdpa-math", "--out", str(out)]
    rc = bench.main(argv)
    return rc, out, json.loads((out / "bench.json").read_text())


def test_cpu_smoke_run(smoke, capsys):
    rc, out, data = smoke
    assert rc == 0, data["errors"] + data["failures"]
    assert data["header"]["device_type"] == "cpu" and data["header"]["versions"]["torch"] == torch.__version__
    assert [c["name"] for c in data["cases"]] == SMOKE_CASES.split(",")
    tol = TOLERANCE[torch.bfloat16]
    for c in data["cases"]:
        assert c["baseline"].startswith("reference")
        res = c["results"]
        for name in ("flashrange", "flashrange+plan", "flashrange-op"):
            rec = res[name]
            assert rec["status"] == "ok" and rec["err_out"] <= tol and rec["err_grad"] <= tol
            assert all(rec[d]["median_ms"] > 0 for d in ("fwd", "bwd", "fwdbwd"))
        sd = res["sdpa-math"]
        if c["kind"] in ("full", "causal"):
            assert sd["status"] == "ok" and sd["err_out"] <= tol and sd["err_grad"] <= tol
        else:
            assert sd == {"status": "n/a", "note": "needs a dense attn_mask"}
    assert {r["variant"] for r in data["host"]} >= {"eager public call", "public call, plan=", "raw op"}
    assert all(r["host_us"] > 0 for r in data["host"] if r["note"] == "")
    assert [r["slices"] for r in data["plan_cost"]] == [1, 64, 1024, 1024, 2048]
    assert data["plan_cost"][-1]["nonempty"] == 1 and all(r["gpu"] for r in data["plan_cost"])
    e2e = data["e2e"]
    assert e2e["error"] is None
    rows = {r["impl"]: r for r in e2e["rows"]}
    assert rows["flashrange"]["sees_documents"] and rows["sdpa"]["sees_documents"]
    assert abs(rows["sdpa"]["loss"] - rows["flashrange"]["loss"]) < 0.05
    md = (out / "bench.md").read_text()
    assert report.CPU_BANNER in md and "TF/s" not in md
    assert (out / "bench.png").stat().st_size > 0
    assert md.rstrip().endswith("all within tolerance")


def test_report_only_rerenders_saved_json(smoke, capsys, tmp_path):
    _, out, data = smoke
    assert bench.main(["--report-only", str(out / "bench.json"), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# flashrange bench") and "## Plan cost" in printed and "## Host overhead" in printed
    assert (tmp_path / "bench.md").read_text() == (out / "bench.md").read_text()
    assert bench.main(["--report-only", str(out / "bench.json"), "--short"]) == 0
    short = capsys.readouterr().out
    assert short.startswith("flashrange bench: CPU") and "| doc16-32k |" in short and "TF/s" not in short


def test_unknown_case_is_reported():
    with pytest.raises(SystemExit, match="no case matches 'nope'.*causal-8k"):
        bench.main(["--tiny", "--cases", "nope"])


def test_full_size_on_cpu_is_refused():
    with pytest.raises(SystemExit, match="need a CUDA GPU.*--tiny"):
        bench.main(["--device", "cpu", "--cases", "full-8k"])


def test_mismatch_fails_loudly(tmp_path, capsys, monkeypatch):
    """A flashrange output that disagrees with the baseline makes the command fail."""
    make = FlashRangePublic.make

    def wrong(self, case, cm):
        fn = make(self, case, cm)
        return lambda q, k, v: fn(q, k, v) * 1.25

    monkeypatch.setattr(FlashRangePublic, "make", wrong)
    rc = bench.main(["--tiny", "--warmup", "0", "--reps", "1", "--cases", "causal-8k", "--contenders",
                     "flashrange", "--no-backward", "--check", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 1
    assert data["failures"] and data["failures"][0].startswith("causal-8k/flashrange: err_out")
    assert "MISMATCH" in captured.err and "FAILED (1)" in captured.out


def test_time_budget_skips_but_reports(tmp_path, capsys):
    rc = bench.main(["--tiny", "--cases", "full-8k,causal-8k", "--time-budget", "1e-9", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0
    assert all(c.get("skipped") == "time budget spent" for c in data["cases"])
    assert "| causal-8k | skipped |" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# The command line


def test_version_and_help():
    from flashrange import __version__

    r = _run([sys.executable, "-m", "flashrange", "--version"])
    assert r.returncode == 0 and r.stdout.strip() == f"flashrange {__version__}"
    r = _run([sys.executable, "-m", "flashrange", "--help"])
    assert r.returncode == 0 and "demo" in r.stdout and "bench" in r.stdout and not r.stderr


def test_closed_pipe_ends_quietly(smoke):
    _, out, _ = smoke
    py = f"'{sys.executable}' -m flashrange"
    r = _run(f"{py} --help | head -1", shell=True)
    assert r.stdout.startswith("usage: flashrange") and "Traceback" not in r.stderr, r.stderr
    # A reader that is gone before the first write: bench's own printing meets the closed pipe.
    r = _run(f"set -o pipefail; {py} bench --report-only '{out / 'bench.json'}' | (exec 0<&-; true)",
             shell=True)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert r.returncode in (0, 141)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the sweep runs the Triton kernels")
def test_sweep_smoke(tmp_path, capsys):
    rc = bench.main(["--sweep", "--tiny", "--cases", "full-8k", "--warmup", "0", "--reps", "1",
                     "--out", str(tmp_path)])
    sweep = json.loads((tmp_path / "bench.json").read_text())["sweep"]
    assert rc == 0
    (case,) = sweep["cases"]
    assert case["fwd"] and case["bwd"] and all(r["time"] and r["err"] <= 2e-2 for r in case["fwd"] + case["bwd"])
    assert {b["direction"] for b in sweep["best"]} == {"fwd", "bwd"}
    assert "Best per head dim" in capsys.readouterr().out


def test_host_sync_report_ignores_the_prototype_notice(monkeypatch):
    """Only PyTorch's per-sync warning counts as a host sync, not the notice that the mode is a prototype."""
    import warnings

    from flashrange.bench import runner

    def set_mode(mode):
        if mode:
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations")

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    assert runner._host_syncs(lambda: None) == []

    def syncing():
        warnings.warn("called a synchronizing CUDA operation")

    assert runner._host_syncs(syncing) == ["called a synchronizing CUDA operation"]


def _script(name):
    """The module of ``scripts/<name>.py``."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def _ab_main():
    return _script("ab")


def test_gpu_shards_put_long_tests_alone_and_keep_files_together(tmp_path, monkeypatch):
    """``scripts/gpu_shards.py`` (the GPU suite's processes): every collected test in exactly one shard, each
    fuzz alone and first, the others in runs of at most ``size`` consecutive tests of one file."""
    shards_mod = _script("gpu_shards")
    collected = ["tests/a.py::test_one[x]", "tests/a.py::test_one[y]", "tests/a.py::test_fuzz[z]",
                 "tests/a.py::test_two", "tests/a.py::test_three", "tests/b.py::test_one", "tests/b.py::test_two"]
    out = "\n".join(collected + ["", "7/9 tests collected (2 deselected) in 1s"])
    ids = shards_mod.node_ids(out.splitlines())
    assert ids == collected
    parts = shards_mod.shards(ids, 2)
    assert parts == [["tests/a.py::test_fuzz[z]"], ["tests/a.py::test_one[x]", "tests/a.py::test_one[y]"],
                     ["tests/a.py::test_two", "tests/a.py::test_three"],
                     ["tests/b.py::test_one", "tests/b.py::test_two"]]
    assert sorted(x for p in shards_mod.shards(ids, 3) for x in p) == sorted(collected)
    with pytest.raises(ValueError, match="size must be"):
        shards_mod.shards(ids, 0)
    monkeypatch.setattr(sys, "stdin", io.StringIO(out))
    shards_mod.main(["--out", str(tmp_path), "--size", "2"])
    files = sorted(tmp_path.iterdir())
    assert [f.read_text().split() for f in files] == parts


def test_bench_table_rows_and_ratios(tmp_path):
    """``scripts/bench_table.py``: one row a case, the public call given a plan beside the raw op, ratios of the
    peers' times over flashrange's, the range of the contenders' SM clock readings, and a dash where a
    contender did not run or no clock was read."""
    def res(fwd, fwdbwd):
        return {"fwd": {"median_ms": fwd, "p20_ms": fwd * 0.9, "p80_ms": fwd * 1.1}, "fwdbwd": {"median_ms": fwdbwd}}

    data = {"cases": [
        {"name": "causal-8k", "results": {
            "flashrange": dict(res(0.5, 2.0), peak_mem_bytes=3 * 2**20, sm_mhz=1710),
            "flashrange+plan": dict(res(0.45, 1.9), sm_mhz=1245), "flashrange-op": res(0.44, 1.8),
            "sdpa-cudnn": dict(res(0.5, 2.2), sm_mhz=1500), "fa4": res(0.4, 1.6)}},
        {"name": "doc16-32k", "results": {"flashrange": res(0.7, 2.7)}},
    ]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    lines = _script("bench_table").table(str(path)).splitlines()
    assert len(lines) == 4 and len({line.count("|") for line in lines}) == 1
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == ["causal-8k", "0.500", "2.000", "20", "0.450 / 1.900", "0.440 / 1.800", "0.500 / 2.200",
                     "0.400 / 1.600", "– / –", "1.00", "0.80", "1.10", "0.80", "3", "1245-1710"]
    assert [c.strip() for c in lines[3].strip("|").split("|")][-1] == "–"


def test_ab_backward_config_reads_every_flag():
    """``scripts/ab.py``'s backward config strings: the eight numbers and each flag, ``adaptive`` passed only when
    given (an exported earlier flashrange's config may not have it)."""
    from flashrange.kernels.backward import BwdConfig

    ab = _ab_main()
    cfg = ab.backward_config("64,128,8,3,128,64,8,3,dkdv+dq+persistent+dynamic+adaptive+chunks2", BwdConfig)
    assert cfg == BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, gluon_dkdv=True, gluon_dq=True, persistent=True,
                            dynamic=True, adaptive=True, kv_head_chunks=2)
    seen = []
    ab.backward_config("64,128,8,3,128,64,8,3,dkdv+persistent+dynamic", lambda *a, **k: seen.append(k))
    assert "adaptive" not in seen[0] and seen[0]["dynamic"] and not seen[0]["gluon_dq"]


def test_ab_fuzz_passes_equal_variants_and_flags_a_wrong_one(capsys, monkeypatch):
    """``scripts/ab.py`` (the GPU A/B harness) on the CPU: two forward configs of the same kernels pass its
    float64 fuzz, and a variant whose output is off by 1% fails it."""
    ab = _ab_main()
    args = ["--device", "cpu", "--fuzz", "2", "--fuzz-d", "16", "--fwd", "main:cpu_m64_n64", "--fwd", "main:cpu_m32_n16"]
    assert ab.main(args) == 0
    assert "0 failures" in capsys.readouterr().out

    real = ab.Variant.prepare

    def off_by_one_percent(self, *a, **k):
        call, res = real(self, *a, **k)
        return call, (res[0] * 1.01, res[1]) if self.config == "cpu_m32_n16" else res

    monkeypatch.setattr(ab.Variant, "prepare", off_by_one_percent)
    assert ab.main(args) == 1
    assert "!!! fuzz" in capsys.readouterr().out


def test_trace_items_edits_apply_to_the_forward():
    """``scripts/trace_items.py`` edits the Hopper forward's source for its clock trace: every edit still finds
    its text in today's kernels (a changed kernel fails here, not on the GPU), and the results parse."""
    import ast

    trace_items = _script("trace_items")
    texts = trace_items.traced_sources(str(ROOT / "flashrange" / "kernels"))
    assert set(texts) == {"forward.py", "forward_sm90.py"}
    for text in texts.values():
        ast.parse(text)
    assert texts["forward_sm90.py"].count("_clock(") == 5 and "TRACE = None" in texts["forward.py"]


def test_schedule_model_reach_matches_the_dense_mask():
    """``scripts/schedule_model.py`` counts an item's key tiles from the keys its rows reach in each slice:
    the first and last covered key of the block's rows in the dense mask of that slice alone."""
    schedule_model = _script("schedule_model")
    rng = random.Random(7)
    T = 97
    for _ in range(300):
        qs, ks = rng.randrange(T), rng.randrange(T)
        row = (qs, rng.randrange(qs, T + 1), ks, rng.randrange(ks, T + 1), rng.randrange(4))
        r0 = rng.randrange(T)
        r1 = rng.randrange(r0 + 1, T + 1)
        cols = dense_counts([row[:2]], [row[2:4]], [row[4]], T, T)[r0:r1].sum(0).nonzero().flatten().tolist()
        lo, hi = schedule_model.reach(r0, r1, row)
        if cols:
            assert (lo, hi) == (cols[0], cols[-1] + 1), (row, r0, r1)
        else:
            assert hi <= lo, (row, r0, r1)


def test_trace_items_block_orders_are_permutations():
    """The block orders ``scripts/trace_items.py`` traces beside the plan's: permutations of it that keep a
    window's blocks together (grouped) or sort runs of the plan's order by block (bucketed)."""
    trace_items = _script("trace_items")
    plan_order = [7, 3, 6, 2, 5, 1, 4, 0]  # heavy-first across two windows, as plans before grouping
    block_lo = [0, 0, 0, 0, 4, 4, 4, 4]  # blocks 0-3 in one window, 4-7 in another
    orders = trace_items.block_orders(plan_order, block_lo, window=3)
    assert orders["plan"] == plan_order
    assert orders["grouped"] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert orders["bucketed"] == [3, 6, 7, 1, 2, 5, 0, 4]
    for order in orders.values():
        assert sorted(order) == sorted(plan_order)


def test_pick_default_takes_the_fastest_bitwise_variant_and_edits_a_copy(tmp_path):
    """``scripts/pick_default.py`` (between the two calls of a device pair): the variant with the lowest mean time
    over the default's wins, only if it was bitwise everywhere, lost no case by more than the limit and gained
    enough; ``apply`` rewrites exactly the head-dim-128 entry of ``_SM90_DEFAULTS`` in the file it is given."""
    pick_default = _script("pick_default")

    def rows(variant, times, check="bitwise"):
        return [{"dir": "fwd", "case": c, "variant": variant, "median_ms": t, "check": check}
                for c, t in zip(("a", "b", "c"), times)]

    base = rows("main:default", [1.0, 2.0, 4.0])
    fast = rows("main:fast", [0.9, 1.8, 3.6])
    faster_not_bitwise = rows("main:wrong", [0.5, 1.0, 2.0], check="rel 1.0e-03")
    faster_one_case_lost = rows("main:uneven", [0.5, 1.0, 4.4])
    slight = rows("main:slight", [0.995, 1.99, 3.98])
    means = pick_default.ratios(base + fast + faster_not_bitwise + faster_one_case_lost + slight)
    assert abs(means["main:fast"][0] - 0.9) < 1e-9 and means["main:fast"][2]
    assert not means["main:wrong"][2] and abs(means["main:uneven"][1] - 1.1) < 1e-9
    assert pick_default.pick(base + fast + faster_not_bitwise + faster_one_case_lost, 0.01, 0.03) == "fast"
    assert pick_default.pick(base + faster_not_bitwise + faster_one_case_lost + slight, 0.01, 0.03) == "default"
    # An exported earlier version is a yardstick, never the pick.
    assert pick_default.pick(base + rows("prev:default", [0.5, 1.0, 2.0]), 0.01, 0.03) == "default"
    # A package exported with a pending patch may win, named with its package.
    patched = rows("dynt:cfg", [0.8, 1.6, 3.2])
    assert pick_default.pick(base + fast + patched, 0.01, 0.03) == "fast"
    assert pick_default.pick(base + fast + patched, 0.01, 0.03, ("main", "dynt")) == "dynt:cfg"
    # A variant cut short (not every case) is not judged.
    assert "main:fast" not in pick_default.ratios(base + fast[:2])

    # apply_patch: a diff of flashrange/ applied to the tree at root.
    tree = tmp_path / "tree"
    (tree / "flashrange").mkdir(parents=True)
    (tree / "flashrange" / "k.py").write_text("a = 1\n")
    (tmp_path / "p.patch").write_text("--- a/flashrange/k.py\n+++ b/flashrange/k.py\n@@ -1 +1 @@\n-a = 1\n+a = 2\n")
    pick_default.apply_patch(tmp_path / "p.patch", tree)
    assert (tree / "flashrange" / "k.py").read_text() == "a = 2\n"

    source = (ROOT / "flashrange" / "kernels" / "forward.py").read_text()
    copy = tmp_path / "forward.py"
    copy.write_text(source)
    pick_default.apply("sm90pppmd_m128_n128_w4_s3", copy)
    edited = copy.read_text()
    before, after = source.splitlines(), edited.splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1
    assert changed[0][1].strip() == '128: "sm90pppmd_m128_n128_w4_s3",'
    assert changed[0][0].strip().startswith("128: ")
