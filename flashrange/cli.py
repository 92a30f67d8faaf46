"""``flashrange`` command line: ``flashrange demo`` and ``flashrange bench``."""

from __future__ import annotations

import sys


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: flashrange {demo,bench} [options]   (flashrange CMD --help for options)")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if cmd == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    print(f"flashrange: unknown command {cmd!r}; expected 'demo' or 'bench'", file=sys.stderr)
    return 2
