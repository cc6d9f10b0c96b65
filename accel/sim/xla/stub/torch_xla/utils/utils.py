"""`torch_xla.utils.utils` of the simulator: the helpers torch_xla's API and examples use.

`SampleGenerator` (synthetic data in place of a `DataLoader`), `getenv_as`,
`check_env_flag`, `DataWrapper`, and the nested-structure walkers that `xm.save` and the
device loader use. As torch_xla's, `for_each_instance_rewrite` gives lists for tuples and
plain dicts for mappings, and copies objects that have a `__dict__` (tensors, which keep
their host tensor there on the simulated device, are leaves).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch


class SampleGenerator:
    """Iterator returning `data` `sample_count` times (synthetic data in place of a `DataLoader`)."""

    def __init__(self, data: Any, sample_count: int) -> None:
        self._data = data
        self._sample_count = sample_count
        self._count = 0

    def __iter__(self) -> SampleGenerator:
        return SampleGenerator(self._data, self._sample_count)

    def __len__(self) -> int:
        return self._sample_count

    def __next__(self) -> Any:
        return self.next()

    def next(self) -> Any:
        if self._count >= self._sample_count:
            raise StopIteration
        self._count += 1
        return self._data


class DataWrapper:
    """Base of objects that say which CPU tensors they hold and rebuild themselves from device copies."""

    def get_tensors(self) -> list[Any]:
        raise NotImplementedError("The method is missing an implementation")

    def from_tensors(self, tensors: list[Any]) -> Any:
        raise NotImplementedError("The method is missing an implementation")


def as_list(t: Any) -> Any:
    return t if isinstance(t, (tuple, list)) else [t]


def getenv_as(name: str, type: Callable[[str], Any], defval: Any = None) -> Any:
    env = os.environ.get(name, None)
    if type is bool:
        return defval if env is None else bool(int(env))
    return defval if env is None else type(env)


def check_env_flag(name: str, default: str = "") -> bool:
    flag = os.getenv(name, default)
    return flag == "true" or (flag.isdigit() and int(flag) > 0)


def _is_leaf(value: Any) -> bool:
    # Tensors (a device tensor may keep its host tensor in its __dict__) and classes are not walked into.
    return isinstance(value, (torch.Tensor, type))


def _for_each_instance(value: Any, select_fn: Callable[[Any], bool], fn: Callable[[Any], Any], seen: set[int]) -> None:
    if id(value) in seen:
        return
    seen.add(id(value))
    if select_fn(value):
        fn(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _for_each_instance(key, select_fn, fn, seen)
            _for_each_instance(item, select_fn, fn, seen)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _for_each_instance(item, select_fn, fn, seen)
    elif isinstance(value, DataWrapper):
        for item in value.get_tensors():
            _for_each_instance(item, select_fn, fn, seen)
    elif _is_leaf(value):
        return
    elif hasattr(value, "__dict__"):
        for item in vars(value).values():
            _for_each_instance(item, select_fn, fn, seen)


def for_each_instance(value: Any, select_fn: Callable[[Any], bool], fn: Callable[[Any], Any]) -> None:
    """Call `fn` on every object of the nested `value` that `select_fn` selects (each object once)."""
    _for_each_instance(value, select_fn, fn, set())


def _rewrite(value: Any, select_fn: Callable[[Any], bool], fn: Callable[[Any], Any], done: dict[int, Any]) -> Any:
    if id(value) in done:
        return done[id(value)]
    result: Any = value
    if select_fn(value):
        result = fn(value)
        done[id(value)] = result
    elif isinstance(value, dict):
        result = {}
        done[id(value)] = result
        for key, item in value.items():
            result[_rewrite(key, select_fn, fn, done)] = _rewrite(item, select_fn, fn, done)
    elif isinstance(value, set):
        result = set()
        done[id(value)] = result
        for item in value:
            result.add(_rewrite(item, select_fn, fn, done))
    elif isinstance(value, (list, tuple)):
        # As torch_xla: tuples come back as lists (the mapping is set before recursing).
        result = []
        done[id(value)] = result
        for item in value:
            result.append(_rewrite(item, select_fn, fn, done))
    elif isinstance(value, DataWrapper):
        result = value.from_tensors([_rewrite(item, select_fn, fn, done) for item in value.get_tensors()])
        done[id(value)] = result
    elif hasattr(value, "__dict__") and not _is_leaf(value):
        result = copy.copy(value)
        done[id(value)] = result
        for key, item in list(vars(result).items()):
            vars(result)[key] = _rewrite(item, select_fn, fn, done)
    else:
        done[id(value)] = result
    return result


def for_each_instance_rewrite(value: Any, select_fn: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """A copy of the nested `value` where each object `select_fn` selects is replaced by `fn(object)`."""
    return _rewrite(value, select_fn, fn, {})
