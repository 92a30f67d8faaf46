"""CPU smoke test of ``flashrange bench`` (DESIGN §7) at toy sizes.

The harness must run without a GPU: contenders that need CUDA read ``n/a``,
the CPU ones (flashrange's reference path, SDPA's math backend, eager
FlexAttention forward) run and are compared with each other. The peer forms
of every mask (Flex ``mask_mod``, SDPA ``is_causal``, FlashAttention
``cu_seqlens`` / ``window_size``) are checked cell by cell against the ranges.
"""

from __future__ import annotations

import json

import pytest
import torch

from flashrange import bench
from flashrange.reference import coverage_counts

TINY = [pytest.param(c.tiny(), id=c.name) for c in bench.CASES]

# Cases of the in-process smoke run: one per peer form (SDPA causal, GQA,
# documents, window, shared question), all at toy size.
SMOKE_CASES = "causal-8k,full-16k-gqa32:8,doc16-32k,swa2048-32k,sharedq-32k"


def _dense_from_ranges(mask, T):
    return coverage_counts(mask.q_ranges, mask.k_ranges, mask.mask_types, T, T)


def _grid(T):
    i = torch.arange(T).unsqueeze(1)
    j = torch.arange(T).unsqueeze(0)
    return i, j


@pytest.mark.parametrize("case", TINY)
def test_peer_forms_match_ranges(case):
    """Flex's mask_mod, SDPA's flag, FA's cu_seqlens/window and the area all describe the ranges' mask."""
    mask = bench.build_mask(case, "cpu")
    counts = _dense_from_ranges(mask, case.T)
    assert int(counts.max()) <= 1, "benchmark masks must not overlap"
    dense = counts > 0
    assert mask.area == int(counts.sum())
    i, j = _grid(case.T)
    if mask.mask_mod is None:
        assert bool(dense.all())
    else:
        b = h = torch.zeros((), dtype=torch.long)
        assert torch.equal(mask.mask_mod(b, h, i, j).expand(case.T, case.T), dense)
    if mask.sdpa_causal is not None:
        want = (j <= i) if mask.sdpa_causal else torch.ones(case.T, case.T, dtype=torch.bool)
        assert torch.equal(want.expand(case.T, case.T), dense)
    if mask.cu_seqlens is not None:
        cu = mask.cu_seqlens.tolist()
        doc = torch.bucketize(torch.arange(case.T), torch.tensor(cu[1:]), right=True)
        want = (doc.unsqueeze(1) == doc.unsqueeze(0)) & (j <= i)
        assert torch.equal(want, dense)
    if mask.window:
        left = mask.window - 1  # FlashAttention's window_size=(left, 0) with causal=True
        assert torch.equal((j <= i) & (j >= i - left), dense)


def test_case_shapes_and_flops():
    names = [c.name for c in bench.CASES]
    assert len(names) == len(set(names))
    for c in bench.CASES:
        t = c.tiny()
        assert t.Hq % t.Hkv == 0 and t.T % 2 == 1
    gqa = next(c for c in bench.CASES if c.Hq != c.Hkv)
    assert (gqa.Hq, gqa.Hkv) == (32, 8)
    full = next(c for c in bench.CASES if c.kind == "full")
    area = full.T * full.T
    assert bench._flops(full, area, "fwd") == 4 * area * full.D * full.Hq
    assert bench._flops(full, area, "fwdbwd") == 3.5 * bench._flops(full, area, "fwd")


@pytest.mark.parametrize("T,n", [(32768, 16), (32768, 128), (135, 17), (9, 9)], ids=["16docs", "128docs", "tiny", "unit"])
def test_doc_lengths(T, n):
    lengths = bench._doc_lengths(T, n, seed=n)
    assert len(lengths) == n and sum(lengths) == T and min(lengths) >= 1
    assert lengths == bench._doc_lengths(T, n, seed=n)


def test_unknown_case_is_reported():
    with pytest.raises(SystemExit, match="no case matches 'nope'.*causal-8k"):
        bench.main(["--tiny", "--device", "cpu", "--cases", "nope"])


def test_full_size_on_cpu_is_refused():
    with pytest.raises(SystemExit, match="need a CUDA GPU.*--tiny"):
        bench.main(["--device", "cpu", "--cases", "full-8k"])


def test_cpu_smoke_run(tmp_path, capsys):
    rc = bench.main(["--tiny", "--device", "cpu", "--warmup", "1", "--reps", "1",
                     "--cases", SMOKE_CASES, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0, data["errors"] + data["failures"]
    assert data["header"]["device_type"] == "cpu" and data["header"]["torch"] == torch.__version__
    assert [c["name"] for c in data["cases"]] == SMOKE_CASES.split(",")
    tol = bench._TOLERANCE[torch.bfloat16]
    for c in data["cases"]:
        res = c["results"]
        fr = res["flashrange"]
        assert fr["status"] == "ok" and all(fr[f"{col}_ms"] > 0 for col in ("fwd", "bwd", "fwdbwd"))
        # CUDA-only peers are n/a here, never errors.
        for name, rec in res.items():
            assert rec["status"] in ("ok", "n/a"), (c["name"], name, rec)
        # Eager Flex forward runs every masked case on the CPU and agrees with flashrange.
        if c["kind"] != "full":
            assert res["flex"]["status"] == "ok" and res["flex"]["err_out"] <= tol
        if c["kind"] in ("full", "causal"):
            sd = res["sdpa-math"]
            assert sd["status"] == "ok" and sd["err_out"] <= tol and sd["err_grad"] <= tol
            assert c["ratios"]["sdpa-math"]["fwdbwd"] > 0
        else:
            assert res["sdpa-math"] == {"status": "n/a", "note": "needs a dense attn_mask"}
    plan = data["plan"]
    assert plan["fwd_eager_us"] > 0 and plan["bwd_kv_eager_us"] > 0 and plan["fwd_graph_us"] is None
    assert (tmp_path / "bench.png").stat().st_size > 0
    md = (tmp_path / "bench.md").read_text()
    # The short table comes last, on stdout and in the markdown file.
    assert printed.rstrip().endswith("correctness vs peers: OK")
    assert md.rstrip().endswith("correctness vs peers: OK")
    assert "| doc16-32k |" in printed.rstrip().split("flashrange bench: CPU")[-1]

    # --report-only reprints a saved run.
    assert bench.main(["--report-only", str(tmp_path / "bench.json")]) == 0
    assert capsys.readouterr().out.rstrip().endswith("correctness vs peers: OK")


def test_mismatch_fails_loudly(tmp_path, capsys, monkeypatch):
    """A flashrange output that disagrees with a peer makes the command fail."""
    make = bench.FlashRange.make

    def wrong(self, case, mask):
        fn = make(self, case, mask)
        return lambda q, k, v: fn(q, k, v) * 1.25

    monkeypatch.setattr(bench.FlashRange, "make", wrong)
    rc = bench.main(["--tiny", "--device", "cpu", "--warmup", "1", "--reps", "1", "--cases", "causal-8k",
                     "--contenders", "sdpa-math", "--no-backward", "--no-plan", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 1
    assert data["failures"] and "causal-8k/sdpa-math: err_out" in data["failures"][0]
    assert "MISMATCH" in captured.err
    assert "correctness vs peers: FAILED" in captured.out


def test_time_budget_skips_but_reports(tmp_path, capsys):
    rc = bench.main(["--tiny", "--device", "cpu", "--cases", "full-8k,causal-8k", "--time-budget", "1e-9",
                     "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0
    assert all(c.get("skipped") == "time budget spent" for c in data["cases"])
    assert "| causal-8k | skipped |" in capsys.readouterr().out
