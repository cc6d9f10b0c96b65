"""`torch_xla.runtime` of the simulator: the topology, read from the launcher's environment.

A simulated rank is one process with one XLA device, so ordinals are the process ranks
set by the launcher (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE).
"""

from __future__ import annotations

import os


def _env(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value else default


def world_size() -> int:
    """Number of XLA processes (replicas) in the job."""
    return _env("WORLD_SIZE", 1)


def global_ordinal() -> int:
    """This process's rank in the job."""
    return _env("RANK", 0)


def local_ordinal() -> int:
    """This process's rank on its host."""
    return _env("LOCAL_RANK", global_ordinal())


def local_process_count() -> int:
    """Number of XLA processes on this host."""
    return _env("LOCAL_WORLD_SIZE", world_size())


def process_index() -> int:
    """Alias of `global_ordinal` (one device per process here)."""
    return global_ordinal()


def process_count() -> int:
    """Alias of `world_size` (one device per process here)."""
    return world_size()


def addressable_device_count() -> int:
    """Devices this process drives: one."""
    return 1


def global_device_count() -> int:
    """Devices in the job: one per process."""
    return world_size()


def local_device_count() -> int:
    """Devices on this host: one per local process."""
    return local_process_count()


def device_type() -> str:
    """The PJRT device kind being simulated ("TPU" unless PJRT_DEVICE says otherwise)."""
    return os.environ.get("PJRT_DEVICE", "TPU")


def using_pjrt() -> bool:
    """Always True: the PJRT runtime is what recent torch_xla uses."""
    return True
