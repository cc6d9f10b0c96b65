"""Small helpers that Accelerate keeps in `accelerate.utils.other` and users import from `accelerate.utils`."""

from __future__ import annotations

import functools
import socket
from typing import Any


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
    "extract_model_from_parallel",
    "id_tensor_storage",
    "is_compiled_module",
    "clean_state_dict_for_safetensors",
    "save",
]
