"""Training checkpoints: what `Accelerator.save_state` writes and `load_state` reads back.

A checkpoint is a folder laid out as Accelerate 1.15 lays it out, so that either library
resumes from the other's checkpoints:

    model.safetensors, model_1.safetensors, ...   the prepared models' weights (main process);
        pytorch_model.bin, pytorch_model_1.bin    with safe_serialization=False (pickled)
    optimizer.bin, optimizer_1.bin, ...           optimizer state dicts (main process)
    scheduler.bin, scheduler_1.bin, ...           scheduler state dicts (main process)
    dl_state_dict.bin, dl_state_dict_1.bin, ...   stateful data loaders (main process)
    scaler.pt                                     the fp16 GradScaler (main process)
    random_states_<r>.pkl                         every RNG of rank r and the accumulation step
    custom_checkpoint_<i>.pkl                     objects given to register_for_checkpointing

and, ours only (Accelerate ignores them): `dataloader_<i>_rank<r>.bin`, where each rank's
prepared data loader stood, so that a run resumes on the next batch.

Model weights are the user's model's state dict, without the prefixes that wrappers add
(`module.` for DistributedDataParallel), as Accelerate writes them; loading also accepts
weights saved through a wrapper (a model the user wrapped in DDP before preparing it).
Models, optimizers and schedulers are identical on every rank in data-parallel training,
so the main process writes them once (once per machine with `save_on_each_node`).
Every file is written atomically (see `accel.utils.saving`), tensors on the CPU.
"""

from __future__ import annotations

import codecs
import os
import random
import re
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from accel.utils.constants import (
    MODEL_NAME,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_MODEL_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
)
from accel.utils.saving import atomic_save, save

STATEFUL_LOADER_NAME = "dl_state_dict"
DATALOADER_NAME = "dataloader"
CUSTOM_NAME = "custom_checkpoint"
CHECKPOINTS_DIR = "checkpoints"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
_CUSTOM_RE = re.compile(rf"^{CUSTOM_NAME}_\d+\.pkl$")
# Prefixes that wrappers add to a model's state-dict keys (DistributedDataParallel, torch.compile).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# What an RNG state file holds besides tensors: numpy's state (an array and its dtype).
_NUMPY_CORE: Any = getattr(np, "_core", None) or getattr(np, "core")  # noqa: B009 (numpy 2 renamed it)
_RNG_FILE_GLOBALS: list[Any] = [
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
    codecs.encode,
    _NUMPY_CORE.multiarray._reconstruct,
]


def indexed_name(stem: str, index: int, suffix: str = ".bin") -> str:
    """`stem.bin` for the first object of a kind, `stem_<i>.bin` for the next ones."""
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def model_file_name(index: int, safe_serialization: bool) -> str:
    """`model.safetensors` / `model_1.safetensors`, or `pytorch_model.bin` / `pytorch_model_1.bin`."""
    if safe_serialization:
        return indexed_name(SAFE_MODEL_NAME, index, ".safetensors")
    return indexed_name(MODEL_NAME, index, ".bin")


def load_file(path: str | os.PathLike, trusted: bool = False) -> Any:
    """Read a pickled checkpoint file onto the CPU.

    Only tensors, containers and numpy RNG states are unpickled unless `trusted` (the
    state dicts of registered custom objects, which may hold anything, as in Accelerate).
    """
    if trusted:
        return torch.load(path, map_location="cpu", weights_only=False)
    with torch.serialization.safe_globals(_RNG_FILE_GLOBALS):
        return torch.load(path, map_location="cpu", weights_only=True)


# -- random number generators ---------------------------------------------------------


def capture_rng_state(hardware: Any, step: int) -> dict[str, Any]:
    """Every RNG this process draws from, and the accumulation step, under Accelerate's keys."""
    return {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
        **hardware.checkpoint_rng_states(),
    }


def restore_rng_state(states: dict[str, Any], hardware: Any) -> None:
    """Put back the RNG states captured by `capture_rng_state` (or by Accelerate's `save_state`)."""
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    hardware.restore_checkpoint_rng_states(states)


# -- automatic naming -------------------------------------------------------------------


def numbered_checkpoints(project_dir: str) -> list[tuple[int, str]]:
    """`(N, path)` of the `checkpoints/checkpoint_N` folders of a project, oldest first."""
    root = os.path.join(project_dir, CHECKPOINTS_DIR)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(root, name)):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def automatic_checkpoint_dir(project_dir: str, iteration: int) -> str:
    """Where automatic naming puts checkpoint number `iteration`."""
    return os.path.join(project_dir, CHECKPOINTS_DIR, f"checkpoint_{iteration}")


