"""Pick the forward config that a device call's A/B found fastest, for the bench that follows it.

    python scripts/pick_default.py AB_JSON [--apply]

``AB_JSON``: the ``ab.json`` that ``scripts/ab.py --out`` wrote, with ``main:default`` among the forward
variants. A config of this tree (``main:...``) or of a package exported with a pending patch (``--patch
NAME=PATCH``, as ``scripts/ab_export.sh HEAD NAME PATCH`` made it; other packages are yardsticks) qualifies
when its output was bitwise that of ``main:default`` on every case and no case was more than ``--worst``
slower; of those, the one with the lowest geometric mean of its time over the default's wins, if that mean
is below ``1 - --gain``. Prints every variant's mean and worst ratio and the pick (``default`` when none
qualifies). With ``--apply`` it applies the pick's patch, if any, to this tree and writes its config into
``flashrange/kernels/forward.py``'s ``_SM90_DEFAULTS`` at head dim 128 (the A/B's cases are at head dim
128): for the second device call of a pair, whose copy of the tree is thrown away afterwards, so that
FlashAttention-4's bench times the pick through the public call. The repository's default changes only by
a commit, after a person has read the table.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import subprocess
import sys

BASE = "main:default"
FORWARD = pathlib.Path(__file__).resolve().parent.parent / "flashrange" / "kernels" / "forward.py"


def ratios(records):
    """``{variant: (geometric mean of time / default's, worst ratio, bitwise everywhere)}`` of the forward rows."""
    rows = [r for r in records if r["dir"] == "fwd"]
    base = {r["case"]: r["median_ms"] for r in rows if r["variant"] == BASE}
    if not base:
        raise SystemExit(f"pick_default.py: no {BASE} rows in the A/B")
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        if variant == BASE:
            continue
        mine = [r for r in rows if r["variant"] == variant and r["case"] in base]
        if len(mine) != len(base):
            continue  # a variant that did not reach every case (cut short) is not judged
        rs = [r["median_ms"] / base[r["case"]] for r in mine]
        out[variant] = (math.exp(sum(map(math.log, rs)) / len(rs)), max(rs), all(r["check"] == "bitwise" for r in mine))
    return out


def pick(records, gain, worst, packages=("main",)):
    """The winning config: its name for a config of this tree, ``PACKAGE:CONFIG`` for one of the other
    ``packages`` (exported with a patch), ``default`` when none qualifies."""
    best, best_mean = "default", 1.0 - gain
    for variant, (mean, top, bitwise) in ratios(records).items():
        package, config = variant.split(":", 1)
        # Other packages (an exported earlier version) are yardsticks.
        if package in packages and bitwise and top <= 1.0 + worst and mean < best_mean:
            best, best_mean = (config if package == "main" else variant), mean
    return best


def apply_patch(patch, root=FORWARD.parents[2]):
    """Apply ``patch`` (a diff of ``flashrange/``) to the tree at ``root``."""
    patch = pathlib.Path(patch).resolve()
    try:
        subprocess.run(["git", "apply", str(patch)], cwd=root, check=True)
    except FileNotFoundError:  # no git there
        subprocess.run(["patch", "-p1", "-i", str(patch)], cwd=root, check=True)


def apply(config_name, path=FORWARD):
    """Set ``_SM90_DEFAULTS[128]`` to ``config_name`` in the source at ``path``."""
    text = path.read_text()
    new, n = re.subn(r'(_SM90_DEFAULTS = \{\n(?:    \d+: "[^"]+",\n)*?    128: )"[^"]+"', rf'\1"{config_name}"', text)
    if n != 1:
        raise SystemExit(f"pick_default.py: no `128: ...` entry of _SM90_DEFAULTS in {path}")
    path.write_text(new)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ab_json")
    ap.add_argument("--gain", type=float, default=0.01, help="least mean gain over the default (0.01: 1%%)")
    ap.add_argument("--worst", type=float, default=0.03, help="most any one case may lose (0.03: 3%%)")
    ap.add_argument("--apply", action="store_true", help="write the pick into forward.py (a throw-away copy)")
    ap.add_argument("--patch", action="append", default=[], metavar="NAME=PATCH",
                    help="package NAME of the A/B is this tree with PATCH applied: its configs may be picked")
    args = ap.parse_args(argv)
    patches = dict(p.split("=", 1) for p in args.patch)
    records = json.loads(pathlib.Path(args.ab_json).read_text())
    for variant, (mean, top, bitwise) in ratios(records).items():
        print(f"{variant}: mean {mean:.3f} of the default's time, worst case {top:.3f}, "
              f"{'bitwise' if bitwise else 'NOT bitwise'}")
    chosen = pick(records, args.gain, args.worst, ("main", *patches))
    print(f"pick: {chosen}")
    if args.apply and chosen != "default":
        if ":" in chosen:
            package, chosen = chosen.split(":", 1)
            apply_patch(patches[package])
            print(f"applied: {patches[package]}")
        apply(chosen)
        print(f"applied: _SM90_DEFAULTS[128] = {chosen!r} in this copy of {FORWARD.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
