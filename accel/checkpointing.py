"""Training checkpoints: what `Accelerator.save_state` writes and `load_state` reads back.

A checkpoint is a folder:

    model.bin, model_1.bin, ...          state dicts of the prepared models (main process)
    optimizer.bin, optimizer_1.bin, ...  optimizer state dicts (main process)
    scheduler.bin, ...                   scheduler state dicts (main process)
    scaler.pt                            the fp16 GradScaler (main process)
    dataloader_<i>_rank<r>.bin           each data loader's position, per rank
    random_states_<r>.pkl                every RNG of rank r (python, numpy, torch, device)
    custom_checkpoint_<i>.pkl            objects given to register_for_checkpointing (main process)

Models, optimizers and schedulers are identical on every rank in data-parallel training,
so the main process writes them once; RNG states and data-loader positions belong to
each rank. Every file is written atomically (see `accel.utils.save`), with tensors moved
to the CPU first so that loading does not depend on the device that saved.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from accel.utils.save import atomic_save

MODEL_NAME = "model"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
DATALOADER_NAME = "dataloader"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
CUSTOM_NAME = "custom_checkpoint"
CHECKPOINTS_DIR = "checkpoints"
_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


def indexed_name(stem: str, index: int, suffix: str = ".bin") -> str:
    """`stem.bin` for the first object of a kind, `stem_<i>.bin` for the next ones."""
    return f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}"


def to_cpu(value: Any) -> Any:
    """`value` with every tensor inside (nested dicts, lists, tuples) moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    return value


def save_file(obj: Any, path: str) -> None:
    """Atomic `torch.save` of `obj` with its tensors on the CPU."""
    atomic_save(to_cpu(obj), path)


def load_file(path: str, map_location: Any = "cpu") -> Any:
    """Read a file written by `save_file` (our own files: full unpickling is allowed)."""
    return torch.load(path, map_location=map_location, weights_only=False)


# -- random number generators ---------------------------------------------------------


def capture_rng_state(hardware: Any) -> dict[str, Any]:
    """Every RNG this process draws from: python, numpy, torch CPU and the device's own."""
    import numpy as np

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": hardware.get_rng_state(),
    }


def restore_rng_state(states: dict[str, Any], hardware: Any) -> None:
    """Put back the RNG states captured by `capture_rng_state`."""
    import numpy as np

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("device") is not None:
        hardware.set_rng_state(states["device"])


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
    write_shared: bool,
) -> None:
    """Write this rank's part of a checkpoint into `output_dir` (which must exist).

    `write_shared` is True on the one process that writes what all ranks share.
    """
    if write_shared:
        for i, state in enumerate(model_states):
            save_file(state, os.path.join(output_dir, indexed_name(MODEL_NAME, i)))
        for i, opt in enumerate(optimizers):
            save_file(opt.state_dict(), os.path.join(output_dir, indexed_name(OPTIMIZER_NAME, i)))
        for i, sched in enumerate(schedulers):
            save_file(sched.state_dict(), os.path.join(output_dir, indexed_name(SCHEDULER_NAME, i)))
        if scaler is not None:
            save_file(scaler.state_dict(), os.path.join(output_dir, SCALER_NAME))
        for i, obj in enumerate(custom_objects):
            save_file(obj.state_dict(), os.path.join(output_dir, f"{CUSTOM_NAME}_{i}.pkl"))
    for i, loader in enumerate(dataloaders):
        state = dataloader_state(loader)
        if state is not None:
            save_file(state, os.path.join(output_dir, f"{DATALOADER_NAME}_{i}_rank{process_index}.bin"))
    save_file(rng_state, os.path.join(output_dir, f"{RNG_STATE_NAME}_{process_index}.pkl"))


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
) -> None:
    """Restore everything `save_checkpoint` wrote into the live objects, on every rank.

    `models` are the unwrapped modules; they load on their own device.
    """
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"no checkpoint folder at {input_dir!r}")
    for i, model in enumerate(models):
        state = load_file(_required(os.path.join(input_dir, indexed_name(MODEL_NAME, i)), f"model {i}"))
        model.load_state_dict(state, strict=strict)
    for i, opt in enumerate(optimizers):
        opt.load_state_dict(
            load_file(_required(os.path.join(input_dir, indexed_name(OPTIMIZER_NAME, i)), f"optimizer {i}"))
        )
    for i, sched in enumerate(schedulers):
        sched.load_state_dict(
            load_file(_required(os.path.join(input_dir, indexed_name(SCHEDULER_NAME, i)), f"scheduler {i}"))
        )
    if scaler is not None:
        scaler.load_state_dict(load_file(_required(os.path.join(input_dir, SCALER_NAME), "the fp16 GradScaler")))
    for i, obj in enumerate(custom_objects):
        obj.load_state_dict(
            load_file(_required(os.path.join(input_dir, f"{CUSTOM_NAME}_{i}.pkl"), f"custom object {i}"))
        )
    for i, loader in enumerate(dataloaders):
        load_state_dict = getattr(loader, "load_state_dict", None)
        if not callable(load_state_dict):
            continue
        # A rank that did not exist when saving (more processes now) takes rank 0's position.
        path = os.path.join(input_dir, f"{DATALOADER_NAME}_{i}_rank{process_index}.bin")
        if not os.path.exists(path):
            path = os.path.join(input_dir, f"{DATALOADER_NAME}_{i}_rank0.bin")
        if os.path.exists(path):
            load_state_dict(load_file(path))
    rng_path = os.path.join(input_dir, f"{RNG_STATE_NAME}_{process_index}.pkl")
    if os.path.exists(rng_path):
        restore_rng_state(load_file(rng_path), hardware)
