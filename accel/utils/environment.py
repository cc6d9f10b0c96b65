"""Reading configuration from environment variables."""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def env_flag(name: str, default: bool = False) -> bool:
    """Value of a boolean environment variable; an unrecognised value is an error, not False."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no")


def env_int(name: str, default: int) -> int:
    """Value of an integer environment variable, with a clear error when it is not one."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None
