"""`load`: `torch.load` that refuses arbitrary pickled code by default, yet reads the RNG states checkpoints hold."""

from __future__ import annotations

import codecs
from typing import Any

import torch


def _numpy_globals() -> list[Any]:
    """What pickles of NumPy arrays and dtypes (e.g. NumPy's RNG state in a checkpoint) reference."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed: list[Any] = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        allowed.extend(getattr(dtypes, name) for name in dir(dtypes) if name.endswith("DType"))
    return allowed


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """`torch.load(f, map_location, weights_only=True, ...)` with NumPy arrays and dtypes allowed.

    `weights_only=True` (the default here, as in Accelerate) unpickles tensors and plain
    data only, so a tampered file cannot run code; pass `weights_only=False` for files you
    trust that hold other objects.
    """
    kwargs.setdefault("weights_only", True)
    if not kwargs["weights_only"]:
        return torch.load(f, map_location=map_location, **kwargs)
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(f, map_location=map_location, **kwargs)
