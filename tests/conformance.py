"""What the conformance test compares: the public names of accelerate==1.15.0 and how their signatures match ours.

Kept apart from the test so that the rules can be read (and reused, e.g. to draft the
data file for a new Accelerate release) without pytest.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import types
from collections.abc import Iterable
from typing import Any

#: each Accelerate module of the scope, and where its names live in accel
MODULES = {
    "accelerate": "accel",
    "accelerate.utils": "accel.utils",
    "accelerate.data_loader": "accel.data_loader",
    "accelerate.state": "accel.state",
    "accelerate.optimizer": "accel.optimizer",
    "accelerate.scheduler": "accel.scheduler",
    "accelerate.logging": "accel.logging",
    "accelerate.launchers": "accel.launchers",
}
#: the pseudo-module whose names are Accelerator's public methods and properties
ACCELERATOR = "accelerate.Accelerator"
#: modules that re-export names from elsewhere: every public name counts
NAMESPACES = {"accelerate", "accelerate.utils"}


def peer_names(scope: str) -> list[str]:
    """The public names of an Accelerate module (or of `Accelerator`) that users can import or call.

    For the namespaces (`accelerate`, `accelerate.utils`) every public non-module name;
    for the other modules the classes and functions they define (not what they import).
    """
    if scope == ACCELERATOR:
        from accelerate import Accelerator

        return sorted(n for n in dir(Accelerator) if not n.startswith("_"))
    module = importlib.import_module(scope)
    names = []
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        if scope in NAMESPACES or getattr(value, "__module__", None) == scope:
            names.append(name)
    return sorted(names)


def resolve(scope: str, name: str, ours: bool) -> Any:
    """The object called `name` in Accelerate's `scope` (`ours=False`) or at accel's matching place."""
    if scope == ACCELERATOR:
        owner: Any = importlib.import_module("accel" if ours else "accelerate").Accelerator
        return inspect.getattr_static(owner, name)
    module = importlib.import_module(MODULES[scope] if ours else scope)
    return getattr(module, name)


def _same_default(a: Any, b: Any) -> bool:
    """Whether our default `b` stands for the peer's `a` (a default where the peer has none only adds calls)."""
    if a is inspect.Parameter.empty:
        return True
    if b is inspect.Parameter.empty:
        return False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool | enum.Enum):
        return a == b and not isinstance(b, bool)
    if type(a) is object and type(b) is object:
        return True  # both "not given" sentinels
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        return str(getattr(a, "value", a)) == str(getattr(b, "value", b))
    if callable(a) and callable(b):
        return getattr(a, "__name__", None) == getattr(b, "__name__", None)
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # objects whose == raises (e.g. tensors) cannot be the same default
        return False


def _opaque_wrapper_target(func: Any) -> Any:
    """The function inside a decorator wrapper that hides it (`_inner(*args, **kwargs)` without `__wrapped__`)."""
    for cell in getattr(func, "__closure__", None) or ():
        inner = cell.cell_contents
        if inspect.isfunction(inner):
            return inner
    return None


def _signature(obj: Any) -> inspect.Signature | None:
    target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None
    kinds = [p.kind for p in signature.parameters.values()]
    if kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        # Accelerate's process decorators (`on_main_process`, ...) hide the signature: compare the function inside.
        inner = _opaque_wrapper_target(target)
        if inner is not None:
            return inspect.signature(inner)
    return signature


def signature_differences(peer: Any, ours: Any, ignore: Iterable[str] = ()) -> list[str]:
    """Why `ours` cannot be called as `peer` is; empty when it can.

    Every parameter of the peer (but those in `ignore`) is present, in the same
    position, of the same kind, with the same default (or a default where the peer has
    none); our extra parameters come after them and have defaults (or are `*args` /
    `**kwargs`).
    """
    ignored = set(ignore)
    if isinstance(peer, property) or isinstance(ours, property):
        return [] if isinstance(ours, property) == isinstance(peer, property) else ["property on one side only"]
    if isinstance(peer, type) and issubclass(peer, enum.Enum):
        if not (isinstance(ours, type) and issubclass(ours, enum.Enum)):
            return ["not an enum"]
        missing = {str(m.value) for m in peer} - {str(m.value) for m in ours}
        return [f"missing members {sorted(missing)}"] if missing else []
    if not callable(peer):
        return [] if _same_default(peer, ours) else [f"value {ours!r} instead of {peer!r}"]
    theirs, mine = _signature(peer), _signature(ours)
    if theirs is None:
        return []  # a builtin without a signature: existence is all we can check
    if mine is None:
        return ["no signature"]
    peer_params = [p for p in theirs.parameters.values() if p.name not in ("self", "cls") and p.name not in ignored]
    our_params = [p for p in mine.parameters.values() if p.name not in ("self", "cls") and p.name not in ignored]
    problems = []
    for i, p in enumerate(peer_params):
        q = our_params[i] if i < len(our_params) else None
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if not any(o.kind == p.kind for o in our_params):
                problems.append(f"missing {'*' if p.kind == p.VAR_POSITIONAL else '**'}{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY:
            q = mine.parameters.get(p.name)
        if q is None or q.name != p.name:
            problems.append(f"parameter {i} is {q.name if q else 'missing'!s}, not {p.name}")
            continue
        if q.kind != p.kind and not (p.kind is p.KEYWORD_ONLY and q.kind is q.POSITIONAL_OR_KEYWORD):
            problems.append(f"{p.name} is {q.kind.description}, not {p.kind.description}")
        if not _same_default(p.default, q.default):
            problems.append(f"{p.name}={q.default!r} instead of {p.default!r}")
    names = {p.name for p in peer_params}
    for q in our_params[len(peer_params) :]:
        if q.name not in names and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            problems.append(f"extra parameter {q.name} without a default")
    return problems
