"""The options of `accel launch`: Accelerate 1.15's launch flags with the same meaning, our own
simulator flags, clear errors for the engines and hardware accel does not support, and
Accelerate's config file (`--config_file`, else its default file when there is one).

Kept apart from `accel.commands.launch` (which runs what these options describe) and free
of torch, so that `accel launch --help` answers at once.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from accel.sim.device_names import DEVICES

#: flags of `accelerate launch` for engines or hardware accel does not support, by what they need
UNSUPPORTED_FLAGS: dict[str, tuple[str, ...]] = {
    "DeepSpeed": (
        "--use_deepspeed",
        "--deepspeed_config_file",
        "--zero_stage",
        "--offload_optimizer_device",
        "--offload_param_device",
        "--offload_optimizer_nvme_path",
        "--offload_param_nvme_path",
        "--gradient_clipping",
        "--zero3_init_flag",
        "--zero3_save_16bit_model",
        "--deepspeed_hostfile",
        "--deepspeed_exclusion_filter",
        "--deepspeed_inclusion_filter",
        "--deepspeed_multinode_launcher",
        "--deepspeed_moe_layer_cls_names",
    ),
    "Megatron-LM": ("--use_megatron_lm",),  # and every --megatron_lm_* flag (see _unsupported_engine)
    "ND parallelism (ParallelismConfig)": ("--use_parallelism_config",),  # and --parallelism_config_*
    "FP8 recipes (Transformer Engine, MS-AMP, torchao)": ("--fp8_backend",),  # and --fp8_*
    "Amazon SageMaker": ("--aws_access_key_id", "--aws_secret_access_key"),
    "MPI launching (mpirun)": ("--mpirun_hostfile",),
    "TPU pods": ("--tpu_cluster", "--no_tpu_cluster", "--tpu_use_sudo", "--vm", "--env"),
    "CPU affinity (NVIDIA)": ("--enable_cpu_affinity",),
    "Intel extensions (IPEX) and XPU/NPU devices": ("--ipex", "--use_xpu", "--use_npu"),
}
#: `accelerate launch`'s FSDP flags (name -> its default), given to the script as the FSDP_* environment
FSDP_FLAGS: dict[str, str | None] = {
    "fsdp_version": "1",
    "fsdp_offload_params": "false",
    "fsdp_min_num_params": str(int(1e8)),
    "fsdp_sharding_strategy": "FULL_SHARD",
    "fsdp_reshard_after_forward": "true",
    "fsdp_auto_wrap_policy": None,
    "fsdp_transformer_layer_cls_to_wrap": None,
    "fsdp_backward_prefetch": None,
    "fsdp_state_dict_type": None,
    "fsdp_forward_prefetch": "false",
    "fsdp_use_orig_params": "true",
    "fsdp_cpu_ram_efficient_loading": "true",
    "fsdp_sync_module_states": "true",
    "fsdp_activation_checkpointing": "false",
    "fsdp_activation_checkpointing_offload": "false",
}
#: environment variable of each FSDP flag, as Accelerate's launcher sets them
FSDP_ENV = {flag: "FSDP_" + flag[5:].upper() for flag in FSDP_FLAGS}
FSDP_ENV["fsdp_offload_params"] = "FSDP_OFFLOAD_PARAMS"
FSDP_ENV["fsdp_transformer_layer_cls_to_wrap"] = "FSDP_TRANSFORMER_CLS_TO_WRAP"


def fsdp_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment `--use_fsdp` and the `--fsdp_*` flags give the script (Accelerate's names and values)."""
    if not getattr(args, "use_fsdp", None):
        return {}
    env = {"ACCELERATE_USE_FSDP": "true"}
    for flag, name in FSDP_ENV.items():
        value = getattr(args, flag, None)
        if value is not None:
            env[name] = str(value).lower() if str(value).lower() in ("true", "false") else str(value)
    return env


