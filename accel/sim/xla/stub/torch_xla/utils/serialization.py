"""`torch_xla.utils.serialization` (`xser`): checkpoints with each XLA tensor in a file of its own.

As torch_xla's: `save(data, path)` writes `path` (the data, its XLA tensors replaced by
references) and `path + ".tensors/tensor_<i>.pt"` (each tensor, on the CPU), by the master
only unless `master_only=False`; `load(path)` gives the data back with CPU tensors.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

import torch_xla.utils.utils as xu
from accel.sim.xla import bridge


class TensorReference:
    """Stands for the tensor saved in `tensor_<tid>.pt`."""

    def __init__(self, tid: int) -> None:
        self.tid = tid


def _get_tensors_folder(path: str) -> str:
    return str(path) + ".tensors"


def _get_tensor_file(path: str, tid: int) -> str:
    return os.path.join(path, f"tensor_{tid}.pt")


def _rewrite_data(path: str, data: Any, save_tensors: bool) -> Any:
    if save_tensors:
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.mkdir(path)
    count = [0]

    def convert(tensor: torch.Tensor) -> TensorReference:
        tid = count[0]
        count[0] += 1
        if save_tensors:
            torch.save(tensor.cpu(), _get_tensor_file(path, tid))
        return TensorReference(tid)

    def select(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and bridge.is_xla_tensor(value)

    return xu.for_each_instance_rewrite(data, select, convert)


def save(data: Any, path: str, master_only: bool = True, global_master: bool = False) -> None:
    """Save `data` (its XLA tensors each in a file of `path + ".tensors"`), by the master unless `master_only=False`."""
    import torch_xla.core.xla_model as xm

    should_write_data = not master_only or xm.is_master_ordinal(local=not global_master)
    ref_data = _rewrite_data(_get_tensors_folder(path), data, should_write_data)
    if should_write_data:
        torch.save(ref_data, path)


def load(path: str) -> Any:
    """The data `save` wrote at `path`, with its tensors on the CPU."""
    ref_data = torch.load(path, weights_only=False)
    folder = _get_tensors_folder(path)

    def select(value: Any) -> bool:
        return type(value) is TensorReference

    def convert(ref: TensorReference) -> torch.Tensor:
        tensor: torch.Tensor = torch.load(_get_tensor_file(folder, ref.tid))
        return tensor

    return xu.for_each_instance_rewrite(ref_data, select, convert)
