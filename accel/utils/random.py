"""Seeding and synchronising random number generators across processes.

Device generators (CUDA, XLA) are reached through the active backend, so the same
calls work on every kind of hardware and on the simulator's fake devices.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable
from typing import Any

import torch

from accel.utils.dataclasses import RNGType


def _state() -> Any:
    from accel.state import PartialState

    return PartialState()


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python's `random`, NumPy, torch and the device's generator for reproducible runs.

    Args:
        seed: the seed.
        device_specific: add the process index to the seed, so that each process draws
            different numbers (e.g. for data augmentation).
        deterministic: also ask torch for deterministic algorithms (slower on GPUs).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"set_seed() needs an integer seed, got {seed!r}")
    state = _state()
    if device_specific:
        seed += state.process_index
    random.seed(seed)
    # NumPy is seeded only when the user's program uses it: importing it costs time.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    state.hardware.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: RNGType | str | None = None, generator: torch.Generator | None = None) -> None:
    """Give one generator on every process the state it has on the main process.

    `rng_type` is "torch" (the CPU generator), "cuda" / "xla" (the device generator of
    the active backend) or "generator" (the `generator` passed in).
    """
    rng_type = RNGType(rng_type) if rng_type is not None else RNGType.TORCH
    if rng_type not in (RNGType.TORCH, RNGType.GENERATOR, RNGType.CUDA, RNGType.XLA):
        raise NotImplementedError(
            f"synchronize_rng_state({rng_type.value!r}): accel runs on CPUs, CUDA GPUs and XLA devices only; "
            "use 'torch', 'cuda', 'xla' or 'generator'"
        )
    state = _state()
    hardware = state.hardware
    if rng_type == RNGType.TORCH:
        current = torch.get_rng_state()
    elif rng_type == RNGType.GENERATOR:
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs the generator to synchronise")
        current = generator.get_state()
    else:
        current = hardware.get_rng_state()
        if current is None:
            raise ValueError(
                f"Cannot synchronise the {rng_type.value!r} generator: the active hardware "
                f"({hardware.name}) has no device generator of its own"
            )
    if state.num_processes == 1:
        return
    host = current.device
    shared = hardware.broadcast(current.to(state.device), src=0).to(host)
    if rng_type == RNGType.TORCH:
        torch.set_rng_state(shared)
    elif rng_type == RNGType.GENERATOR:
        assert generator is not None  # checked above, before the collective
        generator.set_state(shared)
    else:
        hardware.set_rng_state(shared)


def synchronize_rng_states(rng_types: Iterable[RNGType | str], generator: torch.Generator | None = None) -> None:
    """`synchronize_rng_state` for each of `rng_types`."""
    for rng_type in rng_types:
        synchronize_rng_state(RNGType(rng_type), generator=generator)
