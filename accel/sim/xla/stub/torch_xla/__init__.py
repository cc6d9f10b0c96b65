"""Stand-in `torch_xla` of the accel simulator: today's torch_xla API on simulated TPU cores.

Importable only inside a simulated TPU rank (see `accel.sim.devices.prepare_rank`). Each
rank is one process driving one XLA device, as torch_xla runs under PJRT; the device and
the host copies that collectives carry over Gloo come from `accel.sim.xla.bridge`.

`torch_xla.launch(fn)` / `xmp.spawn(fn)` run `fn(index)` in this rank (the simulator has
started the processes already). The simulator runs eagerly: `sync()` cuts no graph (it
runs the step closures), `compile()` compiles nothing (it says so once). SPMD is not
simulated (`torch_xla.runtime.use_spmd` and `torch_xla.distributed.spmd` refuse by name).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

import torch_xla._sim_state as _state
from accel.sim.xla import bridge

__version__ = "2.9.0+accel.sim"

#: lets code (and tests) tell the simulator's torch_xla from the real one
SIMULATED = True


def device(index: int | None = None) -> torch.device:
    """The XLA device of this process (`index`: into `torch_xla.devices()`)."""
    if index is None:
        return bridge.xla_device()
    from torch_xla.core import xla_model as xm

    devices = xm.get_xla_supported_devices()
    if index > len(devices):
        raise IndexError(f"Device index {index} out of range in {devices}")
    return torch.device(devices[index])


def devices() -> list[torch.device]:
    """The XLA devices of this process: one, under PJRT."""
    from torch_xla.core import xla_model as xm

    return [torch.device(d) for d in xm.get_xla_supported_devices()]


def real_devices() -> list[str]:
    """The runtime's names of this process's devices, e.g. ['TPU:3']."""
    import torch_xla.runtime as xr

    return [f"{xr.device_type()}:{xr.global_ordinal()}"]


def device_count() -> int:
    """Number of devices this process addresses: one."""
    return len(real_devices())


def sync(wait: bool = False, reset_scope: bool = True) -> None:
    """End the step: XLA would compile and run the pending graph; here it runs the step closures."""
    from torch_xla.core import xla_model as xm

    _state.steps += 1
    xm._run_step_closures()


def step() -> Any:
    """Context manager around a training step (`torch_xla.compile()`)."""
    return compile()


def _say_eager() -> None:
    if not _state.compile_warned:
        _state.compile_warned = True
        warnings.warn(
            "torch_xla.compile (accel simulator): nothing is compiled; the simulated TPU runs the function eagerly, "
            "step by step, with the same results (graph options such as full_graph and max_different_graphs are "
            "not checked)",
            UserWarning,
            stacklevel=3,
        )


def compile(
    f: Callable[..., Any] | None = None,
    full_graph: bool | None = False,
    name: str | None = None,
    max_different_graphs: int | None = None,
    custom_compile_options: dict[str, Any] | None = None,
) -> Any:
    """torch_xla's `compile`: a context manager (without `f`) or `f` wrapped; runs eagerly (module docstring).

    As torch_xla's, the region starts and ends with `sync()`.
    """
    _say_eager()

    @contextlib.contextmanager
    def _compile() -> Iterator[None]:
        sync()
        try:
            yield
        finally:
            sync()

    if f is None:
        return _compile()

    @functools.wraps(f)
    def compiled(*args: Any, **kwargs: Any) -> Any:
        with _compile():
            return f(*args, **kwargs)

    return compiled


def manual_seed(seed: int, device: Any = None) -> None:
    """Seed the XLA generator of `device` (default: this process's)."""
    from torch_xla.core import xla_model as xm

    xm.set_rng_state(seed, device)


def set_custom_compile_options(options: dict[str, Any]) -> None:
    """XLA compiler flags: there is no compiler here, they are accepted and change nothing."""


def launch(
    fn: Callable[..., Any], args: tuple = (), start_method: str = "spawn", debug_single_process: bool = False
) -> None:
    """Run `fn(index, *args)` once in each process of the job: here, in this rank (the simulator started them).

    `index` is the local ordinal, as torch_xla gives under a torchrun-style launcher.
    """
    import torch_xla.runtime as xr

    if xr.is_spmd():
        raise NotImplementedError("launch function does not support SPMD at this time")
    if debug_single_process:
        from torch_xla.distributed import xla_multiprocessing as xmp

        xmp.spawn(fn, args=args, nprocs=1, start_method=start_method)
        return
    fn(xr.local_ordinal(), *args)


# As `import torch_xla` does on a TPU host: the submodules scripts reach as attributes.
import torch_xla.core.xla_model  # noqa: E402
import torch_xla.distributed.xla_multiprocessing  # noqa: E402
import torch_xla.experimental  # noqa: E402
import torch_xla.runtime  # noqa: E402
import torch_xla.utils.utils  # noqa: E402
