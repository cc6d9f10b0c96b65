"""Lazy re-exports, so that `import accel` stays cheap (see benchmarks/bench_import.py)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, table: dict[str, list[str]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Build a module `__getattr__`/`__dir__` pair that imports `name` from its module on first use."""
    where = {name: module for module, names in table.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals_of_package = importlib.import_module(package).__dict__
        globals_of_package[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(where)

    return __getattr__, __dir__
