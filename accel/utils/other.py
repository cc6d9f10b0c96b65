"""Small helpers that Accelerate keeps in `accelerate.utils.other` and users import from `accelerate.utils`."""

from __future__ import annotations

import functools
import platform
import re
import socket
from typing import Any

from accel.logging import get_logger


def wait_for_everyone() -> None:
    """Block until every process reaches this point (`PartialState().wait_for_everyone()`)."""
    from accel.state import PartialState

    PartialState().wait_for_everyone()


def merge_dicts(source: dict[Any, Any], destination: dict[Any, Any]) -> dict[Any, Any]:
    """Merge `source` into `destination`, recursively for nested dicts, in place; returns `destination`."""
    for key, value in source.items():
        if isinstance(value, dict):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


def recursive_getattr(obj: Any, attr: str) -> Any:
    """`getattr` along a dotted path: `recursive_getattr(model, "encoder.layer")`."""
    return functools.reduce(getattr, attr.split("."), obj)


def get_pretty_name(obj: Any) -> str:
    """A readable name for `obj`: its qualified name, or its class's for instances."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    if hasattr(obj, "__qualname__"):
        return str(obj.__qualname__)
    if hasattr(obj, "__name__"):
        return str(obj.__name__)
    return str(obj)


def convert_bytes(size: float) -> str:
    """`size` bytes in the largest unit that keeps it at least 1 ("1.5 MB"; units of 1024)."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on `port` (default 29500, torch.distributed's) of localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("localhost", 29500 if port is None else port)) == 0


#: oldest Linux kernel on which multi-process runs are known not to hang
MIN_KERNEL = (5, 5, 0)


def check_os_kernel() -> None:
    """Warn (main process only) when the Linux kernel is older than 5.5, where distributed runs can hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if found is None:
        return
    version = tuple(int(part) for part in found.groups())
    if version < MIN_KERNEL:
        # the logger keeps the name it had when this lived in accel.utils.environment (filters may name it)
        get_logger("accel.utils.environment").warning(
            f"Detected kernel version {'.'.join(map(str, version))}, older than the recommended minimum "
            f"{'.'.join(map(str, MIN_KERNEL))}: processes can hang. Upgrade the kernel to avoid it.",
            main_process_only=True,
        )


# Accelerate keeps these in accelerate.utils.other too; users import them from there.
from accel.utils.modeling import extract_model_from_parallel, id_tensor_storage, is_compiled_module  # noqa: E402
from accel.utils.saving import clean_state_dict_for_safetensors, save  # noqa: E402

__all__ = [
    "wait_for_everyone",
    "merge_dicts",
    "recursive_getattr",
    "get_pretty_name",
    "convert_bytes",
    "is_port_in_use",
    "check_os_kernel",
    "extract_model_from_parallel",
    "id_tensor_storage",
    "is_compiled_module",
    "clean_state_dict_for_safetensors",
    "save",
]
