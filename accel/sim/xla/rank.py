"""What the runtime asks of a simulated TPU rank (the protocol: `accel.sim.devices`)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from accel.sim.xla import bridge, device

#: the accel backend `ACCEL_BACKEND` names in these ranks
BACKEND = "xla"
#: directory holding the stand-in `torch_xla` package (on `sys.path` in xla ranks only)
STUB_PATH = str(Path(__file__).resolve().parent / "stub")


def prepare() -> None:
    """The process's simulated TPU core, and the stand-in `torch_xla` the real XLA backend imports."""
    device.install()
    _install_stub()


def reset() -> None:
    bridge.reset()
    _install_stub()  # the launcher may have restored sys.path between tests: keep torch_xla findable
    importlib.import_module("torch_xla._sim_state").reset()


def _install_stub() -> None:
    if STUB_PATH not in sys.path:
        sys.path.insert(0, STUB_PATH)
    importlib.invalidate_caches()
    module = importlib.import_module("torch_xla")
    # (a stand-in still being imported, whose `import torch` booted a simulated node, is the stand-in)
    if not getattr(module, "SIMULATED", False) and not str(getattr(module, "__file__", "")).startswith(STUB_PATH):
        raise RuntimeError(
            f"a real torch_xla was already imported in this process ({module.__file__}); cannot simulate XLA"
        )
    # Registers the `xla` process-group backend and the `xla://` init method.
    importlib.import_module("torch_xla.distributed.xla_backend")
