"""Saving: atomic writes (a crash mid-save never leaves a truncated file where a good one was), `save`, model weights.

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


def clean_state_dict_for_safetensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop, in place, the names of tensors that share memory with an earlier one (tied weights), which
    safetensors refuses, and make the others contiguous; returns `state_dict`.

    Loading the file restores a tied weight through its first name; the dropped names are logged.
    """
    kept = _without_shared_tensors_logged(state_dict)
    state_dict.clear()
    state_dict.update(kept)
    return state_dict


def _without_shared_tensors_logged(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`_without_shared_tensors`, with a warning naming the tensors left out (as Accelerate warns)."""
    kept = _without_shared_tensors(state_dict)
    dropped = [name for name in state_dict if name not in kept]
    if dropped:
        import logging

        logging.getLogger(__name__).warning(
            f"Removed shared tensor {dropped} while saving: they share memory with tensors saved under another "
            "name, and loading the file restores them through that name"
        )
    return kept


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
    if safe_serialization and isinstance(obj, dict):
        obj = _without_shared_tensors_logged(obj)  # before the copies to the CPU, which no longer share memory
    on_cpu = recursively_apply(lambda t: t.detach().cpu(), obj)
    atomic_save(on_cpu, f, _safetensors_writer if safe_serialization else torch.save)


# -- model weights as Hugging Face libraries lay them out ----------------------------------

_SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_shard_size(size: int | str) -> int:
    """Bytes in a shard size: an int, or digits and a decimal unit ("10GB", "5MB", "100KB")."""
    if isinstance(size, int):
        return size
    text = size.strip()
    unit = text[-2:].upper()
    if unit not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size={size!r}: give bytes, or a number with one of the units {list(_SIZE_UNITS)}")
    try:
        return int(float(text[:-2]) * _SIZE_UNITS[unit])
    except ValueError as error:
        raise ValueError(f"max_shard_size={size!r}: {text[:-2]!r} is not a number") from error


def split_into_shards(state_dict: dict[str, Any], max_shard_size: int) -> list[dict[str, Any]]:
    """Group a state dict into shards of at most `max_shard_size` bytes, in key order.

    A tensor larger than the limit gets a shard of its own; tensors sharing a storage
    stay in the shard of the first one. Sizes count whole storages, as the Hub does.
    """
    shards: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    current_size = 0
    shard_of_storage: dict[tuple[Any, int], dict[str, Any]] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = (tensor.device, tensor.untyped_storage().data_ptr())
        if tensor.numel() and storage in shard_of_storage:
            shard_of_storage[storage][name] = tensor
            continue
        size = tensor.untyped_storage().nbytes()
        if size > max_shard_size:
            shard: dict[str, Any] = {name: tensor}
            shards.append(shard)
        else:
            if current and current_size + size > max_shard_size:
                shards.append(current)
                current, current_size = {}, 0
            current[name] = tensor
            current_size += size
            shard = current
        if tensor.numel():
            shard_of_storage[storage] = shard
    if current:
        shards.append(current)
    return shards


def write_model_weights(
    state_dict: dict[str, Any],
    save_directory: str,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    writes: bool = True,
) -> list[str]:
    """Write `state_dict` into `save_directory` as `transformers` saves and loads it.

    One `model.safetensors` (pickled `pytorch_model.bin` with `safe_serialization=False`),
    or past `max_shard_size` the shards `model-0000i-of-0000N.safetensors` with the index
    `model.safetensors.index.json` (`{"metadata": {"total_size"}, "weight_map"}`). Shards
    and index of an earlier save that this one does not replace are removed. Only the process with `writes` touches the
    disk. Returns the names of the weight files.
    """
    import json
    import re

    limit = parse_shard_size(max_shard_size)
    state_dict = _without_shared_tensors(state_dict) if safe_serialization else dict(state_dict)
    from accel.utils.constants import MODEL_NAME, SAFE_MODEL_NAME

    stem, suffix = (SAFE_MODEL_NAME, ".safetensors") if safe_serialization else (MODEL_NAME, ".bin")
    shards = split_into_shards(state_dict, limit)
    count = len(shards)
    names = [f"{stem}{suffix}"] if count <= 1 else [f"{stem}-{i + 1:05d}-of-{count:05d}{suffix}" for i in range(count)]
    if not writes:
        return names
    os.makedirs(save_directory, exist_ok=True)
    stale = re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(suffix)}")
    index_name = f"{stem}{suffix}.index.json"
    for existing in os.listdir(save_directory):
        if (stale.fullmatch(existing) and existing not in names) or (existing == index_name and count <= 1):
            os.remove(os.path.join(save_directory, existing))
    writer = _safetensors_writer if safe_serialization else torch.save
    for name, shard in zip(names, shards or [{}], strict=True):
        on_cpu = {key: value.detach().cpu() for key, value in shard.items()}
        atomic_save(on_cpu, os.path.join(save_directory, name), writer)
    if count > 1:
        total = 0
        seen: set[tuple[Any, int]] = set()
        for tensor in state_dict.values():
            if isinstance(tensor, torch.Tensor):
                storage = (tensor.device, tensor.untyped_storage().data_ptr())
                if storage not in seen or not tensor.numel():
                    seen.add(storage)
                    total += tensor.untyped_storage().nbytes()
        index = {
            "metadata": {"total_size": total},
            "weight_map": {key: name for name, shard in zip(names, shards, strict=True) for key in shard},
        }
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        atomic_save(text, os.path.join(save_directory, index_name), lambda obj, handle: handle.write(obj.encode()))
    return names
