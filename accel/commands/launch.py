"""`accel launch`: run a training script on N processes, on real hardware or simulated.

* Without `--simulate`, the script is handed to PyTorch's own elastic launcher
  (`torch.distributed.run`, i.e. `torchrun`), single- or multi-node.
* With `--simulate {cpu,cuda,xla}`, the script runs on N ranks of `accel.sim.launch`
  (real Gloo collectives, fake CUDA or XLA devices): see `accel.commands.simulate`.

The options are Accelerate's (`accel.commands.launch_args`); those that configure
`Accelerator` reach the script through the environment variables `accel.state` and
`accel.accelerator` read, as Accelerate's do. The exit code is that of the first
failing process (a process killed by signal S: 128 + S).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from accel.commands import launch_args
from accel.commands.exit_codes import process_exit_code
from accel.sim.cuda.gpus import cards as gpu_models
from accel.sim.cuda.memory import picture as memory_picture
from accel.sim.device_names import DEVICES

#: simulated devices (their one definition is torch-free, so `--help` stays fast)
SIMULATED_DEVICES = DEVICES
DEFAULT_SIMULATED_PROCESSES = 2


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `launch` sub-command."""
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on several processes (real or simulated devices)",
        description="Run SCRIPT on several processes: through torchrun on real hardware, "
        "or on simulated devices with --simulate. Takes Accelerate's launch flags.",
        epilog="Refused with an error (not supported by accel): the flags of "
        + ", ".join(launch_args.UNSUPPORTED_FLAGS)
        + ".",
        allow_abbrev=False,  # the script's own options (`--tp 2`) are never taken for abbreviations of ours
    )
    launch_args.add_arguments(parser)
    parser.set_defaults(run=run, parser=parser, unrecognized=launch_args.unrecognized)
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
    if args.gradient_accumulation_steps is not None:
        env["ACCEL_GRADIENT_ACCUMULATION_STEPS"] = str(args.gradient_accumulation_steps)
    if args.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    if args.downcast_bf16 and args.tpu and args.mixed_precision == "bf16":
        env["XLA_DOWNCAST_BF16"] = "1"  # as Accelerate sets it for TPUs
    env.update(launch_args.fsdp_env(args))
    return env


def check_args(args: argparse.Namespace) -> None:
    """Refuse contradictory or unsupported options with a message saying what to do (ValueError)."""
    launch_args.apply_config_file(args)
    launch_args.check_dynamo(args)
    if args.num_processes is not None and args.num_processes < 1:
        raise ValueError(f"--num_processes must be at least 1, got {args.num_processes}")
    if args.num_machines is not None and args.num_machines < 1:
        raise ValueError(f"--num_machines must be at least 1, got {args.num_machines}")
    if args.max_restarts < 0:
        raise ValueError(f"--max_restarts must be 0 or more, got {args.max_restarts}")
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps < 1:
        raise ValueError(f"--gradient_accumulation_steps must be at least 1, got {args.gradient_accumulation_steps}")
    if args.module and args.no_python:
        raise ValueError("--module and --no_python cannot be used together")
    if not args.module and not args.no_python and not os.path.isfile(args.script):
        raise ValueError(f"no such script: {args.script}")
    if args.simulate:
        if (args.num_machines or 1) != 1:
            raise ValueError("--simulate runs on this machine only; drop --num_machines")
        if args.no_python:
            raise ValueError("--no_python cannot be simulated: the ranks run Python; drop --simulate")
        if args.tpu and args.simulate != "xla":
            raise ValueError(f"--tpu with --simulate {args.simulate}: simulate TPUs with --simulate xla")
        if args.log_dir or args.tee != "0":
            raise ValueError("--log_dir/--tee are torchrun's; under --simulate, use --local_ranks_filter")
        for flag, given in (
            ("--gpu", args.gpu is not None),
            ("--shapes_only", args.shapes_only),
            ("--memory_report", args.memory_report is not None),
            ("--timing_report", getattr(args, "timing_report", None) is not None),
            ("--timing_trace", getattr(args, "timing_trace", None) is not None),
            ("--network", getattr(args, "network", None) is not None),
            ("--gpus_per_node", getattr(args, "gpus_per_node", None) is not None),
            ("--tokens_per_step", getattr(args, "tokens_per_step", None) is not None),
            ("--clock", getattr(args, "clock", None) is not None),
        ):
            if given and args.simulate != "cuda":
                raise ValueError(f"{flag} is about simulated GPUs: use it with --simulate cuda, not {args.simulate}")
        if args.gpu is not None:
            gpu_models.check(args.gpu)
        if args.memory_report is not None:
            memory_picture.check_path(args.memory_report)
        _check_timing_args(args)
    else:
        if args.tpu:
            raise ValueError("--tpu: accel launches TPUs only simulated (--simulate xla)")
        for flag, value in (
            ("--fault", args.fault),
            ("--timeout", args.timeout),
            ("--gpu", args.gpu),
            ("--shapes_only", args.shapes_only),
            ("--memory_report", args.memory_report),
            ("--only_ranks", getattr(args, "only_ranks", None)),
            ("--timing_report", getattr(args, "timing_report", None)),
            ("--timing_trace", getattr(args, "timing_trace", None)),
            ("--network", getattr(args, "network", None)),
            ("--gpus_per_node", getattr(args, "gpus_per_node", None)),
            ("--tokens_per_step", getattr(args, "tokens_per_step", None)),
            ("--clock", getattr(args, "clock", None)),
        ):
            if value:
                raise ValueError(f"{flag} applies to simulated runs only; add --simulate cpu|cuda|xla")


