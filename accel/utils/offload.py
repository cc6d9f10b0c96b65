"""Weights offloaded to disk, in Accelerate's layout: one raw memory-mapped file per tensor
(`<name>.dat`) and an `index.json` giving each one's dtype and shape.

bfloat16 and float8 tensors, which NumPy cannot hold, are stored as the integers of the same
width and read back as what they were. `OffloadedWeightsLoader` serves such a folder (and,
optionally, tensors kept in memory) as a read-only mapping, reading each tensor when asked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

INDEX_NAME = "index.json"


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict | None:
    """Write `weight` to `offload_folder/<weight_name>.dat`; record its dtype and shape in `index` (returned)."""
    recorded = None
    name = str(weight.dtype).replace("torch.", "")
    if weight.dtype == torch.bfloat16:
        weight, recorded = weight.view(torch.int16), "bfloat16"
    elif name.startswith("float8_"):
        weight, recorded = weight.view(torch.int8), name
    array = weight.detach().cpu().numpy()
    if index is not None:
        index[weight_name] = {"dtype": recorded or str(array.dtype), "shape": list(array.shape)}
    if array.ndim == 0:
        array = array[None]  # a memory map has at least one dimension
    stored = np.memmap(
        os.path.join(offload_folder, f"{weight_name}.dat"), dtype=array.dtype, mode="w+", shape=array.shape
    )
    stored[:] = array[:]
    stored.flush()
    return index


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: dict[str, Any]) -> torch.Tensor:
    """Read back a tensor written by `offload_weight` (`weight_info`: its `index.json` entry)."""
    shape = tuple(weight_info["shape"])
    dtype = weight_info["dtype"]
    stored_as = "int16" if dtype == "bfloat16" else "int8" if dtype.startswith("float8_") else dtype
    array = np.memmap(weight_file, dtype=stored_as, shape=shape or (1,), mode="r")
    tensor = torch.tensor(array[0] if not shape else np.asarray(array))
    if dtype == "bfloat16" or dtype.startswith("float8_"):
        tensor = tensor.view(getattr(torch, dtype))
    return tensor


def save_offload_index(index: dict | None, offload_folder: str | os.PathLike) -> None:
    """Merge `index` into `offload_folder/index.json` (created if needed)."""
    if not index:
        return
    path = os.path.join(offload_folder, INDEX_NAME)
    current: dict = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            current = json.load(handle)
    current.update(index)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(current, handle, indent=2)


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of `state_dict` to `save_dir` (one file each, plus the index)."""
    os.makedirs(save_dir, exist_ok=True)
    index: dict = {}
    for name, tensor in state_dict.items():
        offload_weight(tensor, name, save_dir, index=index)
    save_offload_index(index, save_dir)


class OffloadedWeightsLoader(Mapping):
    """Tensors by name: those of `state_dict` (in memory), then those offloaded in `save_folder` (read on access).

    `index` defaults to the folder's `index.json`.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping[str, Any] | None = None,
        device: Any = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index")
        self.state_dict = dict(state_dict or {})
        self.save_folder = save_folder
        if index is None and save_folder is not None:
            path = os.path.join(save_folder, INDEX_NAME)
            index = {}
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as handle:
                    index = json.load(handle)
        self.index = dict(index or {})
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self.device = device

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        info = self.index[key]
        if self.save_folder is None:
            raise KeyError(f"{key} is offloaded to disk but this loader has no save_folder to read it from")
        tensor = load_offloaded_weight(os.path.join(self.save_folder, f"{key}.dat"), info)
        return tensor if self.device is None else tensor.to(self.device)

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)
