"""`torch_xla.amp.autocast`: `torch.autocast("xla")` in bfloat16, the only dtype TPU autocast takes.

As torch_xla's: the device must be an XLA device, the default dtype on a TPU is bfloat16,
and another dtype warns and disables autocast. Which ops it casts is the "xla" autocast
policy of the tensors' device (`accel.sim.xla`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

import torch_xla.core.xla_model as xm
from accel.sim.xla import bridge


def _is_xla_device(device: Any) -> bool:
    return "xla" in str(device) or str(device) in xm.get_xla_supported_devices() or device == bridge.xla_device()


class autocast(torch.amp.autocast_mode.autocast):
    """`torch.autocast` for XLA devices: on a TPU, `torch.autocast("xla", dtype=torch.bfloat16)`."""

    def __init__(
        self, device: Any, enabled: bool = True, dtype: torch.dtype | None = None, cache_enabled: bool = True
    ) -> None:
        assert _is_xla_device(device), "torch_xla.autocast is available for XLA:TPU"
        self._enabled = enabled
        self._xla_device = xm.xla_device_hw(device)
        if dtype is None:
            dtype = torch.bfloat16
        if dtype != torch.bfloat16:
            warnings.warn(
                "In XLA:TPU autocast, but the target dtype is not supported. Disabling autocast.\n"
                "TPU Autocast only supports dtype of torch.bfloat16 currently.",
                stacklevel=2,
            )
            enabled = False
        self._dtype = dtype
        super().__init__("xla", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)
