"""`torch_xla.distributed.xla_multiprocessing` (`xmp`) of the simulator: each rank already is a process.

A TPU script calls `xmp.spawn(fn, args)` (or `torch_xla.launch`) to start one process per
device. Under `accel launch --simulate xla` (and `accel.sim.launch(..., device="xla")`) the
simulator has started those processes already, so `spawn` runs `fn(ordinal, *args)` in
this rank, as each spawned process would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

import torch_xla.runtime as xr


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int | None = None,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> Any:
    """Run `fn(global_ordinal, *args)` in this rank; `nprocs` is 1 or None, as torch_xla accepts.

    `nprocs=1` (torch_xla: run in this one process) needs a job of one process.
    """
    if nprocs == 1:
        if xr.world_size() != 1:
            raise RuntimeError(
                f"xmp.spawn(nprocs=1) / torch_xla.launch(debug_single_process=True) (accel simulator): the simulator "
                f"started {xr.world_size()} processes already; launch with --num_processes 1 (world_size=1) to run "
                "a single one"
            )
        return fn(xr.global_ordinal(), *args)
    if nprocs is not None:
        raise ValueError(
            f"Unsupported nprocs ({nprocs}). Please use nprocs=1 or None (default). If None, spawn will use all "
            "available devices. Use the environment variable X_NUM_DEVICES (where X is CPU, TPU, NEURONCORE, etc) "
            "to limit the number of devices used."
        )
    fn(xr.global_ordinal(), *args)
    return None


class MpModelWrapper:
    """Holds a model made once, moved to each process's device with `to(device)`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._lock = threading.Lock()

    def to(self, device: Any) -> torch.nn.Module:
        with self._lock:
            self._model.to(device)
        return self._model


class MpSerialExecutor:
    """Runs a function in one process of the host at a time (every process calls `run`).

    torch_xla shares a lock between the processes it forks; the simulator's ranks take
    turns by local ordinal, meeting at a rendezvous after each turn.
    """

    def run(self, fn: Callable[[], Any]) -> Any:
        import torch_xla.core.xla_model as xm

        result = None
        for turn in range(xr.local_process_count()):
            if turn == xr.local_ordinal():
                result = fn()
            xm.rendezvous(f"torch_xla.distributed.xla_multiprocessing.MpSerialExecutor:{turn}")
        return result