#: flag prefixes of whole families of unsupported flags (Accelerate has dozens of each)
UNSUPPORTED_PREFIXES = {
    "--megatron_lm_": "Megatron-LM",
    "--parallelism_config_": "ND parallelism (ParallelismConfig)",
    "--fp8_": "FP8 recipes (Transformer Engine, MS-AMP, torchao)",
}
#: Accelerate's config file distributed types we cannot run
UNSUPPORTED_DISTRIBUTED_TYPES = (
    "DEEPSPEED",
    "MEGATRON_LM",
    "MULTI_NPU",
    "MULTI_XPU",
    "MULTI_MLU",
    "MULTI_SDAA",
    "MULTI_MUSA",
    "MULTI_HPU",
    "MULTI_NEURON",
)
#: config file keys that fill in a flag the command line did not give (key -> option name)
CONFIG_KEYS = {
    "mixed_precision": "mixed_precision",
    "num_processes": "num_processes",
    "num_machines": "num_machines",
    "machine_rank": "machine_rank",
    "main_process_ip": "main_process_ip",
    "main_process_port": "main_process_port",
    "gpu_ids": "gpu_ids",
    "use_cpu": "cpu",
    "debug": "debug",
    "rdzv_backend": "rdzv_backend",
    "same_network": "same_network",
    "downcast_bf16": "downcast_bf16",
}


class _Unsupported(argparse.Action):
    """Any use of the flag is an error naming what it needs."""

    def __init__(self, option_strings: list[str], dest: str, what: str = "", **kwargs: Any) -> None:
        self.what = what
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None) -> None:
        parser.error(f"{option}: {self.what} is not supported by accel; drop the flag (see `accel launch --help`)")


