"""``flashrange demo``: runs, compiles once, matches the reference, writes the mask picture."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashrange import demo

REPO = Path(__file__).resolve().parents[1]
TINY = ["--tokens", "71", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--capacity", "16", "--seed", "3"]


def _summary(text):
    m = re.search(
        r"summary: (\d+) steps, compiled (\d+) times?, .* max rel err vs reference: out (\S+), lse (\S+), dx (\S+)",
        text,
    )
    assert m, text
    steps, compiled = int(m.group(1)), int(m.group(2))
    errs = [float(g) for g in m.group(3, 4, 5)]
    return steps, compiled, errs


def _step_lines(text):
    return re.findall(r"step +(\d+): +(\d+) documents -> (\d+) slices .* compilations so far: (\d+)", text)


def test_demo_main_compiles_once_and_matches_reference(tmp_path, capsys):
    png = tmp_path / "mask.png"
    rc = demo.main(["--steps", "5", "--device", "cpu", "--png", str(png), *TINY])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "device: cpu, float32, reference implementation" in text
    steps, compiled, errs = _summary(text)
    assert steps == 5 and compiled == 1
    # On the CPU the op is the reference, and the projections are float32.
    assert max(errs) <= 1e-5, errs
    lines = _step_lines(text)
    assert len(lines) == 5
    assert all(int(slices) == 16 and int(so_far) == 1 for _, _, slices, so_far in lines)
    # The number of documents (hence of real slices) changes between steps.
    assert len({docs for _, docs, _, _ in lines}) > 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = tmp_path / "mask.png"
    rc = demo.main(["--steps", "1", "--device", "cpu", "--backend", "aot_eager", "--png", str(png), *TINY])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "skipped" in text and "pip install matplotlib" in text
    assert not png.exists()
    assert _summary(text)[1] == 1


@pytest.mark.parametrize(
    "args,message",
    [
        pytest.param(["--heads", "6", "--kv-heads", "4"], "must divide --heads", id="bad-gqa"),
        pytest.param(["--tokens", "0"], "--tokens must be >= 1", id="no-tokens"),
        pytest.param(["--device", "tpu"], "--device must be", id="bad-device"),
    ],
)
def test_demo_rejects_bad_options(args, message, capsys):
    assert demo.main(["--device", "cpu", *args] if "--device" not in args else args) == 2
    assert message in capsys.readouterr().err


def test_python_m_flashrange_demo(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        # aot_eager: the in-process test above covers the default inductor path.
        [sys.executable, "-m", "flashrange", "demo", "--steps", "2", "--device", "cpu", "--backend", "aot_eager", *TINY],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps, compiled, errs = _summary(proc.stdout)
    assert steps == 2 and compiled == 1 and max(errs) <= 1e-5
    # The default picture lands in the working directory.
    assert (tmp_path / "flashrange_demo_mask.png").read_bytes()[:4] == b"\x89PNG"
