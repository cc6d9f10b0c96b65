"""`torch_xla.amp.syncfree`: optimizers whose `step(found_inf=...)` skips the update without a host sync.

torch_xla computes the skip on the device; the simulator's tensors are computed eagerly,
so these are torch's optimizers whose step is skipped when `found_inf` is non-zero (the
step count does not advance either, as in torch_xla's).
"""

from __future__ import annotations

from typing import Any

import torch


def _step(optimizer: torch.optim.Optimizer, base: Any, closure: Any, found_inf: torch.Tensor | None) -> Any:
    if found_inf is None:
        return base.step(optimizer, closure=closure)
    if found_inf.shape:
        raise ValueError("The found_inf tensor has to be scalar type")
    if bool(found_inf.item()):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()
    return base.step(optimizer, closure=closure)


class SGD(torch.optim.SGD):
    """torch.optim.SGD with `step(closure=None, found_inf=None)`."""

    def step(self, closure: Any = None, found_inf: torch.Tensor | None = None) -> Any:
        return _step(self, torch.optim.SGD, closure, found_inf)


class Adam(torch.optim.Adam):
    """torch.optim.Adam with `step(closure=None, found_inf=None)`."""

    def step(self, closure: Any = None, found_inf: torch.Tensor | None = None) -> Any:
        return _step(self, torch.optim.Adam, closure, found_inf)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with `step(closure=None, found_inf=None)`."""

    def step(self, closure: Any = None, found_inf: torch.Tensor | None = None) -> Any:
        return _step(self, torch.optim.AdamW, closure, found_inf)
