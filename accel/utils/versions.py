"""Comparing installed versions (of torch or any package) with a requirement."""

from __future__ import annotations

import importlib.metadata
import operator
from collections.abc import Callable
from typing import Any

#: the comparison operators a requirement may use
OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def compare_versions(library_or_version: Any, operation: str, requirement_version: str) -> bool:
    """Whether `library_or_version` (an installed package's name, or a `packaging` Version) `operation` the
    requirement, e.g. `compare_versions("torch", ">=", "2.4")`."""
    from packaging.version import parse

    if operation not in OPERATIONS:
        raise ValueError(f"compare_versions: operation must be one of {list(OPERATIONS)}, got {operation!r}")
    if isinstance(library_or_version, str):
        library_or_version = parse(importlib.metadata.version(library_or_version))
    return OPERATIONS[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the installed torch `operation` `version`, e.g. `is_torch_version(">=", "2.4")`."""
    from packaging.version import parse

    return compare_versions(parse(importlib.metadata.version("torch")), operation, version)
