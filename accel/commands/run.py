"""`accel run --simulate cuda --gpus N [--gpu NAME] [--shapes_only] -- COMMAND ...`.

Runs COMMAND (any program: `pytest`, `torchrun`, `python train.py`, a shell script) with
every Python process it starts on one simulated node: `ACCEL_SIMULATE` set for the command
(`accel.sim.node`), the node created here so that processes started side by side share it.
The command's exit status is this one's; when it ends, whatever it left running on the node
is stopped and its process group killed, so nothing is left behind. Ctrl-C and SIGTERM are
passed on to the command.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `run` sub-command."""
    parser = subparsers.add_parser(
        "run",
        help="run a command with every Python process it starts on a simulated node (ACCEL_SIMULATE)",
        description="Run COMMAND with all its Python processes on one simulated node: "
        "accel run --simulate cuda --gpus 2 -- pytest tests/",
        allow_abbrev=False,  # the command's own options are never taken for abbreviations of ours
    )
    parser.add_argument("--simulate", required=True, choices=("cuda", "xla"), help="the simulated device")
    parser.add_argument("--gpus", "--devices", dest="count", type=int, default=1, help="how many (default 1)")
    parser.add_argument("--gpu", default=None, help="the card of every simulated GPU (H100, A100, L4, ...)")
    parser.add_argument("--shapes_only", action="store_true", help="simulated GPUs hold shapes, not values")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    parser.set_defaults(run=run, parser=parser)
    return parser


def spec_text(args: argparse.Namespace) -> str:
    """The `ACCEL_SIMULATE` value the options ask for."""
    options = [f"gpu={args.gpu}"] if args.gpu else []
    options += ["shapes_only"] if args.shapes_only else []
    return ",".join([f"{args.simulate}:{args.count}", *options])


def run(args: argparse.Namespace) -> int:
    """Run the command on a fresh simulated node; its exit status (128 + N when killed by signal N)."""
    from accel.sim.node import spec, tree

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        args.parser.error("give the command to run after --, e.g. accel run --simulate cuda --gpus 2 -- pytest")
    try:
        text = str(spec.parse(spec_text(args), subject=f"a node of {spec_text(args)}"))
    except spec.SimulateSpecError as error:
        args.parser.error(str(error))
    os.environ[spec.ENV] = text
    os.environ.pop(tree.NODE_ENV, None)  # a node of its own, even when run from a node's process
    folder, _ = tree.join_or_create()
    try:
        child = subprocess.Popen(command, start_new_session=True)
    except OSError as error:
        sys.stderr.write(f"accel run: cannot run {command[0]!r}: {error.strerror}\n")
        return 127
    status = _wait(child)
    _kill_group(child.pid)
    tree.stop(tree.running(folder))
    return status if status >= 0 else 128 - status


def _wait(child: subprocess.Popen) -> int:
    """The child's exit status, passing Ctrl-C and SIGTERM on to its process group meanwhile."""

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _kill_group(pgid: int) -> None:
    """Kill what the command left running in its process group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
