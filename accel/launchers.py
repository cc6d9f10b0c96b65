"""Start a training function on several processes from Python: a notebook, a test, a debugging session.

`debug_launcher` runs it on N CPU ranks of the simulator (a real Gloo process group);
`notebook_launcher` runs it on one process per GPU through torch's elastic launcher,
on CPU processes when there is no GPU, and on simulated GPUs or TPU cores with our
extra `simulate=` argument. A function defined in a notebook cell or inside a test
works: the elastic launcher forks (nothing is pickled), the simulator sends such a
function by value (dill).

The simulator is imported only here, inside the two functions that offer it: `import
accel` stays free of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from accel.utils.dataclasses import PrecisionType
from accel.utils.environment import patch_environment

#: what the ranks read to pick their mixed precision (see accel.state)
_PRECISION_ENV = "ACCEL_MIXED_PRECISION"


def _precision(mixed_precision: str) -> str:
    value = str(mixed_precision).lower()
    if value not in PrecisionType.list():
        raise ValueError(f"unknown mixed_precision {mixed_precision!r}; choose one of {PrecisionType.list()}")
    return value


def _refuse_initialised_state(where: str) -> None:
    """Ranks must set up their own state: one inherited from the parent would be the parent's, not theirs."""
    from accel.state import AcceleratorState, PartialState

    if PartialState._shared_state or AcceleratorState._shared_state:
        raise RuntimeError(
            f"{where}: an Accelerator or PartialState already exists in this process. Create them only inside the "
            "launched function (restart the notebook kernel, or call accel.state.reset_state() first)."
        )


def _call_with_environment(function: Callable[..., Any], environment: dict[str, str], *args: Any) -> Any:
    """Inside a rank: run `function(*args)` with `environment` set (the launcher's settings for this run)."""
    with patch_environment(**environment):
        return function(*args)


def _simulate(
    function: Callable[..., Any],
    args: tuple,
    num_processes: int,
    device: str,
    mixed_precision: str,
    timeout: float | None,
) -> None:
    from accel.sim import launch  # only the launchers reach into the simulator (see the module docstring)

    environment = {_PRECISION_ENV: mixed_precision}
    if device == "cpu":
        environment["ACCEL_USE_CPU"] = "1"
    launch(
        _call_with_environment,
        args=(function, environment, *args),
        world_size=num_processes,
        device=device,
        timeout=timeout,
    )


def debug_launcher(
    function: Callable[..., Any], args: tuple = (), num_processes: int = 2, *, timeout: float | None = None
) -> None:
    """Run `function(*args)` on `num_processes` CPU processes joined by a real Gloo process group.

    For debugging and tests of distributed code on one machine: inside, `PartialState()`
    sees `num_processes` processes (`MULTI_CPU`) and mixed precision is off. The function
    may be defined locally (it is sent by value). A failing rank raises
    `accel.sim.DistributedFailure` with every failed rank's traceback; `timeout` (seconds,
    None: no limit) bounds the run, and ranks waiting on a collective their peers will
    never join fail at once whatever the timeout.
    """
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"debug_launcher: num_processes must be a positive int, got {num_processes!r}")
    _simulate(function, tuple(args), num_processes, "cpu", "no", timeout)


def _gpu_count() -> int:
    from accel.utils.imports import is_cuda_available

    if not is_cuda_available():
        return 0
    import torch

    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):  # count without initialising CUDA before the fork
        return torch.cuda.device_count()


def _xla_process(index: int, function: Callable[..., Any], environment: dict[str, str], *args: Any) -> Any:
    """Inside one TPU core's process: `xmp.spawn` passes the core's index first, the function does not take it."""
    return _call_with_environment(function, environment, *args)


