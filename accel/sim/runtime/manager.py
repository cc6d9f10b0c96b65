"""Warm pools kept per (world_size, device, real device), handed out one launch at a time.

Idle pools beyond a budget of warm ranks are closed, least recently used first. Every
manager's pools are stopped at interpreter exit; a session-scoped manager (the pytest
harness) closes its own at the end of the session.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading

from accel.sim.runtime.pool import MAX_WARM_RANKS, START_TIMEOUT, RankPool


class PoolManager:
    """Keeps warm pools per (world_size, device) and hands them out one launch at a time."""

    def __init__(self, max_warm_ranks: int = MAX_WARM_RANKS, env: dict[str, str] | None = None) -> None:
        self.max_warm_ranks = max_warm_ranks
        #: environment the ranks start from (None: the process's own when a pool starts)
        self.env = env
        self._idle: collections.OrderedDict[tuple[int, str, bool], RankPool] = collections.OrderedDict()
        #: pools being started in the background (`prestart`): done when set
        self._starting: dict[tuple[int, str, bool], threading.Event] = {}
        #: why a background start failed, raised by the launch that wanted that pool
        self._start_errors: dict[tuple[int, str, bool], BaseException] = {}
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self.pools_started = 0

    def acquire(self, world_size: int, device: str, real_device: bool = False, isolated: bool = False) -> RankPool:
        """A started pool for this configuration: a warm one if there is one, else a new one."""
        key = (world_size, device, real_device)
        if not isolated:
            with self._lock:
                starting = self._starting.get(key)
            if starting is not None and not starting.wait(START_TIMEOUT + 10):
                raise RuntimeError(f"the pool of {world_size} {device} ranks started in the background never came up")
            with self._lock:
                error = self._start_errors.pop(key, None)
                pool = self._idle.pop(key, None)
            if error is not None:
                raise error
            if pool is not None and pool.healthy and pool.alive():
                return pool
            if pool is not None:
                pool.kill()
        pool = RankPool(world_size, device, real_device, env=self.env)
        pool.start()
        self.pools_started += 1
        return pool

    def prestart(self, world_size: int, device: str, real_device: bool = False) -> None:
        """Start a pool for this configuration in the background (the next `acquire` of it waits for it).

        The pytest harness calls it as soon as it sees a distributed test coming, so that the
        ranks start while pytest still imports and collects test modules.
        """
        key = (world_size, device, real_device)
        with self._lock:
            if key in self._idle or key in self._starting or os.getpid() != self._owner:
                return
            done = self._starting[key] = threading.Event()

        def start() -> None:
            try:
                pool = RankPool(world_size, device, real_device, env=self.env)
                pool.start()
            except BaseException as error:  # the launch that wants this pool raises it
                with self._lock:
                    self._start_errors[key] = error
                    del self._starting[key]
                done.set()
                return
            self.pools_started += 1
            with self._lock:
                del self._starting[key]
            self.release(pool, True)
            done.set()

        threading.Thread(target=start, name=f"accel-sim-prestart-{device}{world_size}", daemon=True).start()

    def release(self, pool: RankPool, reusable: bool) -> None:
        """Give a pool back after a task: kept warm when `reusable`, else killed."""
        if not reusable or not pool.healthy:
            pool.kill()
            return
        key = (pool.world_size, pool.device, pool.real_device)
        evicted = []
        with self._lock:
            previous = self._idle.pop(key, None)
            if previous is not None:
                evicted.append(previous)
            self._idle[key] = pool
            while sum(p.world_size for p in self._idle.values()) > self.max_warm_ranks and len(self._idle) > 1:
                evicted.append(self._idle.popitem(last=False)[1])
        for old in evicted:
            old.close()

    def close(self) -> None:
        """Stop every warm pool (at exit, at the end of a test session)."""
        if os.getpid() != self._owner:  # a forked copy: the pools belong to the original
            self._idle.clear()
            return
        with self._lock:
            starting = list(self._starting.values())
        for done in starting:  # a pool started in the background must not outlive us
            done.wait(START_TIMEOUT + 10)
        with self._lock:
            pools = list(self._idle.values())
            self._idle.clear()
            self._start_errors.clear()
        for pool in pools:
            pool.close()


_managers: list[PoolManager] = []


def new_manager(max_warm_ranks: int = MAX_WARM_RANKS, env: dict[str, str] | None = None) -> PoolManager:
    """A pool manager whose pools are also stopped when the interpreter exits."""
    manager = PoolManager(max_warm_ranks, env)
    _managers.append(manager)
    return manager


def _close_all() -> None:
    for manager in _managers:
        manager.close()


# Registered after multiprocessing's own exit handler, so it runs first: that one
# would otherwise wait for our (non-daemonic) ranks forever.
atexit.register(_close_all)
