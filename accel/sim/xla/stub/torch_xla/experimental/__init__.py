"""`torch_xla.experimental` of the simulator: the eager-mode switch (FSDPv2 is refused in its own module).

torch_xla's eager mode runs each op as it comes, outside `torch_xla.compile`d functions;
the simulated TPU always runs so. The switch is kept, so that a program asking whether
it is on reads back what it set, as on a TPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch_xla._sim_state as _state

__all__ = ["eager_mode", "eager_mode_context", "is_eager_mode"]


def eager_mode(enable: bool) -> None:
    """Set torch_xla's default execution mode (the simulator runs eagerly either way)."""
    _state.eager_mode = bool(enable)


def is_eager_mode() -> bool:
    """Whether eager mode was set (torch_xla's default: off)."""
    return _state.eager_mode


@contextlib.contextmanager
def eager_mode_context(enable: bool) -> Iterator[bool]:
    """Eager mode set to `enable` inside the block; yields the mode before it."""
    saved = is_eager_mode()
    eager_mode(enable)
    try:
        yield saved
    finally:
        eager_mode(saved)
