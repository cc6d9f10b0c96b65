"""Interpreter start-up under `ACCEL_SIMULATE`: join the node, boot once torch is imported.

The package installs `accel_simulate.pth`, whose one line calls `start()` when the variable
is set (and costs an environment lookup when it is not). `start` refuses a bad value at once
(the message names the variable and its forms, exit status 2), joins or creates the node
(`tree`), passes the card and shapes-only settings on to the processes this one starts, and
boots the simulated device (`boot`) right after torch's own import, so that
`torch.cuda.device_count()` and every check made at import time (`TEST_CUDA` of PyTorch's
test bases) see the node's GPUs. A process that never imports torch pays only this.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

from accel.sim.node import tree
from accel.sim.node.spec import ENV, NodeSpec, SimulateSpecError, parse

#: the node this process is on, once `start` ran
_spec: list[NodeSpec] = []


def start() -> None:
    """Put this process on the node `ACCEL_SIMULATE` names (module docstring)."""
    if _spec:
        return
    try:
        spec = parse(os.environ[ENV])
    except SimulateSpecError as error:
        # At start-up an exception would only be printed by `site`, and the process would run
        # unsimulated: stop here, as a bad command-line option does.
        sys.stderr.write(f"accel: {error}\n")
        sys.stderr.flush()
        os._exit(2)
    _spec.append(spec)
    tree.join_or_create()
    _pass_on(spec)
    if spec.device == "xla":  # the stand-in torch_xla, importable before torch as on a TPU host
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "xla", "stub"))
    if "torch" in sys.modules:
        from accel.sim.node import boot

        boot.boot(spec)
    else:
        sys.meta_path.insert(0, _BootAfterTorch(spec))


def current() -> NodeSpec | None:
    """The node this process is on (None: not started under `ACCEL_SIMULATE`)."""
    return _spec[0] if _spec else None


def _pass_on(spec: NodeSpec) -> None:
    """The card and shapes-only settings as the simulator's ranks read them, for this process and its children."""
    if spec.gpu:
        os.environ["ACCEL_SIM_GPU"] = spec.gpu
    if spec.shapes_only:
        os.environ["ACCEL_SIM_SHAPES_ONLY"] = "1"


class _BootAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands torch's own spec a loader that boots the node after torch is imported."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            found = getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if found is not None:
                break
        else:
            return None
        if found.loader is not None:
            found.loader = _BootingLoader(found.loader, self.spec)
        return found


class _BootingLoader(importlib.abc.Loader):
    """torch's loader, followed by the node's boot."""

    def __init__(self, loader: Any, spec: NodeSpec) -> None:
        self._loader = loader
        self._spec = spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        from accel.sim.node import boot

        boot.boot(self._spec)

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: torch's loader answers
        return getattr(self._loader, name)
