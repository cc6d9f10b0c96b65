"""Simulated devices: what a rank process installs before it creates its process group.

The launcher calls `prepare_rank(device)` once in each freshly started rank (after the
launcher's environment variables are set, before `PartialState()`), and
`reset_rank(device)` in a warm rank between tests. Each device is made of a backend in
accel's registry, named by `ACCEL_BACKEND`, plus whatever the user's code must see:

* "cpu": the real CPU backend, nothing faked (the one device without a subpackage).
* "cuda": `accel.sim.cuda` — LOCAL_WORLD_SIZE simulated GPUs whose CUDA tensors live in
  host memory, `torch.cuda` answering as on a GPU host, and the real CUDA backend on
  them with a "nccl" group carried by Gloo.
* "xla": `accel.sim.xla` — the process's simulated TPU core, whose tensors are XLA
  tensors on `xla:0` held in host memory — and the stand-in `torch_xla` package in
  `xla/stub/`, put first on `sys.path` of this process only, so that the real XLA
  backend imports it as it would on a TPU.

A new kind of simulated device is one new subpackage `accel/sim/<name>/` (found by its
files: `accel.sim.device_names.DEVICES`), whose module `accel.sim.<name>.rank` is all this
runtime asks of it (`accel/sim/cuda/rank.py`, `accel/sim/xla/rank.py`):

* `BACKEND`: the accel backend `ACCEL_BACKEND` names in its ranks;
* `prepare()`: install the device in a freshly started rank (and register `BACKEND`);
* `reset()`: put it back in its start-up state between tests in a warm rank;

and, where the default (the CPU's) does not fit:

* `as_fresh_process()`: put it as a newly started process finds it (`accel launch
  --simulate` runs a script in a rank the simulator set up; default: nothing to do);
* for a script's own `init_process_group` (`accel.sim.runtime.adopt_group`):
  `DEFAULT_BACKEND` (what `init_process_group()` without a backend picks; "gloo"),
  `HAS_NCCL` (whether "nccl" can be asked for; False), `EQUIVALENTS` (backends the
  simulator creates under names of its own -> the request each answers exactly; none),
  `to_torch(label)` (the backend torch must be given for a request; unchanged) and
  `to_user(backend)` (a backend as torch names it -> as the user's code knows it; unchanged).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from accel.backends import ENV_VAR
from accel.sim.device_names import DEVICES
from accel.sim.runtime import adopt_group

#: the stand-in `torch_xla` package (`accel.sim.xla.rank.STUB_PATH`), for what looks for it from outside a rank
FAKE_XLA_PATH = str(Path(__file__).resolve().parent / "xla" / "stub")


def rank_module(device: str) -> ModuleType | None:
    """What the runtime asks of simulated `device`: `accel.sim.<device>.rank` (None: no subpackage, the CPU)."""
    if device not in DEVICES:
        raise ValueError(f"unknown simulated device {device!r}; choose one of {', '.join(DEVICES)}")
    if importlib.util.find_spec(f"accel.sim.{device}") is None:
        return None
    return importlib.import_module(f"accel.sim.{device}.rank")


def prepare_rank(device: str) -> None:
    """Install the simulated `device` in this rank process and point `ACCEL_BACKEND` at it."""
    rank = rank_module(device)
    if rank is not None:
        rank.prepare()
    os.environ[ENV_VAR] = rank.BACKEND if rank is not None else device
    # A script's own init_process_group adopts or replaces the group the rank makes next.
    adopt_group.install(device, rank)


def reset_rank(device: str) -> None:
    """Between tests in a warm rank: put the simulated device back in its start-up state."""
    rank = rank_module(device)
    adopt_group.restore()  # the simulator's process group, if the last test replaced it
    if rank is not None:
        rank.reset()
    os.environ[ENV_VAR] = rank.BACKEND if rank is not None else device


def as_fresh_process() -> None:
    """Put the simulated device as a newly started process finds it, before a script runs.

    `accel launch --simulate` runs a script in a rank the simulator has already set up; on
    a GPU host a new process starts on `cuda:0` until it calls `torch.cuda.set_device`, so
    a script that forgets to pin its GPU puts every rank on GPU 0 and fails in its first
    NCCL collective ("Duplicate GPU detected"), here as on real hardware. (accel's own
    `PartialState` pins `cuda:LOCAL_RANK`, as on the hardware.)
    """
    for device in DEVICES:
        rank = sys.modules.get(f"accel.sim.{device}.rank")  # loaded by prepare_rank (each checks it is installed)
        fresh = getattr(rank, "as_fresh_process", None)
        if fresh is not None:
            fresh()
