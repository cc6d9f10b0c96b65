"""Progress bars that show on one process per machine instead of once per rank."""

from __future__ import annotations

from typing import Any


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """A `tqdm.auto.tqdm` bar, disabled on every process but the local main one unless `main_process_only=False`.

    Takes tqdm's own arguments; `disable=True` still disables it everywhere.
    """
    try:
        from tqdm.auto import tqdm as progress_bar
    except ImportError as error:
        raise ImportError("accel.utils.tqdm needs the tqdm package: pip install tqdm") from error
    if args and isinstance(args[0], bool):
        raise ValueError(
            "tqdm(True/False, ...): pass main_process_only=True/False as a keyword; the first positional "
            "argument is the iterable"
        )
    disable = kwargs.pop("disable", False)
    if main_process_only and not disable:
        from accel.state import PartialState

        disable = PartialState().local_process_index != 0
    return progress_bar(*args, disable=disable, **kwargs)
