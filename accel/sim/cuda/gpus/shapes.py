"""Shapes only: simulated GPUs that hold no data, to learn whether a model and batch fit on a card.

The question people most want answered before they rent GPUs, "does this step fit on N
cards of this kind, and at what peak?", needs every tensor of the real step but none of
its values. With ``ACCEL_SIM_SHAPES_ONLY=1`` (`accel launch --shapes_only`,
`accel.sim.launch(..., shapes_only=True)`, `@distributed_test(shapes_only=True)`) a
tensor of more than `SMALL` bytes put on a simulated GPU keeps its shape, dtype and
strides but no data (its inner tensor is on torch's meta device): ops compute the shapes
of their results, memory is counted as on the card, nothing is computed or stored on
the host, so a step that needs 70 GiB per GPU runs on a laptop in seconds.

Small tensors keep their data (indices, sizes, the metadata DDP exchanges, the bytes of
object collectives), and an op mixing both gives a result without data. What reads values
gets zeros (`.item()` is 0, `.cpu()` and `.tolist()` zeros), collectives on tensors without
data exchange nothing: losses and weights mean nothing in this mode, only shapes, memory
and the control flow that does not depend on values do.
"""

from __future__ import annotations

import os
from typing import Any

import torch

#: the environment variable that turns it on in a rank (read when CUDA starts)
SHAPES_ENV = "ACCEL_SIM_SHAPES_ONLY"
#: tensors up to this many bytes keep their data
SMALL = 64 * 1024

_META = torch.device("meta")
#: [True] while on (a list: callers on hot paths test its truth)
_on: list[bool] = []


def state() -> list[bool]:
    """The on/off list itself (changed in place)."""
    return _on


def configure() -> None:
    """Read ``ACCEL_SIM_SHAPES_ONLY`` (CUDA starts in the rank)."""
    value = os.environ.get(SHAPES_ENV, "0").strip().lower()
    if value in ("1", "true", "yes", "on"):
        _on[:] = [True]
    elif value in ("0", "false", "no", "off", ""):
        _on.clear()
    else:
        raise ValueError(f"{SHAPES_ENV}={value!r}: use 1 (simulated GPUs hold shapes only) or 0 (the default)")


def enabled() -> bool:
    return bool(_on)


def keeps_data(nbytes: int) -> bool:
    """Whether a tensor of `nbytes` made on a simulated GPU holds data."""
    return not _on or nbytes <= SMALL


def is_shape(inner: Any) -> bool:
    """Whether `inner` (a simulated GPU tensor's inner tensor) holds no data."""
    return isinstance(inner, torch.Tensor) and inner.is_meta


def on_host(inner: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What copying a data-less tensor to the host gives: zeros of its shape."""
    return torch.zeros(inner.shape, dtype=dtype or inner.dtype)


def value(inner: torch.Tensor) -> Any:
    """`.item()` of a data-less tensor: zero of its kind."""
    if inner.dtype is torch.bool:
        return False
    if inner.dtype.is_floating_point:
        return 0.0
    if inner.dtype.is_complex:
        return 0j
    return 0


def _has_shape(values: Any) -> bool:
    for item in values:
        if isinstance(item, torch.Tensor):
            if item.is_meta:
                return True
        elif isinstance(item, (list, tuple)) and _has_shape(item):
            return True
    return False


def _as_shape(item: Any, renamed: dict[int, int]) -> Any:
    if isinstance(item, torch.Tensor):
        if item.is_meta or (item.dim() == 0 and item.device.type == "cpu"):
            return item  # a 0-dim CPU tensor joins any device's tensors
        meta = item.to(_META)
        renamed[id(meta)] = id(item)
        return meta
    if isinstance(item, (list, tuple)) and item and any(isinstance(x, torch.Tensor) for x in item):
        return type(item)(_as_shape(x, renamed) for x in item)
    return item


def align(args: list, kwargs: dict, seen: dict[int, Any]) -> tuple[list, dict]:
    """An op's inner arguments, all without data when any is (the op then computes shapes only).

    `seen` (inner tensor id -> its wrapper) learns the stand-ins, so that an in-place op
    still returns the very wrapper it was given (whose data, if any, is left as it was).
    """
    if not (_has_shape(args) or (kwargs and _has_shape(kwargs.values()))):
        return args, kwargs
    renamed: dict[int, int] = {}
    args = [_as_shape(a, renamed) for a in args]
    kwargs = {k: _as_shape(v, renamed) for k, v in kwargs.items()} if kwargs else kwargs
    for new, old in renamed.items():
        if old in seen:
            seen[new] = seen[old]
    return args, kwargs