def prune_checkpoints(project_dir: str, total_limit: int | None, keep_room_for: int = 1) -> list[str]:
    """Delete the oldest numbered checkpoints so that `keep_room_for` more fit in `total_limit`.

    Returns the deleted folders.
    """
    if total_limit is None:
        return []
    existing = numbered_checkpoints(project_dir)
    excess = len(existing) + keep_room_for - total_limit
    removed = []
    for _, path in existing[: max(excess, 0)]:
        shutil.rmtree(path)
        removed.append(path)
    return removed


# -- model weights ------------------------------------------------------------------------


def read_model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict in a `.safetensors` or pickled `.bin` weights file, on the CPU."""
    if os.fspath(path).endswith(".safetensors"):
        from safetensors.torch import load_file as load_safetensors

        return load_safetensors(os.fspath(path), device="cpu")
    return load_file(path)


def _strip_wrapper_prefixes(state: dict[str, Any], target_keys: Sequence[str]) -> dict[str, Any]:
    # Strip a wrapper's prefix only when every saved key has it and the target's keys do not:
    # a model whose own first submodule is called `module` keeps its names.
    changed = True
    while changed and state:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state) and not all(k.startswith(prefix) for k in target_keys):
                state = {k[len(prefix) :]: v for k, v in state.items()}
                changed = True
    return state


def load_model_weights(model: torch.nn.Module, state: dict[str, Any], strict: bool = True, **kwargs: Any) -> None:
    """Load a saved state dict into the user's (unwrapped) `model`.

    Keys written through wrappers (`module.`, `_orig_mod.`) match the bare model's. A
    weight tied to another (one storage under two names) may be absent: safetensors
    files hold each storage once, and loading the name kept restores both.
    """
    target = model.state_dict(keep_vars=True)
    state = _strip_wrapper_prefixes(state, list(target))
    result = model.load_state_dict(state, strict=False, **kwargs)
    if not strict:
        return
    loaded_storages = {_storage_key(target[k]) for k in state if k in target and isinstance(target[k], torch.Tensor)}
    missing = [
        k
        for k in result.missing_keys
        if not (isinstance(target[k], torch.Tensor) and _storage_key(target[k]) in loaded_storages)
    ]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"the saved weights do not match {type(model).__name__}: missing {missing}, unexpected "
            f"{list(result.unexpected_keys)}; was the checkpoint saved from the same model? "
            "(load_state(..., strict=False) loads what matches)"
        )


def _storage_key(tensor: torch.Tensor) -> tuple[Any, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()


# -- writing and reading a checkpoint ----------------------------------------------------


def save_checkpoint(
    output_dir: str,
    *,
    model_states: Sequence[dict[str, Any]],
    optimizers: Sequence[Any],
    schedulers: Sequence[Any],
    dataloaders: Sequence[Any],
    custom_objects: Sequence[Any],
    scaler: Any,
    rng_state: dict[str, Any],
    process_index: int,
    save_on_each_node: bool = False,
    safe_serialization: bool = True,
) -> None:
    """Write this rank's part of a checkpoint into `output_dir` (which must exist).

    What every rank shares goes through `accel.utils.saving.save`, which writes it on the
    main process only (or once per machine with `save_on_each_node`).
    """

    def shared(obj: Any, name: str, safe: bool = False) -> None:
        save(obj, os.path.join(output_dir, name), save_on_each_node=save_on_each_node, safe_serialization=safe)

    for i, state in enumerate(model_states):
        shared(state, model_file_name(i, safe_serialization), safe=safe_serialization)
    for i, opt in enumerate(optimizers):
        shared(opt.state_dict(), indexed_name(OPTIMIZER_NAME, i))
    for i, sched in enumerate(schedulers):
        shared(sched.state_dict(), indexed_name(SCHEDULER_NAME, i))
    for i, loader in enumerate(dataloaders):
        position = dataloader_state(loader)
        if position is None:
            continue
        if getattr(loader, "use_stateful_dataloader", False):
            shared(_torchdata_state(position), indexed_name(STATEFUL_LOADER_NAME, i))
        atomic_save(_on_cpu(position), os.path.join(output_dir, f"{DATALOADER_NAME}_{i}_rank{process_index}.bin"))
    if scaler is not None:
        shared(scaler.state_dict(), SCALER_NAME)
    for i, obj in enumerate(custom_objects):
        shared(obj.state_dict(), f"{CUSTOM_NAME}_{i}.pkl")
    atomic_save(_on_cpu(rng_state), os.path.join(output_dir, f"{RNG_STATE_NAME}_{process_index}.pkl"))


def _on_cpu(value: Any) -> Any:
    from accel.utils.operations import recursively_apply

    return recursively_apply(lambda t: t.detach().cpu(), value)


def _torchdata_state(position: dict[str, Any]) -> Any:
    # What Accelerate's dl_state_dict.bin holds: torchdata's StatefulDataLoader state. A
    # DataLoaderShard's own state wraps it (with the epoch and shuffling state around it).
    return position.get("stateful_dataloader") if "batches_yielded" in position else position


def _from_torchdata_state(loader: Any, state: dict[str, Any]) -> dict[str, Any]:
    # The reverse: wrapped again for loaders whose own state is the wrapper (a checkpoint of
    # Accelerate's, which has no dataloader_<i>_rank<r>.bin of ours).
    own = dataloader_state(loader) or {}
    if "batches_yielded" in own:
        return {"batches_yielded": int(state.get("_num_yielded", 0)), "stateful_dataloader": state}
    return state


def dataloader_state(loader: Any) -> dict[str, Any] | None:
    """The position of a prepared data loader, or None when it cannot report one."""
    state_dict = getattr(loader, "state_dict", None)
    return state_dict() if callable(state_dict) else None


def _required(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"checkpoint is missing {what} ({path}); was it saved with the same objects prepared in the same order?"
        )
    return path


def find_model_file(input_dir: str, index: int) -> str:
    """The weights file of model `index` in a checkpoint: safetensors first, then pickled."""
    for safe in (True, False):
        path = os.path.join(input_dir, model_file_name(index, safe))
        if os.path.exists(path):
            return path
    return _required(
        os.path.join(input_dir, model_file_name(index, True)),
        f"model {index} ({model_file_name(index, True)} or {model_file_name(index, False)})",
    )


def load_checkpoint(
    input_dir: str,
    *,
    models: Sequence[torch.nn.Module],
    optimizers: Sequence[Any],
    schedulers: Sequence[Any],
    dataloaders: Sequence[Any],
    custom_objects: Sequence[Any],
    scaler: Any,
    hardware: Any,
    process_index: int,
    strict: bool = True,
    **load_model_kwargs: Any,
) -> dict[str, Any]:
    """Restore everything `save_checkpoint` (or Accelerate's `save_state`) wrote, on every rank.

    `models` are the user's unwrapped modules; they load on their own device. Returns
    this rank's saved RNG file (with the accumulation `step`), or {} where there is none.
    """
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"no checkpoint folder at {input_dir!r}")
    for i, model in enumerate(models):
        load_model_weights(model, read_model_weights(find_model_file(input_dir, i)), strict, **load_model_kwargs)
    for i, opt in enumerate(optimizers):
        name = indexed_name(OPTIMIZER_NAME, i)
        opt.load_state_dict(load_file(_required(os.path.join(input_dir, name), f"optimizer {i}")))
    for i, sched in enumerate(schedulers):
        name = indexed_name(SCHEDULER_NAME, i)
        sched.load_state_dict(load_file(_required(os.path.join(input_dir, name), f"scheduler {i}")))
    if scaler is not None:
        scaler.load_state_dict(load_file(_required(os.path.join(input_dir, SCALER_NAME), "the fp16 GradScaler")))
    _check_custom_count(input_dir, len(custom_objects))
    for i, obj in enumerate(custom_objects):
        path = _required(os.path.join(input_dir, f"{CUSTOM_NAME}_{i}.pkl"), f"custom object {i}")
        obj.load_state_dict(load_file(path, trusted=True))
    for i, loader in enumerate(dataloaders):
        state = _saved_loader_state(input_dir, i, loader, process_index)
        if state is not None:
            loader.load_state_dict(state)
    rng_path = os.path.join(input_dir, f"{RNG_STATE_NAME}_{process_index}.pkl")
    if not os.path.exists(rng_path):
        return {}
    states = load_file(rng_path)
    restore_rng_state(states, hardware)
    return states


def _check_custom_count(input_dir: str, registered: int) -> None:
    saved = [f for f in os.listdir(input_dir) if _CUSTOM_RE.match(f)]
    if len(saved) != registered:
        raise RuntimeError(
            f"{input_dir} holds {len(saved)} custom checkpoint(s) but {registered} object(s) are registered for "
            "checkpointing; register the same objects, in the same order, as when saving"
        )


def _saved_loader_state(input_dir: str, index: int, loader: Any, process_index: int) -> Any:
    if not callable(getattr(loader, "load_state_dict", None)):
        return None
    # A rank that did not exist when saving (more processes now) takes rank 0's position.
    for rank in (process_index, 0):
        path = os.path.join(input_dir, f"{DATALOADER_NAME}_{index}_rank{rank}.bin")
        if os.path.exists(path):
            return load_file(path)
    path = os.path.join(input_dir, indexed_name(STATEFUL_LOADER_NAME, index))
    if getattr(loader, "use_stateful_dataloader", False) and os.path.exists(path):
        state = load_file(path)
        return None if state is None else _from_torchdata_state(loader, state)
    return None
