"""CPU backend: one or many processes on CPUs, Gloo collectives."""

from __future__ import annotations

from accel.backends.base import Backend
from accel.utils.dataclasses import DistributedType


class CPUBackend(Backend):
    """Plain CPUs; always available, the fallback of the registry."""

    name = "cpu"
    comm_backend = "gloo"
    autocast_device_type = "cpu"
    multi_process_type = DistributedType.MULTI_CPU
    priority = 0

    @classmethod
    def is_available(cls) -> bool:
        return True
