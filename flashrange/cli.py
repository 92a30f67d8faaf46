"""The ``flashrange`` command: ``flashrange demo`` and ``flashrange bench``.

Each subcommand owns its options (``flashrange demo --help``,
``flashrange bench --help``); this parser only lists them and answers
``--help`` and ``--version``. Output piped into a reader that stops early
(``flashrange bench | head``) ends quietly, as command-line tools do.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]

COMMANDS = {
    "demo": "packed documents whose mask changes every step, through a compiled attention layer",
    "bench": "time flashrange against its peers on the same inputs (flashrange bench --help)",
}

# Exit status of a process whose output pipe closed (128 + SIGPIPE), as the shell reports it.
_EXIT_BROKEN_PIPE = 141


def _parser():
    from . import __version__

    p = argparse.ArgumentParser(
        prog="flashrange",
        description="flashrange: flash attention for masks written as ranges.",
        epilog="Run 'flashrange COMMAND --help' for a command's options.",
    )
    p.add_argument("--version", action="version", version=f"flashrange {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def _run(argv):
    # A subcommand parses its own arguments: hand them over untouched.
    if argv and argv[0] in COMMANDS:
        cmd, rest = argv[0], argv[1:]
        if cmd == "demo":
            from .demo import main as demo_main

            return demo_main(rest)
        from .bench import main as bench_main

        return bench_main(rest)
    parser = _parser()
    parser.parse_args(argv)  # --help, --version and errors exit here
    parser.print_help()
    return 0


def main(argv=None) -> int:
    """Entry point of the ``flashrange`` script and of ``python -m flashrange``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = _run(argv)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # The reader went away: send what is still buffered to /dev/null so that
        # the interpreter's final flush does not raise again, and exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _EXIT_BROKEN_PIPE