def _launch_on_tpu_cores(function: Callable[..., Any], args: tuple, num_processes: int | None, precision: str) -> None:
    from accel.state import AcceleratorState

    if AcceleratorState._shared_state:
        raise RuntimeError(
            "notebook_launcher on TPU: an Accelerator already exists in this process; create it only inside the "
            "launched function (restart the notebook kernel)"
        )
    import torch_xla.distributed.xla_multiprocessing as xmp

    print("Launching training on TPU cores.")
    # nprocs=None: one process per core, as torch_xla decides; fork keeps a notebook's function reachable.
    xmp.spawn(
        _xla_process, args=(function, {_PRECISION_ENV: precision}, *args), nprocs=num_processes, start_method="fork"
    )


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    simulate: str | None = None,
    timeout: float | None = None,
) -> None:
    """Run a training function (e.g. defined in a notebook cell) on several processes.

    On a TPU host (torch_xla with a TPU): one process per TPU core, through
    `torch_xla`'s `xmp.spawn`. Otherwise, without `simulate`: one process per GPU when GPUs are present (`num_processes`
    defaults to their number), otherwise `num_processes` CPU processes, started by
    torch's elastic launcher (`torch.distributed.launcher.api.elastic_launch`) with the
    rendezvous arguments given here (multi-node with `num_nodes`/`node_rank`). With one
    process the function simply runs here. No Accelerator may exist in this process
    before the call: create it inside `function`.

    `simulate="cpu"|"cuda"|"xla"` runs the function on `num_processes` simulated
    devices of accel's simulator instead (simulated GPUs or TPU cores on this machine;
    `timeout` then bounds the run). `mixed_precision` ("no", "fp16", "bf16", "fp8")
    applies inside the ranks.
    """
    precision = _precision(mixed_precision)
    if simulate is not None:
        if num_processes is None:
            raise ValueError(
                f"notebook_launcher(simulate={simulate!r}) needs num_processes: how many devices to simulate"
            )
        _simulate(function, tuple(args), num_processes, simulate, precision, timeout)
        return
    from accel.utils.imports import is_torch_xla_available

    if is_torch_xla_available(check_is_tpu=True):
        _launch_on_tpu_cores(function, tuple(args), num_processes, precision)
        return
    rendezvous = _Rendezvous(
        num_nodes, node_rank, master_addr, use_port, rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id
    )
    _launch_elastic(
        function, args, num_processes, precision, rendezvous, max_restarts, monitor_interval, log_line_prefix_template
    )


@dataclasses.dataclass(frozen=True)
class _Rendezvous:
    """Where the processes of an elastic launch meet: `notebook_launcher`'s node and rendezvous arguments."""

    num_nodes: int
    node_rank: int
    master_addr: str
    port: str
    backend: str
    endpoint: str
    conf: dict[str, Any] | None
    run_id: str


def _launch_elastic(
    function: Callable[..., Any],
    args: tuple,
    num_processes: int | None,
    precision: str,
    rendezvous: _Rendezvous,
    max_restarts: int,
    monitor_interval: float,
    log_line_prefix_template: str | None,
) -> None:
    """Run `function(*args)` on this node's processes (one per GPU by default, else CPU ones) through
    torch's elastic launcher; one process on one node simply calls it here."""
    if rendezvous.node_rank >= rendezvous.num_nodes:
        raise ValueError(
            f"notebook_launcher: node_rank ({rendezvous.node_rank}) must be less than "
            f"num_nodes ({rendezvous.num_nodes})"
        )
    gpus = _gpu_count()
    if num_processes is None:
        if gpus == 0:
            raise ValueError(
                "notebook_launcher: no GPU here, so say how many CPU processes to start with num_processes=..., "
                "or simulate devices with simulate='cuda' or 'xla'"
            )
        num_processes = gpus
    if num_processes == 1 and rendezvous.num_nodes == 1:
        with patch_environment(**{_PRECISION_ENV: precision}):
            function(*args)
        return
    _refuse_initialised_state("notebook_launcher")
    from torch.distributed.launcher.api import elastic_launch

    config = _launch_config(num_processes, rendezvous, max_restarts, monitor_interval, log_line_prefix_template)
    nodes = f" per node, on {rendezvous.num_nodes} nodes" if rendezvous.num_nodes > 1 else ""
    print(f"Launching training on {num_processes} {'GPU' if gpus else 'CPU'} processes{nodes}.")
    environment = {
        _PRECISION_ENV: precision,
        "MASTER_ADDR": rendezvous.master_addr,
        "MASTER_PORT": str(rendezvous.port),
    }
    if not gpus:
        environment["ACCEL_USE_CPU"] = "1"
    with patch_environment(**environment):
        elastic_launch(config=config, entrypoint=function)(*args)


def _launch_config(
    num_processes: int,
    rendezvous: _Rendezvous,
    max_restarts: int,
    monitor_interval: float,
    log_line_prefix_template: str | None,
) -> Any:
    """torch's elastic launch configuration: `num_processes` per node, meeting as `rendezvous` says (a static
    rendezvous is machine 0's address, with this node's rank)."""
    from torch.distributed.launcher.api import LaunchConfig

    conf = dict(rendezvous.conf or {})
    endpoint = rendezvous.endpoint
    if rendezvous.backend == "static":
        conf["rank"] = rendezvous.node_rank
        endpoint = endpoint or f"{rendezvous.master_addr}:{rendezvous.port}"
    return LaunchConfig(
        min_nodes=rendezvous.num_nodes,
        max_nodes=rendezvous.num_nodes,
        nproc_per_node=num_processes,
        run_id=rendezvous.run_id,
        rdzv_endpoint=endpoint,
        rdzv_backend=rendezvous.backend,
        rdzv_configs=conf,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        # fork: a function defined in a notebook cell reaches the processes without pickling
        start_method="fork",
        log_line_prefix_template=log_line_prefix_template,
    )


__all__ = ["debug_launcher", "notebook_launcher"]
