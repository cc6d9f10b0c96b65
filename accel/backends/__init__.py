"""Registry of hardware backends; `select_backend()` picks the one this process uses.

The choice, first match wins: `cpu=True` forces the CPU; the environment variable
`ACCEL_BACKEND` names a registered backend (the simulator sets it in its ranks); else
the available backend of highest priority (xla > cuda > cpu).
"""

from __future__ import annotations

import os

from accel.backends.base import Backend
from accel.backends.cpu import CPUBackend
from accel.backends.cuda import CUDABackend
from accel.backends.xla import XLABackend

ENV_VAR = "ACCEL_BACKEND"

_REGISTRY: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend], name: str | None = None, *, replace: bool = False) -> type[Backend]:
    """Register a backend class under `name` (default: `cls.name`); usable as a decorator."""
    key = name or cls.name
    if key in _REGISTRY and _REGISTRY[key] is not cls and not replace:
        raise ValueError(
            f"a backend named {key!r} is already registered ({_REGISTRY[key].__name__}); pass replace=True"
        )
    _REGISTRY[key] = cls
    return cls


def unregister_backend(name: str) -> None:
    """Remove a registered backend (tests use it to clean up)."""
    _REGISTRY.pop(name, None)


def registered_backends() -> dict[str, type[Backend]]:
    """A copy of the registry: name -> backend class."""
    return dict(_REGISTRY)


def select_backend(cpu: bool = False) -> Backend:
    """Instantiate the backend this process should use (see the module docstring)."""
    if cpu:
        return _REGISTRY["cpu"]()
    wanted = os.environ.get(ENV_VAR, "").strip()
    if wanted:
        if wanted not in _REGISTRY:
            raise ValueError(f"{ENV_VAR}={wanted!r} names no registered backend; registered: {sorted(_REGISTRY)}")
        cls = _REGISTRY[wanted]
        if not cls.is_available():
            raise RuntimeError(f"{ENV_VAR}={wanted!r} was asked for but that hardware is not available here")
        return cls()
    available = [cls for cls in _REGISTRY.values() if cls.is_available()]
    return max(available, key=lambda cls: cls.priority)()


for _cls in (CPUBackend, CUDABackend, XLABackend):
    register_backend(_cls)

__all__ = [
    "Backend",
    "CPUBackend",
    "CUDABackend",
    "XLABackend",
    "register_backend",
    "unregister_backend",
    "registered_backends",
    "select_backend",
]