def unrecognized(extra: list[str]) -> str:
    """The error for flags `launch` does not know: a flag of an unsupported family says what it needs."""
    for word in extra:
        for prefix, what in UNSUPPORTED_PREFIXES.items():
            if word.startswith(prefix):
                return f"{word.split('=')[0]}: {what} is not supported by accel; drop the flag"
    return f"unrecognized arguments: {' '.join(extra)}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option of `accel launch` to `parser`."""
    parser.add_argument("--config_file", help="an Accelerate config file (default: Accelerate's own, if present)")
    parser.add_argument("-q", "--quiet", action="store_true", help="say less about the launch itself")
    _add_hardware(parser)
    _add_resources(parser)
    _add_distributed(parser)
    _add_program(parser)
    _add_simulation(parser)
    _add_fsdp(parser)
    _add_unsupported(parser)
    parser.add_argument("script", help="the Python script to run (a module with -m, a program with --no_python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _add_hardware(parser: argparse.ArgumentParser) -> None:
    """Which hardware to train on."""
    hardware = parser.add_argument_group("Hardware")
    hardware.add_argument("--cpu", action="store_true", default=None, help="train on the CPU even with GPUs present")
    hardware.add_argument("--multi_gpu", action="store_true", help="distributed training on several GPUs")
    hardware.add_argument("--tpu", action="store_true", help="TPU training (on TPUs: only with --simulate xla)")


def _add_resources(parser: argparse.ArgumentParser) -> None:
    """How many processes, threads and machines, and the precision and compile settings of Accelerator()."""
    resources = parser.add_argument_group("Resources")
    resources.add_argument(
        "--mixed_precision", choices=("no", "fp16", "bf16", "fp8"), help="mixed precision given to Accelerator()"
    )
    resources.add_argument(
        "--num_processes", type=int, help="processes in all (over all machines; default: GPUs here, or 1; 2 simulated)"
    )
    resources.add_argument("--num_machines", type=int, help="machines taking part (default 1)")
    resources.add_argument("--num_cpu_threads_per_process", type=int, help="torch threads in each process")
    resources.add_argument(
        "--dynamo_backend", default="no", help="torch.compile backend: only 'no' (accel does not compile models)"
    )
    resources.add_argument("--dynamo_mode", help=argparse.SUPPRESS)
    resources.add_argument("--dynamo_use_fullgraph", action="store_true", help=argparse.SUPPRESS)
    resources.add_argument("--dynamo_use_dynamic", action="store_true", help=argparse.SUPPRESS)
    resources.add_argument("--dynamo_use_regional_compilation", action="store_true", help=argparse.SUPPRESS)


def _add_distributed(parser: argparse.ArgumentParser) -> None:
    """How the processes find each other and are run (torchrun's options, Accelerator() settings)."""
    distributed = parser.add_argument_group("Distributed")
    distributed.add_argument("--gpu_ids", help="GPUs of this machine to use, e.g. 0,1 (CUDA_VISIBLE_DEVICES)")
    distributed.add_argument(
        "--same_network", action="store_true", default=None, help="all machines are on one local network"
    )
    distributed.add_argument("--machine_rank", type=int, help="index of this machine, 0 .. num_machines-1")
    distributed.add_argument("--main_process_ip", help="address of machine 0 (needed with several machines)")
    distributed.add_argument("--main_process_port", type=int, help="free port on machine 0")
    distributed.add_argument("-t", "--tee", default="0", help="torchrun's --tee: copy streams to --log_dir files")
    distributed.add_argument("--log_dir", help="torchrun's --log_dir: where per-process logs go")
    distributed.add_argument("--role", default="default", help="torchrun's --role of the workers")
    distributed.add_argument("--rdzv_backend", help="rendezvous: 'static' (default) or 'c10d'")
    distributed.add_argument("--rdzv_conf", default="", help="extra rendezvous settings, key1=value1,...")
    distributed.add_argument(
        "--max_restarts",
        type=int,
        default=0,
        help="restart every process up to N times after a failure (TORCHELASTIC_RESTART_COUNT counts them)",
    )
    distributed.add_argument("--monitor_interval", type=float, default=0.1, help="seconds between health checks")
    distributed.add_argument("--gradient_accumulation_steps", type=int, help="gradient accumulation of Accelerator()")
    distributed.add_argument("--debug", action="store_true", default=None, help="check collectives across ranks")
    distributed.add_argument("--main_training_function", help=argparse.SUPPRESS)  # TPU: function to spawn
    distributed.add_argument(
        "--downcast_bf16", action="store_true", default=None, help="TPU bf16: keep float64 as float32"
    )


def _add_program(parser: argparse.ArgumentParser) -> None:
    """What SCRIPT is: a Python file, a module or a program."""
    program = parser.add_argument_group("Program")
    program.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    program.add_argument("--no_python", action="store_true", help="SCRIPT is an executable, not Python")


def _add_simulation(parser: argparse.ArgumentParser) -> None:
    """accel's own options: simulated devices, GPU cards, faults, which ranks run and are shown."""
    sim = parser.add_argument_group("Simulation (accel's own)")
    sim.add_argument("--simulate", choices=DEVICES, help="run on N simulated devices of this kind on this machine")
    sim.add_argument(
        "--timeout", type=float, help="seconds a simulated run may take (default: no limit; deadlocks still fail)"
    )
    sim.add_argument(
        "--gpu",
        metavar="NAME",
        help="with --simulate cuda: the card each simulated GPU is (H100, H200, A100-80GB, A100-40GB, L40S, L4, A10G, "
        "RTX4090, RTX3090, T4, V100, V100-32GB, or memory=24GiB,capability=8.9; default: $ACCEL_SIM_GPU, else H100)",
    )
    sim.add_argument(
        "--shapes_only",
        action="store_true",
        help="with --simulate cuda: simulated GPUs hold shapes, not data: does the script fit on --gpu, at what peak "
        "memory, without computing it (values read back are zeros)",
    )
    sim.add_argument(
        "--only_ranks",
        metavar="RANKS",
        help="with --shapes_only: run only these ranks of the --num_processes world (e.g. 0,63 or 0-3), each as that "
        "rank of the full world, standing in for the ranks after it up to the next one run (a symmetric layout's "
        "ranks do the same: one process instead of many)",
    )
    sim.add_argument(
        "--memory_report",
        metavar="PATH",
        help="with --simulate cuda: each rank prints what made up its peak memory (by category, top modules) "
        "and draws its memory over the step of the peak to PATH (.html or .svg; PATH.rankN.html per rank, or "
        "{rank} in PATH)",
    )
    sim.add_argument(
        "--timing_report",
        metavar="PATH",
        help="with --simulate cuda: each rank adds its predicted step times (simulated clock of the --gpu card) "
        "to the JSON file PATH: {card, network, ranks: {rank: {steps: [{time_s, compute_s, comm_s, exposed_comm_s, "
        "flops}]}}}",
    )
    sim.add_argument(
        "--timing_trace",
        metavar="PATH",
        help="with --simulate cuda: each rank writes its last whole step as a trace Perfetto and chrome://tracing "
        "open (one track per stream; PATH.rankN.json per rank, or {rank} in PATH) and a picture of it (.svg)",
    )
    sim.add_argument(
        "--network",
        metavar="BANDWIDTH",
        help="with --simulate cuda: each GPU's NIC between nodes for the predicted step time, e.g. 400Gbps "
        "(default: the card's usual one: 400Gbps for H100/H200, 200Gbps for A100)",
    )
    sim.add_argument(
        "--gpus_per_node",
        type=int,
        metavar="N",
        help="with --simulate cuda: GPUs per node (NVLink within a node, the network between), default 8",
    )
    sim.add_argument(
        "--tokens_per_step",
        type=int,
        metavar="N",
        help="with --simulate cuda: the tokens one training step holds over all ranks, for tokens/s per GPU",
    )
    sim.add_argument(
        "--clock",
        choices=("host", "gpu", "off"),
        help="with --simulate cuda: what the script's time.perf_counter, time.monotonic and time.time read: host "
        "(this machine's time, the default), gpu (the simulated GPU host's predicted time, so that the script's own "
        "throughput log prints predicted figures), off (no simulated clock: no predicted step times)",
    )
    sim.add_argument(
        "--local_ranks_filter",
        "--local-ranks-filter",
        dest="local_ranks_filter",
        metavar="RANKS",
        help="show only these ranks' output, e.g. 0 or 0,2 or 1-3 (as torchrun's); one rank shown: no prefix",
    )
    sim.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="inject a fault in the first attempt, e.g. kill:rank=1:collective=3 (see accel.sim.parse_fault)",
    )


