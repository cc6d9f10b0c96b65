"""Reading configuration from environment variables, and changing them for a while (tests, launchers)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def convert_dict_to_env_variables(current_env: dict[str, str]) -> list[str]:
    """`KEY=value\\n` lines of the items of `current_env` that are safe to write to an environment file.

    Items whose key or value is empty or holds one of `;`, newline, `<`, `>` or a space are
    left out, each with a warning.
    """
    forbidden = (";", "\n", "<", ">", " ")
    lines = []
    for key, value in current_env.items():
        text = f"{key}{value}"
        if key and value and not any(char in text for char in forbidden):
            lines.append(f"{key}={value}\n")
        else:
            logger.warning(f"Skipping {key}={value}: it is empty or contains one of {list(forbidden)}")
    return lines


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


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """1 (or True with `to_bool`) for y/yes/t/true/on/1, 0 (False) for n/no/f/false/off/0; ValueError otherwise."""
    lowered = value.lower()
    if lowered in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if lowered in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}: use one of y/yes/t/true/on/1 or n/no/f/false/off/0")


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """The boolean value of environment variable `key` (see `str_to_bool`), `default` when unset."""
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    """The value of environment variable `key`, `default` when unset."""
    return os.environ.get(key, str(default))


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first non-negative integer among the environment variables `env_keys`, else `default`."""
    for key in env_keys:
        value = int(os.environ.get(key, -1))
        if value >= 0:
            return value
    return default


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty `os.environ`; the previous environment is back afterwards, exactly."""
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set environment variables for the duration of the block.

    Names are upper-cased and values converted with `str`; on exit each variable gets its
    previous value back, or is removed if it did not exist.
    """
    saved: dict[str, str | None] = {}
    for key, value in kwargs.items():
        key = key.upper()
        saved.setdefault(key, os.environ.get(key))
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


#: prefixes of the variables `purge_accelerate_environment` restores: Accelerate's and ours
PURGED_PREFIXES = ("ACCELERATE_", "ACCEL_")

_PURGED_MARK = "_accel_purged_environment"


@contextlib.contextmanager
def _restored_prefixed_variables() -> Iterator[None]:
    before = {k: v for k, v in os.environ.items() if k.startswith(PURGED_PREFIXES)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(PURGED_PREFIXES)]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)


def _purging(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _restored_prefixed_variables():
            return func(*args, **kwargs)

    setattr(wrapper, _PURGED_MARK, True)
    return wrapper


def _purge_test_methods(cls: type) -> type:
    for name in dir(cls):
        method = getattr(cls, name)
        if name.startswith("test") and callable(method) and not getattr(method, _PURGED_MARK, False):
            setattr(cls, name, _purging(method))
    return cls


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorator: whatever `ACCELERATE_*` / `ACCEL_*` variables the function (or each `test*` method of the
    class and of its subclasses) sets or changes are restored when it returns.

    Meant for tests: a helper that sets e.g. `ACCEL_MIXED_PRECISION=fp16` must not leak
    into the next test.
    """
    if not isinstance(func_or_cls, type):
        return _purging(func_or_cls)
    _purge_test_methods(func_or_cls)
    previous = func_or_cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__func__(sub, **kwargs)
        _purge_test_methods(sub)

    func_or_cls.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]  # hooking subclassing
    return func_or_cls
