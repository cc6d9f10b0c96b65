"""A logger that speaks once per run instead of once per process.

`get_logger(__name__)` returns an adapter of the standard `logging` logger: records,
prefixed with the rank (`[RANK 0] ...`, as in Accelerate), are emitted on the main
process only, unless a call passes `main_process_only=False` (every process logs) or
`in_order=True` (every process logs, one rank after another).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

LEVEL_ENV = "ACCEL_LOG_LEVEL"


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logger adapter that filters records by process; see `get_logger`."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        from accel.state import PartialState

        if not PartialState._shared_state:
            raise RuntimeError(
                "accel's logger was used before the distributed state was set up: create an Accelerator "
                "or a PartialState() first"
            )
        state = PartialState()
        msg, processed = self.process(msg, kwargs)
        if in_order:
            for rank in range(state.num_processes):
                if rank == state.process_index:
                    self.logger.log(level, msg, *args, **processed)
                state.wait_for_everyone()
        elif not main_process_only or state.is_main_process:
            self.logger.log(level, msg, *args, **processed)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        """Prefix the message with the process's rank, `[RANK n] `, as Accelerate's logger does."""
        from accel.state import PartialState

        msg, kwargs = super().process(msg, kwargs)
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    @functools.lru_cache(None)  # noqa: B019  (the cache is the point: one record per distinct message)
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning(...)`, emitted only the first time this adapter sees these exact arguments.

        For warnings inside loops; arguments must be hashable. Adapters of the same name
        share nothing: the cache is per adapter.
        """
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | int | None = None) -> MultiProcessAdapter:
    """A logger named `name` whose records print on the main process only unless asked.

    Pass `main_process_only=False` to a logging call to log on every process, or
    `in_order=True` to log on every process in rank order. `log_level` (or the
    `ACCEL_LOG_LEVEL` environment variable) sets the logger's level.
    """
    logger = logging.getLogger(name)
    level = log_level if log_level is not None else os.environ.get(LEVEL_ENV)
    if level is not None:
        logger.setLevel(level.upper() if isinstance(level, str) else level)
        logging.getLogger().setLevel(logger.level)
    return MultiProcessAdapter(logger, {})
