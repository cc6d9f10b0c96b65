"""What "each test starts clean" means inside a warm rank, and how it is restored.

A warm rank runs many tests one after the other. Between two tests it puts back what a
test may have changed and the next must not see: environment variables (to the
snapshot taken when the pool started), `sys.argv`, the standard streams, logging
levels, `accel`'s shared state, the simulated device's own state, RNG seeds, the
working directory and import path (the parent's, at the time of the launch), warning
filters, torch's process-wide defaults, and process groups created by earlier tests.
The default process group is kept: recreating it is the expensive part of a start,
and `reset_state()` leaves it alone by design.

What only concerns this process (`reset`: environment, argv, streams, warnings,
logging, torch's defaults, accel's state) is put back as soon as the rank has answered
a task, while the parent reports it, so that the next task does not wait for it. What
needs the next task (its working directory and import path) or every rank done with the
last one (destroying the groups it created and resetting the simulated device, whose
communicators peers may still be using until then), and the seeds, are put back when
the next task begins (`enter`). A reset that failed fails the next task.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

#: the seed every test starts from, in every RNG (the same on every rank, as after a
#: fresh start of a script that calls nothing)
SEED = 0


class CleanSlate:
    """Snapshot of a freshly started rank, restored before every task."""

    def __init__(self, reset_device: Callable[[], None]) -> None:
        self._reset_device = reset_device
        self.environ = dict(os.environ)
        self._environ_raw = _raw_environ()
        self.argv = list(sys.argv)
        self.streams = (sys.stdin, sys.stdout, sys.stderr)
        self.warning_filters = list(warnings.filters)
        self.default_dtype = torch.get_default_dtype()
        self.num_threads = torch.get_num_threads()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.groups = set(_process_groups())
        self.logging = _LoggingSnapshot()

        #: what went wrong in the last `reset`, raised by the next `enter`
        self._reset_error: BaseException | None = None

    def restore(self, cwd: str | None = None, sys_path: list[str] | None = None) -> None:
        """Put the rank back in its start-up state (see the module docstring), all at once."""
        self.reset()
        self.enter(cwd, sys_path)

    def enter(self, cwd: str | None = None, sys_path: list[str] | None = None) -> None:
        """Before a task (every rank is done with the last): raise what the last reset met, take the
        task's paths, drop earlier tests' groups, reset the device, seed."""
        error, self._reset_error = self._reset_error, None
        if error is not None:
            raise RuntimeError(
                "this rank could not be put back in its start-up state after the previous test"
            ) from error
        if sys_path is not None and sys.path != sys_path:
            sys.path[:] = sys_path
        if cwd is not None and os.getcwd() != cwd:
            os.chdir(cwd)
        if self._destroy_new_groups():
            # Destroying a group may touch accel's state: put it back once more.
            from accel.state import reset_state

            reset_state()
        self._reset_device()
        seed_everything(SEED)

    def reset(self, *also: Callable[[], None]) -> None:
        """After a task (it has answered): put back what only concerns this process, then call
        `also`; an error is kept for `enter`."""
        try:
            self._reset()
            for call in also:
                call()
        except BaseException as error:  # raised by the next task's `enter`, which reports it
            self._reset_error = error

    def _reset(self) -> None:
        if _raw_environ() != self._environ_raw:
            os.environ.clear()
            os.environ.update(self.environ)
        if sys.argv != self.argv:
            sys.argv[:] = self.argv
        if (sys.stdin, sys.stdout, sys.stderr) != self.streams:
            sys.stdin, sys.stdout, sys.stderr = self.streams
        warnings.filters[:] = self.warning_filters  # type: ignore[index]  # a list at runtime; typeshed says Sequence
        # Bumps the filters' version so per-module "already warned" caches are dropped.
        getattr(warnings, "_filters_mutated", lambda: None)()
        self.logging.restore()
        self._restore_torch()
        from accel.state import reset_state

        reset_state()

    def _destroy_new_groups(self) -> bool:
        """Destroy the groups earlier tests created; whether there were any.

        Groups a test created (dist.new_group, a backend's own object group) would
        otherwise pile up test after test, each holding sockets to every peer, until
        the rank runs out of file descriptors. Nobody uses them once every rank has
        finished the test, which is when this runs; the default group stays.
        """
        import torch.distributed as dist

        destroyed = False
        for group in _process_groups():
            if group not in self.groups and group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
                destroyed = True
        return destroyed

    def _restore_torch(self) -> None:
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)
        torch.set_grad_enabled(True)


class _LoggingSnapshot:
    """Root logger (level, handlers), `logging.disable`, and the levels of the loggers
    that existed at start-up (`accel.logging.get_logger(name, level)` sets both)."""

    def __init__(self) -> None:
        root = logging.getLogger()
        self.root_level, self.root_handlers = root.level, list(root.handlers)
        self.disabled = logging.root.manager.disable
        self.levels = {
            name: logger.level
            for name, logger in logging.root.manager.loggerDict.items()
            if isinstance(logger, logging.Logger)
        }

    def restore(self) -> None:
        root = logging.getLogger()
        if root.level != self.root_level:
            root.setLevel(self.root_level)
        if root.handlers != self.root_handlers:
            root.handlers[:] = self.root_handlers
        if logging.root.manager.disable != self.disabled:
            logging.disable(self.disabled)
        loggers = logging.root.manager.loggerDict
        for name, level in self.levels.items():
            logger = loggers.get(name)
            if isinstance(logger, logging.Logger) and logger.level != level:
                logger.setLevel(level)


def _raw_environ() -> dict:
    """The environment as `os.environ` keeps it (bytes, no decoding: 30 times faster to compare)."""
    raw = getattr(os.environ, "_data", None)
    return dict(raw) if isinstance(raw, dict) else dict(os.environ)


def _process_groups() -> list:
    """Every process group of this process (torch keeps the registry private)."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}))


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's CPU and numpy's generators (the device resets its own).

    Not `torch.manual_seed`: without an initialised GPU it queues a lazy CUDA seeding
    call, with a formatted stack, on every call (a millisecond, and a list that grows
    test after test). Simulated devices reseed themselves in `reset_rank`; a real GPU
    is reseeded here.
    """
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)
    numpy: Any = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed)
