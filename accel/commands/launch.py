"""`accel launch`: run a training script on N processes, on real hardware or simulated.

* Without `--simulate`, the script is handed to PyTorch's own elastic launcher
  (`torch.distributed.run`, i.e. `torchrun`), single- or multi-node.
* With `--simulate {cpu,cuda,xla}`, the script runs on N ranks of `accel.sim.launch`
  (real Gloo collectives, fake CUDA or XLA devices), in fresh processes. The exit code
  is non-zero if any rank fails, and each failing rank's traceback is printed once, every
  line prefixed with `[rank N]`.

Options that configure `accel` itself (`--mixed_precision`, `--cpu`, `--debug`) reach the
script through the environment variables that `accel.state` reads.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any

from accel.sim.device_names import DEVICES

#: simulated devices (their one definition is torch-free, so `--help` stays fast)
SIMULATED_DEVICES = DEVICES
DEFAULT_SIMULATED_PROCESSES = 2
DEFAULT_SIMULATE_TIMEOUT = 600.0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `launch` sub-command."""
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on several processes (real or simulated devices)",
        description="Run SCRIPT on several processes: through torchrun on real hardware, "
        "or on simulated devices with --simulate.",
    )
    parser.add_argument(
        "--simulate", choices=SIMULATED_DEVICES, help="run on N simulated devices of this kind on this machine"
    )
    parser.add_argument(
        "--num_processes", type=int, help="processes per machine (default: GPUs here, or 1; 2 when simulating)"
    )
    parser.add_argument("--num_machines", type=int, default=1, help="machines taking part (real hardware only)")
    parser.add_argument("--machine_rank", type=int, default=0, help="index of this machine, 0 .. num_machines-1")
    parser.add_argument("--main_process_ip", help="address of machine 0 (needed with several machines)")
    parser.add_argument("--main_process_port", type=int, help="free port on machine 0")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_SIMULATE_TIMEOUT,
        help="seconds a simulated run may take (default: %(default)s)",
    )
    parser.add_argument(
        "--mixed_precision", choices=("no", "fp16", "bf16", "fp8"), help="mixed precision given to Accelerator()"
    )
    parser.add_argument("--cpu", action="store_true", help="use the CPU even where an accelerator is present")
    parser.add_argument("--debug", action="store_true", help="check tensor shapes across ranks before collectives")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    parser.set_defaults(run=run)
    return parser


def accel_env(args: argparse.Namespace) -> dict[str, str]:
    """Environment variables that carry the accel options to the script."""
    env: dict[str, str] = {}
    if args.mixed_precision:
        env["ACCEL_MIXED_PRECISION"] = args.mixed_precision
    if args.cpu:
        env["ACCEL_USE_CPU"] = "1"
    if args.debug:
        env["ACCEL_DEBUG_MODE"] = "1"
    return env


