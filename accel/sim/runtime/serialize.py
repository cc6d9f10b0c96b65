"""Shipping functions, arguments and results between the parent and its ranks.

Plain pickle first: it sends module-level functions by reference, which is fast and
runs the rank's own copy of the code. Whatever plain pickle cannot ship (lambdas,
closures, functions and classes defined in ``__main__``, whose reference would not
resolve in a rank) goes through dill, which sends them by value.
"""

from __future__ import annotations

import pickle
from typing import Any

_PLAIN = b"P"
_DILL = b"D"


def _defined_in_main(obj: Any) -> bool:
    return getattr(obj, "__module__", None) in ("__main__", "__mp_main__")


def dumps(obj: Any, by_value: bool = False) -> bytes:
    """Serialise `obj`; `by_value` forces dill (used for objects defined in ``__main__``)."""
    if not by_value:
        try:
            return _PLAIN + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            pass  # e.g. a lambda or a local function: dill can send it by value
    import dill

    try:
        return _DILL + dill.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL, recurse=True)
    except Exception as error:
        raise TypeError(
            f"cannot send {obj!r} to the ranks: neither pickle nor dill can serialise it ({error}); "
            "use a module-level function and picklable arguments"
        ) from error


def loads(data: bytes) -> Any:
    """Inverse of `dumps`."""
    tag, body = data[:1], data[1:]
    if tag == _PLAIN:
        return pickle.loads(body)
    if tag == _DILL:
        import dill

        return dill.loads(body)
    raise ValueError(f"unknown payload tag {tag!r}")


def dumps_call(fn: Any, args: tuple, kwargs: dict) -> bytes:
    """Serialise a call ``fn(*args, **kwargs)``, sending by value what a rank could not find by reference:
    `fn`, or an argument, defined in ``__main__`` (a notebook cell's function, also when the launcher wraps
    it and passes it on as an argument)."""
    parts = (fn, *args, *kwargs.values())
    return dumps((fn, tuple(args), dict(kwargs)), by_value=any(_defined_in_main(part) for part in parts))
