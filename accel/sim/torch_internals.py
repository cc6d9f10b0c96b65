"""Moved to `accel.sim.core.torch_internals` (the one home of private torch APIs); this name stays for importers.

Importing it gives the very module `accel.sim.core.torch_internals` (one set of patches,
one `_KEEP_ALIVE`), so code importing either name shares its state.
"""

from __future__ import annotations

import sys

from accel.sim.core import torch_internals as _moved
from accel.sim.core.torch_internals import group_device_types, object_collective_device, parse_to

__all__ = ["group_device_types", "object_collective_device", "parse_to"]

sys.modules[__name__] = _moved
