"""Accelerate's FSDP checkpoint helpers (`accelerate.utils.fsdp_utils`), on accel's FSDP2 strategy.

- `save_fsdp_model` / `load_fsdp_model` and `save_fsdp_optimizer` / `load_fsdp_optimizer`: one
  model's (optimizer's) state in Accelerate's FSDP layout, as `save_state` writes it: a
  distributed checkpoint folder `pytorch_model_fsdp_{i}/` (`optimizer_{i}/`) for a
  `SHARDED_STATE_DICT` plugin, `pytorch_model_fsdp.bin` (`optimizer.bin`) written by rank 0 for
  a `FULL_STATE_DICT` one;
- `merge_fsdp_weights`: a sharded distributed checkpoint merged into one
  `model.safetensors` (or `pytorch_model.bin`) on the main process, on CPU (also the
  `accel merge-weights` command).

FSDP1 plugins are refused as `Accelerator` refuses them (accel runs FSDP2 only).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "disable_fsdp_ram_efficient_loading",
    "enable_fsdp_ram_efficient_loading",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "merge_fsdp_weights",
    "save_fsdp_model",
    "save_fsdp_optimizer",
]


def enable_fsdp_ram_efficient_loading() -> None:
    """Ask for RAM-efficient loading of Transformers models under FSDP (`FSDP_CPU_RAM_EFFICIENT_LOADING`):
    only rank 0 reads the weights, the others build empty models (Transformers reads the variable, and
    `ACCELERATE_USE_FSDP`, which is set to true when unset)."""
    os.environ.setdefault("ACCELERATE_USE_FSDP", "True")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "True"


def disable_fsdp_ram_efficient_loading() -> None:
    """Turn RAM-efficient loading of Transformers models under FSDP off (`FSDP_CPU_RAM_EFFICIENT_LOADING`)."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "False"


def _strategy(fsdp_plugin: Any, adapter_only: bool, use_dcp: bool) -> Any:
    from accel.fsdp import FSDP1_REFUSED, FSDP2Strategy
    from accel.utils.dataclasses import FullyShardedDataParallelPlugin

    if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError(f"expected a FullyShardedDataParallelPlugin, got {type(fsdp_plugin).__name__}")
    if fsdp_plugin.fsdp_version != 2:
        raise NotImplementedError(FSDP1_REFUSED)
    if adapter_only:
        raise NotImplementedError(
            "adapter_only=True (saving or loading the PEFT adapter's weights only) is not offered by accel: save "
            "the whole model, or use PEFT's own get_peft_model_state_dict on the full state dict"
        )
    if not use_dcp:
        raise NotImplementedError(
            "use_dcp=False (per-rank torch.save shards) is not offered by accel: sharded checkpoints are "
            "distributed checkpoints (use_dcp=True, the default), which any number of ranks can read back"
        )
    return FSDP2Strategy(fsdp_plugin)


def save_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Save `model` (prepared with FSDP2) into `output_dir` in Accelerate's FSDP layout; every rank calls it."""
    _strategy(fsdp_plugin, adapter_only, use_dcp).save_model(accelerator, model, os.fspath(output_dir), model_index)


def load_fsdp_model(
    fsdp_plugin: Any,
    accelerator: Any,
    model: nn.Module,
    input_dir: str | os.PathLike[str],
    model_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Load what `save_fsdp_model` wrote into `model` (prepared with FSDP2); every rank calls it.

    `input_dir` is the checkpoint folder, or (sharded state dicts) the distributed checkpoint's own folder.
    """
    _strategy(fsdp_plugin, adapter_only, use_dcp).load_model(accelerator, model, os.fspath(input_dir), model_index)


def save_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: nn.Module,
    output_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    use_dcp: bool = True,
) -> None:
    """Save `optimizer` (over `model`'s sharded parameters) into `output_dir` in Accelerate's FSDP layout."""
    strategy = _strategy(fsdp_plugin, False, use_dcp)
    strategy.save_optimizer(accelerator, optimizer, model, os.fspath(output_dir), optimizer_index)


def load_fsdp_optimizer(
    fsdp_plugin: Any,
    accelerator: Any,
    optimizer: Any,
    model: nn.Module,
    input_dir: str | os.PathLike[str],
    optimizer_index: int = 0,
    adapter_only: bool = False,
    use_dcp: bool = True,
) -> None:
    """Load what `save_fsdp_optimizer` wrote into `optimizer` (over `model`'s sharded parameters)."""
    strategy = _strategy(fsdp_plugin, adapter_only, use_dcp)
    strategy.load_optimizer(accelerator, optimizer, model, os.fspath(input_dir), optimizer_index)


def _nest(flat: dict[str, Any], paths: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """Rebuild the nested state a distributed checkpoint flattened (`paths`: each flat key's path of keys)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        node: Any = root
        for step, following in zip(path[:-1], path[1:], strict=True):
            empty: Any = [] if isinstance(following, int) else {}
            if isinstance(node, list):
                while len(node) <= step:
                    node.append(None)
                if node[step] is None:
                    node[step] = empty
                node = node[step]
            else:
                node = node.setdefault(step, empty)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return root


def read_distributed_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole state a distributed checkpoint holds, unsharded on the CPU, read by this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(os.fspath(checkpoint_dir))
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = None  # a pickled object: the loader puts it in its place
    with warnings.catch_warnings():
        # torch warns that it reads in one process (no_dist), which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(flat, storage_reader=reader, no_dist=True)
    return _nest(flat, dict(metadata.planner_data or {}))


def _not_a_checkpoint(folder: Path) -> ValueError:
    message = f"Tried to load from {folder} but couldn't find a valid metadata file."
    model, optimizer = folder / "pytorch_model_fsdp_0", folder / "optimizer_0"
    if model.exists() and optimizer.exists():
        message += f" It holds a model and an optimizer checkpoint: pass {model} or {optimizer} instead."
    elif model.exists():
        message += f" It holds a model checkpoint: pass {model} instead."
    elif optimizer.exists():
        message += f" It holds an optimizer checkpoint: pass {optimizer} instead."
    return ValueError(message)


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> None:
    """Merge a sharded FSDP checkpoint (a `SHARDED_STATE_DICT` save: `pytorch_model_fsdp_0/`, or
    `optimizer_0/`) into one file, `{output_path}/model.safetensors` (`pytorch_model.bin` when not
    `safe_serialization`).

    The main process reads every shard on the CPU and writes the file (it needs the whole state in
    memory); the others wait for it. `remove_checkpoint_dir` deletes the sharded checkpoint afterwards.
    """
    from accel.state import PartialState
    from accel.utils.constants import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
    from accel.utils.saving import save

    folder = Path(checkpoint_dir)
    if not (folder / ".metadata").is_file():
        raise _not_a_checkpoint(folder)
    state = PartialState()
    if state.is_main_process:
        logger.info("Merging FSDP weights from %s", folder)
        merged = read_distributed_checkpoint(folder)
        if len(merged) == 1:  # {"model": {...}} as save_fsdp_model writes it
            merged = next(iter(merged.values()))
        target = Path(output_path)
        target.mkdir(parents=True, exist_ok=True)
        target = target / (SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME)
        save(merged, target, safe_serialization=safe_serialization)
        logger.info("Merged FSDP weights saved to %s", target)
        if remove_checkpoint_dir:
            logger.info("Removing the sharded checkpoint %s", folder)
            shutil.rmtree(folder)
    state.wait_for_everyone()
