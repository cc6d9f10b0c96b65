"""The `accel` command: `accel launch ...`, `accel run ...`, `accel plan ...`, `accel env`, `accel merge-weights ...`.

Each sub-command lives in its own module with `add_parser(subparsers)` and a `run(args)`
returning the exit code; this module only wires them together.
"""

from __future__ import annotations

import argparse
import sys

from accel import __version__
from accel.commands import env, launch, merge, plan, run

_COMMANDS = (launch, run, plan, env, merge)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `accel` command."""
    parser = argparse.ArgumentParser(
        prog="accel", description="Run PyTorch training scripts on any hardware, or simulate it."
    )
    parser.add_argument("--version", "-v", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `accel` console script; returns the exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # The sub-command's own usage, not the top-level one, and its own words.
        explain = getattr(args, "unrecognized", lambda words: f"unrecognized arguments: {' '.join(words)}")
        getattr(args, "parser", parser).error(explain(extra))
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
