"""`torch.autocast("cuda")` on simulated GPUs: CUDA's policy, applied by the core's autocast kernels.

CUDA's autocast kernels are compiled into the CUDA library, which a CPU-only build does
not have. The simulated tensors sit on the hidden PrivateUse1 device, whose autocast key
gets one Python kernel per op of CUDA's lists (read from the header torch ships, see
`torch_internals.autocast_op_lists`), through the core's `accel.sim.core.autocast`:
"lower" ops run in the autocast dtype, "fp32" ops in float32, "fp32_opt" ops get
`dtype=float32` when none was given, "promote" ops run in the widest dtype of their
inputs. Entering `torch.autocast("cuda")` also turns the hidden device's autocast on with
the same dtype. Only simulated CUDA tensors are cast, as CUDA's autocast only casts CUDA tensors.
"""

from __future__ import annotations

from accel.sim.core import torch_internals
from accel.sim.core.autocast import Autocast
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.tensors.cuda_tensor import SimCudaTensor

AUTOCAST = Autocast("cuda", cuda_state.HIDDEN_DEVICE, SimCudaTensor)


def install() -> int:
    """Register CUDA's autocast policy for simulated GPUs; returns how many ops it covers."""
    return AUTOCAST.install(torch_internals.autocast_op_lists())


def reset() -> None:
    """Between tests: autocast off on the simulated GPUs, its cache empty."""
    AUTOCAST.reset()
