"""Stand-in `torch_xla` of the accel simulator: XLA's API on CPU tensors and Gloo.

Importable only inside a simulated rank (see `accel.sim.devices.prepare_rank`). The
device of every "XLA" tensor is the CPU; collectives run on the default process group,
which the `xla` backend of `torch_xla.distributed.xla_backend` builds on Gloo.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+accel.sim"

#: lets code (and tests) tell the simulator's torch_xla from the real one
SIMULATED = True


def device(index: int | None = None) -> torch.device:
    """The XLA device of this process (the CPU in the simulator)."""
    return torch.device("cpu")


def sync(wait: bool = False) -> None:
    """Cut the lazy graph (newer spelling of `xm.mark_step`)."""
    from torch_xla.core import xla_model

    xla_model.mark_step(wait=wait)
