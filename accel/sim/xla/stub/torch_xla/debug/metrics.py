"""`torch_xla.debug.metrics` of the simulator: the counters the simulated device keeps.

XLA counts compilations, transfers and ops falling back to the CPU; the simulator runs
eagerly and keeps one counter, "MarkStep" (graph cuts: `torch_xla.sync` / `mark_step`,
the device loader's). Metrics (timings) are not kept: `metric_names()` is empty.
"""

from __future__ import annotations

from typing import Any

import torch_xla._sim_state as _state


def counter_names() -> list[str]:
    """Names of the counters that have a value."""
    return [name for name in ("MarkStep",) if counter_value(name)]


def counter_value(name: str) -> int | None:
    """A counter's value, or None for a counter never incremented."""
    if name == "MarkStep":
        value = _state.steps - _state.steps_cleared
        return value if value > 0 else None
    return None


def clear_counters() -> None:
    _state.steps_cleared = _state.steps


def metric_names() -> list[str]:
    return []


def metric_data(name: str) -> Any:
    return None


def clear_metrics() -> None:
    """Nothing to clear: no metrics are kept."""


def clear_all() -> None:
    clear_counters()
    clear_metrics()


def metrics_report() -> str:
    """The counters, in XLA's report layout."""
    return "".join(f"Counter: {name}\n  Value: {counter_value(name)}\n" for name in counter_names())


def short_metrics_report(counter_names: list[str] | None = None, metric_names: list[str] | None = None) -> str:
    return metrics_report()


def executed_fallback_ops() -> list[str]:
    """Ops that fell back to the CPU: none are tracked (every op runs on the CPU underneath)."""
    return []