def _check_timing_args(args: argparse.Namespace) -> None:
    """The clock's options, checked before any rank starts (ValueError naming what to give)."""
    if getattr(args, "network", None) is not None:
        from accel.sim.cuda.timing.units import parse_network

        parse_network(args.network)
    for flag in ("gpus_per_node", "tokens_per_step"):
        value = getattr(args, flag, None)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag} must be a positive number, got {value}")
    _check_clock(args)


def _check_clock(args: argparse.Namespace) -> None:
    """`--clock gpu` and `--clock host` run the simulated clock, which ``ACCEL_SIM_CLOCK=off`` in this environment
    stops (a contradiction, refused rather than settled silently); the options that report on it need it too."""
    from accel.sim.cuda.timing import pyclock

    chosen = getattr(args, "clock", None)
    inherited = os.environ.get(pyclock.clocks.CLOCK_ENV)
    if chosen not in (None, pyclock.OFF) and inherited is not None and pyclock.mode(inherited) == pyclock.OFF:
        raise ValueError(
            f"--clock {chosen} runs the simulated clock, which {pyclock.clocks.CLOCK_ENV}={inherited} stops: "
            f"unset {pyclock.clocks.CLOCK_ENV} or drop --clock {chosen}"
        )
    if chosen == pyclock.OFF:
        for flag in ("timing_report", "timing_trace", "tokens_per_step"):
            if getattr(args, flag, None) is not None:
                raise ValueError(f"--{flag} reports on the simulated clock, which --clock off stops: drop one of them")


def run(args: argparse.Namespace) -> int:
    """Run the `launch` command; returns the exit code."""
    try:
        check_args(args)
        if not args.simulate:
            torchrun_argv = torchrun_args(args)
    except ValueError as error:
        print(f"accel launch: {error}", file=sys.stderr)
        return 2
    if args.simulate:
        from accel.commands import simulate

        return simulate.simulate(args, accel_env(args))
    env = accel_env(args)
    if args.gpu_ids and args.gpu_ids != "all":
        env["CUDA_VISIBLE_DEVICES"] = args.gpu_ids
    return _torchrun(torchrun_argv, env)


# -- real hardware: torchrun -----------------------------------------------------------------


def _default_num_processes() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """The `torch.distributed.run` command line equivalent to these `accel launch` options.

    As in Accelerate, `--num_processes` counts the processes of all machines.
    """
    machines = args.num_machines or 1
    total = args.num_processes or _default_num_processes() * machines
    if total % machines:
        raise ValueError(f"--num_processes {total} does not split evenly over --num_machines {machines}")
    argv = [f"--nproc_per_node={total // machines}"]
    port = args.main_process_port
    if machines > 1:
        if not args.main_process_ip or not port:
            raise ValueError("--num_machines > 1 needs --main_process_ip and --main_process_port (machine 0's address)")
        rank = args.machine_rank or 0
        if not 0 <= rank < machines:
            raise ValueError(f"--machine_rank must be in 0..{machines - 1}, got {rank}")
        argv += [f"--nnodes={machines}", f"--node_rank={rank}"]
        if args.same_network:
            argv += [f"--master_addr={args.main_process_ip}", f"--master_port={port}"]
        else:
            argv += [f"--rdzv_endpoint={args.main_process_ip}:{port}"]
    elif args.main_process_ip or port:
        argv += ["--nnodes=1", "--node_rank=0", f"--master_addr={args.main_process_ip or '127.0.0.1'}"]
        if port:
            argv += [f"--master_port={port}"]
    else:
        # One machine, no address given: let torchrun pick a free port (no clash between runs).
        argv += ["--standalone"]
    if args.rdzv_backend and args.rdzv_backend != "static":
        argv += [f"--rdzv_backend={args.rdzv_backend}"]
    if args.rdzv_conf:
        argv += [f"--rdzv_conf={args.rdzv_conf}"]
    if args.max_restarts:
        argv += [f"--max_restarts={args.max_restarts}"]
    if args.monitor_interval != 0.1:
        argv += [f"--monitor_interval={args.monitor_interval}"]
    if args.role != "default":
        argv += [f"--role={args.role}"]
    if args.log_dir:
        argv += [f"--log_dir={args.log_dir}"]
    if args.tee != "0":
        argv += [f"--tee={args.tee}"]
    if args.local_ranks_filter:
        argv += [f"--local_ranks_filter={args.local_ranks_filter}"]
    if args.module:
        argv += ["--module"]
    if args.no_python:
        argv += ["--no_python"]
    return argv + [args.script, *args.script_args]


def _torchrun(argv: list[str], env: dict[str, str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ.update(env)
    try:
        torchrun_main(argv)
    except ChildFailedError as error:
        _, first = error.get_first_failure()
        return process_exit_code(first.exitcode)
    return 0
