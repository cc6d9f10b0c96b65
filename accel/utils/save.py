"""Saving: atomic writes (a crash mid-save never leaves a truncated file where a good one was), and `save`.

The object is written to a temporary file in the destination's directory (same
filesystem), flushed to disk, then moved over the destination with `os.replace`, which
is atomic on POSIX and Windows.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch


def atomic_save(obj: Any, path: str | os.PathLike, writer: Callable[[Any, Any], None] = torch.save) -> None:
    """Write `obj` to `path` with `writer(obj, file_object)`, atomically.

    A file-like `path` (anything with `write`) is written directly: there is no name to
    replace.
    """
    if hasattr(path, "write"):
        writer(obj, path)
        return
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            writer(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Leave the previous file (if any) untouched and no temporary behind.
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _without_shared_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses tensors sharing memory: keep the first name of each storage, contiguous."""
    seen: set[tuple[Any, int, tuple[int, ...]]] = set()
    out: dict[str, Any] = {}
    for name, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            key = (value.device, value.untyped_storage().data_ptr(), tuple(value.shape))
            if value.numel() and key in seen:
                continue  # a tied weight: loading the first name restores both
            seen.add(key)
            value = value.contiguous()
        out[name] = value
    return out


def _safetensors_writer(obj: Any, handle: Any) -> None:
    try:
        from safetensors.torch import save as safetensors_bytes
    except ImportError as error:
        raise ImportError("save(..., safe_serialization=True) needs safetensors: pip install safetensors") from error
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise TypeError(
            "save(..., safe_serialization=True) writes a flat dict of tensors (e.g. model.state_dict()), got "
            f"{type(obj).__name__}; pass safe_serialization=False to pickle other objects"
        )
    handle.write(safetensors_bytes(_without_shared_tensors(obj), metadata={"format": "pt"}))


def save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    """`torch.save` for distributed runs: written once (by the main process, or once per machine with
    `save_on_each_node`), atomically, with every tensor moved to the CPU first.

    `safe_serialization=True` writes a safetensors file (a flat dict of tensors, such as a
    state dict; weights tied to one storage are written once).
    """
    from accel.state import PartialState
    from accel.utils.operations import recursively_apply

    state = PartialState()
    writes = state.is_local_main_process if save_on_each_node else state.is_main_process
    if not writes:
        return
    on_cpu = recursively_apply(lambda t: t.detach().cpu(), obj)
    atomic_save(on_cpu, f, _safetensors_writer if safe_serialization else torch.save)
