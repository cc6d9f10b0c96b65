"""Simulated devices: what a rank process installs before it creates its process group.

The launcher calls `prepare_rank(device)` once in each freshly started rank (after the
launcher's environment variables are set, before `PartialState()`), and
`reset_rank(device)` in a warm rank between tests. Each device is made of a backend in
accel's registry, named by `ACCEL_BACKEND`, plus whatever the user's code must see:

* "cpu": the real CPU backend, nothing faked.
* "cuda": `accel.sim.cuda.fake` — LOCAL_WORLD_SIZE simulated GPUs whose CUDA tensors
  live in host memory, `torch.cuda` answering as on a GPU host, and the real CUDA
  backend on them with a "nccl" group carried by Gloo.
* "xla": `accel.sim.xla.device` — the process's simulated TPU core, whose tensors are
  XLA tensors on `xla:0` held in host memory — and the stand-in `torch_xla` package in
  `xla/stub/`, put first on `sys.path` of this process only, so that the real XLA
  backend imports it as it would on a TPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from accel.backends import ENV_VAR, register_backend
from accel.sim.device_names import DEVICES
from accel.sim.runtime import adopt_group

#: directory holding the stand-in `torch_xla` package (on `sys.path` in xla ranks only)
FAKE_XLA_PATH = str(Path(__file__).resolve().parent / "xla" / "stub")


def _check(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"unknown simulated device {device!r}; choose one of {', '.join(DEVICES)}")


def prepare_rank(device: str) -> None:
    """Install the simulated `device` in this rank process and point `ACCEL_BACKEND` at it."""
    _check(device)
    if device == "cpu":
        os.environ[ENV_VAR] = "cpu"
    elif device == "cuda":
        from accel.sim.cuda import fake as fake_cuda

        fake_cuda.install()
        register_backend(fake_cuda.SimCUDABackend, replace=True)
        # Here torch.cuda says a GPU is present, so whatever asks the registry for "cuda"
        # (by name or by availability) must get the simulated backend, never NCCL.
        register_backend(fake_cuda.SimCUDABackend, "cuda", replace=True)
        os.environ[ENV_VAR] = fake_cuda.SimCUDABackend.name
    else:
        from accel.sim.xla import device as xla_device

        xla_device.install()
        _install_fake_xla()
        os.environ[ENV_VAR] = "xla"
    # A script's own init_process_group adopts or replaces the group the rank makes next.
    adopt_group.install(device)


def reset_rank(device: str) -> None:
    """Between tests in a warm rank: put the simulated device back in its start-up state."""
    _check(device)
    adopt_group.restore()  # the simulator's process group, if the last test replaced it
    if device == "cpu":
        os.environ[ENV_VAR] = "cpu"
    elif device == "cuda":
        from accel.sim.cuda import fake as fake_cuda

        fake_cuda.reset()
        os.environ[ENV_VAR] = fake_cuda.SimCUDABackend.name
    else:
        # The launcher may have restored sys.path between tests: keep torch_xla findable.
        from accel.sim.xla import bridge

        bridge.reset()
        _install_fake_xla()
        importlib.import_module("torch_xla._sim_state").reset()
        os.environ[ENV_VAR] = "xla"


def as_fresh_process() -> None:
    """Put the simulated device as a newly started process finds it, before a script runs.

    `accel launch --simulate` runs a script in a rank the simulator has already set up; on
    a GPU host a new process starts on `cuda:0` until it calls `torch.cuda.set_device`, so
    a script that forgets to pin its GPU puts every rank on GPU 0 and fails in its first
    NCCL collective ("Duplicate GPU detected"), here as on real hardware. (accel's own
    `PartialState` pins `cuda:LOCAL_RANK`, as on the hardware.)
    """
    fake_cuda = sys.modules.get("accel.sim.cuda.fake")  # installed in simulated GPU ranks only
    if fake_cuda is not None and fake_cuda.is_installed():
        fake_cuda.reset(local_rank=0, fresh=True)


def _install_fake_xla() -> None:
    if FAKE_XLA_PATH not in sys.path:
        sys.path.insert(0, FAKE_XLA_PATH)
    importlib.invalidate_caches()
    module = importlib.import_module("torch_xla")
    if not getattr(module, "SIMULATED", False):
        raise RuntimeError(
            f"a real torch_xla was already imported in this process ({module.__file__}); cannot simulate XLA"
        )
    # Registers the `xla` process-group backend and the `xla://` init method.
    importlib.import_module("torch_xla.distributed.xla_backend")