def _add_fsdp(parser: argparse.ArgumentParser) -> None:
    """`--use_fsdp` and Accelerate's `--fsdp_*` flags."""
    fsdp = parser.add_argument_group("FSDP (FSDP2: fully_shard, see accel.fsdp)")
    fsdp.add_argument("--use_fsdp", action="store_true", default=None, help="shard models with FSDP (GPUs)")
    for flag, default in FSDP_FLAGS.items():
        fsdp.add_argument(f"--{flag}", default=default, help=f"FullyShardedDataParallelPlugin: {flag[5:]}")


def _add_unsupported(parser: argparse.ArgumentParser) -> None:
    """Accelerate's flags for what accel does not support: each is an error naming what it needs."""
    unsupported = parser.add_argument_group("Unsupported")
    for what, flags in UNSUPPORTED_FLAGS.items():
        for flag in flags:
            unsupported.add_argument(flag, action=_Unsupported, what=what)


def default_config_file() -> str:
    """Where `accelerate config` writes its default file."""
    cache = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return os.path.join(cache, "accelerate", "default_config.yaml")


def apply_config_file(args: argparse.Namespace) -> None:
    """Fill in the options the command line left out from the Accelerate config file, as Accelerate does.

    Raises ValueError for a file that cannot be read or asks for what accel does not support.
    """
    path = args.config_file
    if path is None:
        path = default_config_file()
        if not os.path.isfile(path):
            return
    elif not os.path.isfile(path):
        raise ValueError(f"--config_file {path}: no such file")
    config = _read_config(path)
    kind = str(config.get("distributed_type", "NO")).upper()
    if kind == "FSDP":
        # Accelerate's `fsdp_config` keys are the launch flags' names
        if getattr(args, "use_fsdp", None) is None:
            args.use_fsdp = True
        for key, value in (config.get("fsdp_config") or {}).items():
            # the command line wins: a flag still at its default takes the file's value
            if key in FSDP_FLAGS and getattr(args, key, None) == FSDP_FLAGS[key]:
                setattr(args, key, str(value))
    if kind in UNSUPPORTED_DISTRIBUTED_TYPES:
        raise ValueError(f"{path}: distributed_type {kind} is not supported by accel; use MULTI_GPU, MULTI_CPU or XLA")
    dynamo = config.get("dynamo_config") or {}
    if isinstance(dynamo, dict) and str(dynamo.get("dynamo_backend", "NO")).upper() != "NO":
        raise ValueError(f"{path}: dynamo_backend {dynamo['dynamo_backend']} is not supported by accel (no compile)")
    for key, option in CONFIG_KEYS.items():
        if key in config and getattr(args, option, None) is None:
            setattr(args, option, config[key])
    if kind in ("XLA", "TPU") and not args.tpu:
        args.tpu = True


def _read_config(path: str) -> dict[str, Any]:
    with open(path) as handle:
        text = handle.read()
    if path.endswith(".json"):
        import json

        data = json.loads(text)
    else:
        try:
            import yaml  # PyYAML: the format of Accelerate's config files (installed with accelerate)
        except ImportError:
            raise ValueError(f"{path}: reading a YAML config file needs PyYAML (pip install pyyaml)") from None
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not an Accelerate config file (expected a mapping of settings)")
    return data


def check_dynamo(args: argparse.Namespace) -> None:
    """accel does not compile models: only the dynamo backend "no" is accepted."""
    if str(args.dynamo_backend).lower() != "no":
        raise ValueError(
            f"--dynamo_backend {args.dynamo_backend}: accel does not compile models (torch.compile); "
            "drop the flag and call torch.compile on the model yourself"
        )
