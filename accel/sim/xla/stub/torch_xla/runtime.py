"""`torch_xla.runtime` of the simulator: the PJRT topology, read from the launcher's environment.

A simulated TPU rank is one process driving one XLA device (as torch_xla runs under PJRT
with one process per chip), so ordinals are the process ranks set by the launcher
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE). SPMD is not simulated: `use_spmd`
refuses by name.
"""

from __future__ import annotations

import os

import torch_xla._sim_state as _state

#: torch_xla's names of the environment variables read here
PJRT_DEVICE = "PJRT_DEVICE"


def _env(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def set_device_type(pjrt_device: str) -> None:
    """Set the PJRT device type ("TPU", "CPU", ...): as torch_xla, refused once the runtime is in use."""
    current = os.environ.get(PJRT_DEVICE)
    if current is not None and current != pjrt_device and _state.steps:
        raise RuntimeError("Can't change device type after XLA runtime is initialized")
    os.environ[PJRT_DEVICE] = pjrt_device


def device_type() -> str | None:
    """The PJRT device kind being simulated ("TPU" unless PJRT_DEVICE says otherwise)."""
    device = os.environ.get(PJRT_DEVICE, "TPU")
    return device.split("_")[0] if device else device


def is_bf16_supported() -> bool:
    """TPUs compute in bfloat16."""
    return True


def world_size() -> int:
    """Number of processes (one XLA device each) in the job."""
    return _env("WORLD_SIZE", 1)


def global_ordinal() -> int:
    """This process's ordinal in the job, in [0, global_device_count())."""
    return _env("RANK", 0)


def local_process_count() -> int:
    """Number of XLA processes on this host."""
    return _env("LOCAL_WORLD_SIZE", world_size())


def addressable_device_count() -> int:
    """Devices this process drives: one."""
    return 1


def addressable_runtime_device_count() -> int:
    """Runtime devices this process drives: one."""
    return 1


def global_device_count() -> int:
    """Devices in the job: one per process."""
    return world_size()


def global_runtime_device_count() -> int:
    """Runtime devices in the job: one per process."""
    return world_size()


def local_device_count() -> int:
    """Devices on this host: one per local process."""
    return local_process_count() * addressable_device_count()


def local_ordinal() -> int:
    """This process's ordinal on its host, in [0, local_device_count())."""
    return _env("LOCAL_RANK", global_ordinal()) * addressable_device_count()


def process_index() -> int:
    """This process's index in the job."""
    return global_ordinal()


def process_count() -> int:
    """Number of processes in the job."""
    return world_size()


def host_index() -> int:
    """Index of this host: the simulator runs every rank on one host."""
    return 0


def get_master_ip() -> str:
    """The master worker's address: the launcher's MASTER_ADDR."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def using_pjrt() -> bool:
    """Always True: PJRT is the only runtime of today's torch_xla."""
    return True


def use_spmd(auto: bool | None = False) -> None:
    """Refused: SPMD (one process driving every device of a host as one virtual device) is not simulated."""
    raise NotImplementedError(
        "torch_xla.runtime.use_spmd (accel simulator): SPMD is not simulated; a simulated TPU rank is one process "
        "driving one device, as in torch_xla's multi-process (xmp / torch_xla.launch) mode. Use data parallelism "
        "(xm.optimizer_step, or DDP on the 'xla' process group) under `accel launch --simulate xla`."
    )


def is_spmd() -> bool:
    """False: SPMD is not simulated (`use_spmd` refuses)."""
    return False


def initialize_cache(path: str, readonly: bool = False) -> None:
    """Set the persistent compilation cache's location (the simulator compiles nothing, so it stays empty).

    As torch_xla, a second call in a process fails ("Computation cache has already been initialized").
    """
    assert _state.cache_path is None, "Computation cache has already been initialized"
    _state.cache_path = path
    os.environ["XLA_PERSISTENT_CACHE_PATH"] = path
    os.environ["XLA_PERSISTENT_CACHE_READ_ONLY"] = "1" if readonly else "0"


def get_num_cached_compilation_graph() -> int:
    """Number of compiled graphs in the cache: none, the simulator runs eagerly."""
    return 0