def run(args: argparse.Namespace) -> int:
    """Run the `launch` command; returns the exit code."""
    if not os.path.isfile(args.script):
        print(f"accel launch: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.num_processes is not None and args.num_processes < 1:
        print(f"accel launch: --num_processes must be at least 1, got {args.num_processes}", file=sys.stderr)
        return 2
    if args.simulate:
        if args.num_machines != 1:
            print("accel launch: --simulate runs on this machine only; drop --num_machines", file=sys.stderr)
            return 2
        return simulate(args)
    try:
        torchrun_argv = torchrun_args(args)
    except ValueError as error:
        print(f"accel launch: {error}", file=sys.stderr)
        return 2
    return _torchrun(torchrun_argv, accel_env(args))


# -- real hardware: torchrun -----------------------------------------------------------------


def _default_num_processes() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The `torch.distributed.run` command line equivalent to these `accel launch` options."""
    nproc = args.num_processes or _default_num_processes()
    argv = [f"--nproc_per_node={nproc}"]
    if args.num_machines > 1:
        if not args.main_process_ip or not args.main_process_port:
            raise ValueError("--num_machines > 1 needs --main_process_ip and --main_process_port (machine 0's address)")
        if not 0 <= args.machine_rank < args.num_machines:
            raise ValueError(f"--machine_rank must be in 0..{args.num_machines - 1}, got {args.machine_rank}")
        argv += [f"--nnodes={args.num_machines}", f"--node_rank={args.machine_rank}"]
        argv += [f"--master_addr={args.main_process_ip}", f"--master_port={args.main_process_port}"]
    elif args.main_process_ip or args.main_process_port:
        argv += ["--nnodes=1", "--node_rank=0"]
        argv += [f"--master_addr={args.main_process_ip or '127.0.0.1'}"]
        if args.main_process_port:
            argv += [f"--master_port={args.main_process_port}"]
    else:
        # One machine, no address given: let torchrun pick a free port (no clash between runs).
        argv += ["--standalone"]
    return argv + [args.script, *args.script_args]


def _torchrun(argv: list[str], env: dict[str, str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ.update(env)
    try:
        torchrun_main(argv)
    except ChildFailedError as error:
        codes = [failure.exitcode for failure in error.failures.values() if failure.exitcode > 0]
        return codes[0] if codes else 1
    return 0


# -- simulated devices: accel.sim.launch ------------------------------------------------------


class ScriptExit(RuntimeError):
    """The script called `sys.exit` with a failure status in a simulated rank."""


def run_script(script: str, script_args: list[str], env: dict[str, str]) -> None:
    """Run `script` as `__main__` in this (simulated) rank, as `python script ARGS` would."""
    from accel.sim.worker import hide_frames_of

    # A failing rank's traceback then starts at the script, not in this runner.
    hide_frames_of(__file__)
    hide_frames_of(runpy.run_path.__code__.co_filename)  # "<frozen runpy>" on 3.11+
    os.environ.update(env)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise ScriptExit(f"{script} exited with status {exit_.code!r} ({_where(exit_)})") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def _where(error: BaseException) -> str:
    """'file line N' of the innermost frame that raised `error` (where the script called sys.exit)."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename} line {frames[-1].lineno}" if frames else "location unknown"


def simulate(args: argparse.Namespace) -> int:
    """Run the script on `--num_processes` simulated ranks; returns the exit code."""
    from accel.sim import DistributedFailure, launch

    world_size = args.num_processes or DEFAULT_SIMULATED_PROCESSES
    script = os.path.abspath(args.script)
    try:
        launch(
            run_script,
            args=(script, list(args.script_args), accel_env(args)),
            world_size=world_size,
            device=args.simulate,
            timeout=args.timeout,
            isolated=True,
        )
    except DistributedFailure as failure:
        sys.stdout.flush()
        print(format_failures(failure.failures, world_size, getattr(failure, "stopped", None)), file=sys.stderr)
        return 1
    return 0


def describe_failure(failure: Any) -> str:
    """What went wrong on one rank, in the words a user needs (traceback, exit code, signal, stack)."""
    kind = getattr(failure, "kind", "exception")
    if kind == "exit":
        text = f"exited with code {failure.exitcode}"
    elif kind == "signal":
        text = f"killed by signal {failure.signal_name}"
    elif kind == "timeout":
        text = "timed out" + (
            f"; its stack at that moment:\n{failure.stack}" if failure.stack else " (no stack captured)"
        )
    else:
        text = failure.traceback or f"{failure.exc_type}: {failure.message}"
    return text.rstrip("\n")


def format_failures(failures: dict[int, Any], world_size: int, stopped: dict[int, Any] | None = None) -> str:
    """Every failing rank's report (in the launcher's order: likely cause first), each line
    prefixed `[rank N]`; then one line per rank stopped because of them; then a summary."""
    blocks = []
    for rank, failure in failures.items():
        lines = describe_failure(failure).splitlines() or [""]
        blocks.append("\n".join(f"[rank {rank}] {line}" for line in lines))
    for rank in sorted(stopped or {}):
        blocks.append(f"[rank {rank}] stopped: still running after another rank had failed")
    ranks = ", ".join(str(rank) for rank in sorted(failures))
    blocks.append(f"accel launch: {len(failures)} of {world_size} ranks failed (rank {ranks})")
    return "\n".join(blocks)
