"""Which module issued a kernel, for the names in a step's trace (only when a trace is asked for).

Forward: the innermost `nn.Module` whose `forward` is on the Python stack, named by its path in the
outermost one there (`layers.3.attention.wq`), as `named_modules` names it. Backward runs in
autograd's engine, not in `forward`: its kernels are named by the autograd node running them
(`MmBackward0`). Found by walking the stack, not by module hooks: hooks would change what
`torch.compile` traces, and so the run being timed. Kernels of compiled code name the module that
called the compiled region.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

import torch

from accel.sim.core import torch_internals

#: root module -> {id(module): its path in the root}
_paths: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()


def _modules_on_stack() -> list[torch.nn.Module]:
    """The modules whose `forward` is running, innermost first."""
    found: list[torch.nn.Module] = []
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "forward":
            module = frame.f_locals.get("self")
            if (
                isinstance(module, torch.nn.Module)
                and not isinstance(module, torch.fx.GraphModule)  # Dynamo's graph: the compiled module is outside
                and (not found or found[-1] is not module)
            ):
                found.append(module)
        frame = frame.f_back
    return found


def _path(root: torch.nn.Module, module: torch.nn.Module) -> str:
    paths = _paths.get(root)
    if paths is None or id(module) not in paths:
        paths = {id(m): name for name, m in root.named_modules()}
        _paths[root] = paths
    return paths.get(id(module)) or type(module).__name__


def where() -> str:
    """Where the op issued now comes from: a module's path, an autograd node's name, or "" (neither)."""
    node: Any = torch_internals.current_autograd_node()
    if node is not None:
        return str(node.name())
    modules = _modules_on_stack()
    if not modules:
        return ""
    inner, root = modules[0], modules[-1]
    if inner is root:
        return type(root).__name__
    return _path(root, inner).replace("._orig_mod", "")  # torch.compile's wrapper of a module adds nothing
