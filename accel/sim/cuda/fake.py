"""Simulated GPUs: CUDA tensors held in CPU memory, `torch.cuda` answering as on a GPU host.

Installed only inside a simulated GPU rank (`accel.sim.devices.prepare_rank("cuda")`),
never in a user's own process: part of it (the hidden PrivateUse1 device and its
kernels) is process-wide and cannot be undone. A rank gets `LOCAL_WORLD_SIZE`
simulated GPUs, the current one being `LOCAL_RANK`.

* Tensors (`accel.sim.cuda.tensors.cuda_tensor`, `cuda_kernels`, `device_rules`): `device="cuda"`,
  `.cuda()`, `.to("cuda")`, `module.cuda()` give tensors on `cuda:k` that compute on
  the CPU and fail like CUDA tensors when mixed with CPU ones.
* `torch.autocast("cuda")` applies CUDA's policy (`cuda_autocast`); `torch.amp.GradScaler("cuda")`
  runs on top of it unchanged.
* Checkpoints record `cuda:k` and load back on that simulated GPU (`cuda_checkpoint`).
* `torch.cuda` (patched here): device count, current device, `set_device`, one CPU
  generator per simulated GPU (seeding, RNG state), memory statistics (zero),
  `synchronize`, streams and events. There is one stream per GPU and work is done
  when it is issued, so waits and synchronisations have nothing to wait for: they
  return at once, which gives the same results a GPU gives.
* `SimCUDABackend` is the real `CUDABackend` (DDP with `device_ids`, autocast and
  GradScaler on "cuda", the RNG calls); its "nccl" process group hands Gloo the CPU
  data under the CUDA tensors (`nccl.process_group`; `nccl.mixed_group` serves mixed CPU/CUDA groups).
* `torch.compile` traces with Dynamo and runs the graphs eagerly (`accel.sim.core.compile`).
* Parameters keep their identity when they move (`accel.sim.core.moves`).
* NVTX and the CUDA profiler answer as with no tool attached (`profiler`); JIT-built CUDA
  extensions get stand-ins in torch ops or are refused at once (`extensions`).

What cannot be simulated raises `SimulatedDeviceError` naming it (see docs/simulated-gpus.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.cuda
import torch.cuda.random

from accel.backends.cuda import CUDABackend
from accel.sim.core import carried, compiled_buffers, hidden, moves, torch_internals
from accel.sim.core import compile as sim_compile
from accel.sim.cuda.attention import sdpa as cuda_attention
from accel.sim.cuda.gpus import cards as gpu_models
from accel.sim.cuda.gpus import generators
from accel.sim.cuda.gpus import shapes as cuda_shapes
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.gpus.errors import SimulatedDeviceError
from accel.sim.cuda.gpus.state import DEFAULT_CUDA_SEED
from accel.sim.cuda.kernels import autocast as cuda_autocast
from accel.sim.cuda.kernels import batch_norm as norm_kernels
from accel.sim.cuda.kernels import blas as cuda_blas
from accel.sim.cuda.kernels import host_arguments
from accel.sim.cuda.kernels import rms_norm as rms_norm_kernels
from accel.sim.cuda.kernels import rnn as rnn_kernels
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.nccl import functional as cuda_functional
from accel.sim.cuda.nccl import mixed_group as cuda_group
from accel.sim.cuda.nccl import parallel_copies
from accel.sim.cuda.tensors import checkpoint as cuda_checkpoint
from accel.sim.cuda.tensors import cuda_tensor, sync_debug
from accel.sim.cuda.tensors import factories as cuda_kernels
from accel.sim.cuda.timing import clock as timing_clock
from accel.sim.cuda.timing import ops as timing
from accel.sim.cuda.timing import pyclock
from accel.sim.cuda.torch_cuda import accelerator as cuda_accelerator
from accel.sim.cuda.torch_cuda import determinism
from accel.sim.cuda.torch_cuda import entry_points as cuda_entry_points
from accel.sim.cuda.torch_cuda import extensions as cuda_extensions
from accel.sim.cuda.torch_cuda import graphs as cuda_graphs
from accel.sim.cuda.torch_cuda import profiler as cuda_profiler
from accel.sim.cuda.torch_cuda import properties as cuda_properties
from accel.sim.cuda.torch_cuda.streams import Event, Stream, current_stream, set_stream, stream_context

__all__ = [
    "DEFAULT_CUDA_SEED",
    "SimCUDABackend",
    "SimulatedDeviceError",
    "install",
    "is_installed",
    "reset",
    "set_device_calls",
]


#: what `torch.version.cuda` says in a simulated GPU rank: the CUDA of torch's default GPU wheels
#: (code that checks for a CUDA build, as DDP's bf16 compression hook does, takes its GPU branch)
CUDA_VERSION = "12.8"


def is_installed() -> bool:
    """Whether this process has simulated GPUs."""
    return cuda_state.current() is not None


def set_device_calls() -> list[int]:
    """Indices passed to `torch.cuda.set_device` in this rank since the last reset (tests read it)."""
    return list(cuda_state.gpus().set_device_calls)


# -- torch.cuda's answers ----------------------------------------------------------------------------


def _unsupported(what: str, why: str) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise SimulatedDeviceError(f"{what} is not available on a simulated GPU: {why}")

    fail.__name__ = what.rsplit(".", 1)[-1].strip("()")
    return fail


def _index(device: Any = None, initialize: bool = True) -> int:
    gpus = cuda_state.gpus()
    if initialize:
        gpus.use()
    return gpus.current if device is None else gpus.resolve(device, initialize).index or 0


def _host_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """The host tensor under a simulated CUDA tensor (its storage), else None."""
    return cuda_tensor.unwrap(tensor) if isinstance(tensor, cuda_tensor.SimCudaTensor) else None


def _gpu(index: int) -> torch.device:
    """`cuda:index`, as Python must see hidden device `index`."""
    return cuda_state.gpus().devices[index]


def _lazy_init(*args: Any, **kwargs: Any) -> None:
    cuda_state.gpus().use()


def _synchronize(device: Any = None) -> None:
    """`torch.cuda.synchronize`: CUDA starts; on the clock, the host waits for every stream of the GPU."""
    _lazy_init()
    cuda_graphs.refuse_wait_while_capturing()
    timing.synchronize(_index(device))


def _set_device(device: Any) -> None:
    gpus = cuda_state.gpus()
    if isinstance(device, int) and device < 0:
        return  # torch ignores negative indices
    index = _index(device)
    gpus.current = index
    gpus.set_device_calls.append(index)


def _generator(device: Any = "cuda") -> torch.Generator:
    # seeding does not initialise CUDA on a GPU host (torch queues it until CUDA starts)
    return cuda_state.gpus().generators[_index(device, initialize=False)]


def _manual_seed_all(seed: int) -> None:
    for generator in cuda_state.gpus().generators:
        generator.manual_seed(int(seed))


def _set_rng_state_all(states: list[torch.Tensor]) -> None:
    for generator, state in zip(cuda_state.gpus().generators, states, strict=False):
        generator.set_state(state)


class _device(contextlib.ContextDecorator):
    """`torch.cuda.device(i)`: simulated GPU `i` is current inside the block."""

    def __init__(self, device: Any) -> None:
        self.index = -1 if device is None or device == -1 else _index(device)
        self.previous = -1

    def __enter__(self) -> _device:
        gpus = cuda_state.gpus()
        self.previous = gpus.current
        if self.index >= 0:
            gpus.current = self.index
        return self

    def __exit__(self, *exc: Any) -> None:
        cuda_state.gpus().current = self.previous


def _exchange_device(device: int) -> int:
    """`torch.cuda._exchange_device` / `_maybe_exchange_device`: make GPU `device` current (none if negative), return
    the one that was. `torch.cuda.device_of` calls them, and so does torch's own `device` class that it extends."""
    if device < 0:
        return -1
    gpus = cuda_state.gpus()
    previous = _index()
    gpus.current = _index(device)
    return previous


def _maybe_exchange_device(device: int) -> int:
    # a function of its own: Dynamo registers a handler per function of torch.cuda, and refuses one twice
    return _exchange_device(device)


def _patches() -> dict[str, Any]:
    none = lambda *args, **kwargs: None  # noqa: E731
    gpus = cuda_state.gpus
    return {
        "is_available": lambda: gpus().count > 0,
        "is_initialized": lambda: gpus().initialized,
        "init": _lazy_init,
        "_lazy_init": _lazy_init,
        "device_count": lambda: gpus().count,
        "current_device": lambda: _index(),
        "set_device": _set_device,
        "device": _device,
        "_exchange_device": _exchange_device,
        "_maybe_exchange_device": _maybe_exchange_device,
        # get_device_name / get_device_capability / is_bf16_supported: torch's own, on these properties
        "get_device_properties": cuda_properties.get_device_properties,
        "synchronize": _synchronize,
        "ipc_collect": none,
        "utilization": _unsupported("torch.cuda.utilization()", "it reads the GPU's NVML counters"),
        "temperature": _unsupported("torch.cuda.temperature()", "it reads the GPU's NVML counters"),
        "power_draw": _unsupported("torch.cuda.power_draw()", "it reads the GPU's NVML counters"),
        "clock_rate": _unsupported("torch.cuda.clock_rate()", "it reads the GPU's NVML counters"),
        "Stream": Stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": lambda device=None: Stream(device, _sim_id=0),
        "set_stream": set_stream,
        "stream": stream_context,
        # CUDA graphs: a CUDA build's would ask the real driver, a CPU build's refuse
        **cuda_graphs.patches(),
        "set_sync_debug_mode": sync_debug.set_sync_debug_mode,
        "get_sync_debug_mode": sync_debug.get_sync_debug_mode,
        "get_rng_state": lambda device="cuda": _generator(device).get_state(),
        # the generator copies the state at once (torch clones it only to queue the call until CUDA starts): no
        # tensor op here, which a FakeTensorMode around the call (DTensor's sharding propagation) would refuse
        "set_rng_state": lambda new_state, device="cuda": _generator(device).set_state(new_state),
        "get_rng_state_all": lambda: [g.get_state() for g in gpus().generators],
        "set_rng_state_all": _set_rng_state_all,
        "manual_seed": lambda seed: _generator().manual_seed(int(seed)),
        "manual_seed_all": _manual_seed_all,
        "seed": lambda: _generator().seed(),
        "seed_all": lambda: _manual_seed_all(random.getrandbits(63)),  # one fresh seed for all, like torch
        "initial_seed": lambda: _generator().initial_seed(),
        **cuda_properties.memory_patches(),
    }


_RNG_NAMES = (
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
)  # fmt: skip


class _HiddenDeviceModule:
    """`torch.simcuda`: what torch asks the module of the device under the simulated tensors."""

    @staticmethod
    def is_available() -> bool:
        # what a GPU host has is CUDA: torch's test suites make a test class for each device type whose
        # module says it is available (`instantiate_device_type_tests`), and must not make one for this
        return False

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return cuda_state.gpus().count

    @staticmethod
    def current_device() -> int:
        return cuda_state.gpus().current

    @staticmethod
    def set_device(device: Any) -> None:
        _set_device(device)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        _manual_seed_all(seed)

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None


_registered: list[bool] = []


def _raising_pending_oom(original: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.autograd.backward` / `grad` that raise the out-of-memory (or nondeterministic kernel) met inside them
    as they return."""

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            result = original(*args, **kwargs)
        finally:
            try:
                cuda_memory.raise_pending()
            finally:
                determinism.raise_pending()
        return result

    return run


def _record_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        """`Tensor.record_stream`: with one stream per simulated GPU there is nothing to record."""
        if isinstance(stream, Stream):
            return None
        return original(self, stream)

    return record_stream


def install(local_rank: int | None = None, device_count: int | None = None) -> None:
    """Give this rank process `device_count` simulated GPUs, `local_rank` being current.

    Defaults come from the launcher's environment (`LOCAL_WORLD_SIZE`, `LOCAL_RANK`).
    Call it only in a simulated rank: what it registers in torch lasts as long as the process.
    """
    torch_internals.check_supported()
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if device_count is None:
        device_count = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    count = max(device_count, 1)
    gpus = cuda_state.install(count, local_rank % count)
    gpus.on_start.append(_on_cuda_start)
    if not _registered:
        _register_device()
        _register_kernels()
        _register_torch_functions()
        _registered.append(True)
    cuda_tensor.set_device_count(count)
    for name, replacement in _patches().items():
        # The RNG functions live in torch.cuda.random and are re-exported by torch.cuda.
        modules = (torch.cuda, torch.cuda.random) if name in _RNG_NAMES else (torch.cuda,)
        if name in cuda_properties.MEMORY_NAMES:
            modules = (torch.cuda, torch.cuda.memory)
        for module in modules:
            setattr(module, name, replacement)
    for name, replacement in cuda_properties.history_patches().items():
        setattr(torch.cuda.memory, name, replacement)


def _register_device() -> None:
    """Once per process: the hidden device under simulated GPUs, and what torch's C++ asks of it."""
    hidden.register(cuda_state.HIDDEN_DEVICE, _HiddenDeviceModule())  # autograd on the calling thread
    torch_internals.serve_pinned_memory()
    torch_internals.answer_cuda_bad_fork()
    cuda_kernels.install()
    cuda_autocast.install()
    cuda_checkpoint.install()
    torch_internals.allow_foreach(cuda_tensor.SimCudaTensor)
    moves.install(cuda_tensor.SimCudaTensor)  # parameters keep their identity when they move
    torch_internals.show_hidden_as(cuda_state.HIDDEN_DEVICE, _gpu)
    torch_internals.build_wrapper_subclasses_on(cuda_state.HIDDEN_DEVICE, "cuda")
    torch_internals.on_storage_resize(cuda_memory.resize)
    torch_internals.propagate_dtensor_meta_on(cuda_state.HIDDEN_DEVICE)
    torch_internals.show_fsdp1_devices_as(cuda_state.HIDDEN_DEVICE, _gpu)
    torch_internals.keep_fsdp2_sharded_storage(_host_tensor)
    torch_internals.show_dtensor_the_generators_given(generators.as_gpu_generator)
    cuda_group.register()
    torch_internals.record_no_flights_of(carried.PythonGroup)  # the simulated NCCL groups are Python's
    cuda_tensor.SIM.timing = timing.running  # the clock hears of every op while it runs
    cuda_tensor.SIM.time_op = timing.time_op  # type: ignore[method-assign]  # the same call, unbound
    sync_debug.on_wait.append(timing.host_waits_for_gpu)
    timing.install()


def _register_kernels() -> None:
    """Once per process: the ops a GPU runs apart from the host's kernels, and the checks it makes on others."""
    cuda_tensor.add_special(
        {
            **cuda_functional.handlers(),
            **cuda_attention.handlers(),
            **cuda_blas.handlers(),
            **norm_kernels.handlers(),  # SyncBatchNorm's CUDA-only ops
            **rms_norm_kernels.handlers(),  # RMSNorm's fused kernel, which CUDA devices take
            **rnn_kernels.handlers(),  # the fused LSTM and GRU cells
            **host_arguments.handlers(),  # packed sequences' and CTC's lengths on the host
        }
    )
    for checks in (sync_debug.checks(), determinism.checks()):  # waits for the GPU; nondeterministic kernels
        cuda_tensor.add_special(_checked_first(checks))
    cuda_attention.install()
    rms_norm_kernels.install()
    host_arguments.install()
    sim_compile.install(
        (cuda_tensor.SimCudaTensor,), cuda_memory.pause, cuda_memory.resume, _compiled_buffers_runtime()
    )


def _register_torch_functions() -> None:
    """Once per process: torch's Python functions that would reach the CUDA library, answered here."""
    torch.autograd.backward = _raising_pending_oom(torch.autograd.backward)
    torch.autograd.grad = _raising_pending_oom(torch.autograd.grad)
    torch_internals.serve_parallel_copies(parallel_copies.FUNCTIONS)  # nn.DataParallel's copies
    torch.from_dlpack = torch.utils.dlpack.from_dlpack = _from_dlpack(torch.utils.dlpack.from_dlpack)
    torch.cuda.nccl.is_available = lambda tensors: False  # no single-process NCCL: copies
    torch.Generator = generators.generator_type(lambda device: cuda_state.gpus().resolve(device))  # type: ignore[misc, assignment]  # simulated ranks only
    torch.Tensor.record_stream = _record_stream(torch.Tensor.record_stream)  # type: ignore[method-assign]  # patched in simulated ranks only
    cuda_accelerator.install()
    cuda_entry_points.install()  # torch._C's CUDA entry points torch's Python calls directly
    cuda_profiler.install()  # NVTX, cudart's profiler calls: as with no profiling tool attached
    cuda_extensions.install()  # JIT-built CUDA extensions: stand-ins in torch ops, or refused at once
    cuda_graphs.install()  # CUDA graphs: captures record ops, replays run them again
    torch.version.cuda = CUDA_VERSION  # a CPU build says None


def reconfigure() -> None:
    """Read the card and shapes-only settings again (a task that sets them), if CUDA has started already.

    Memory counting starts afresh: nothing of the task is on its GPUs yet.
    """
    gpus = cuda_state.current()
    if gpus is not None and gpus.started:
        _on_cuda_start(gpus)


def _past_handler(func: Any, args: tuple, kwargs: dict) -> Any:
    return cuda_tensor.dispatch(func, args, kwargs, apart=False)


def _checked_first(checks: dict[Any, Any]) -> dict[Any, Any]:
    """Handlers that run each op's `check(args, kwargs)`, then the handler the op had (else the op as any op)."""
    previous = dict(cuda_tensor.SimCudaTensor._special)

    def handler(func: Any, check: Any) -> Any:
        then = previous.get(func) or functools.partial(_past_handler, func)

        def run(args: tuple, kwargs: dict) -> Any:
            check(args, kwargs)
            return then(args, kwargs)

        return run

    return {func: handler(func, check) for func, check in checks.items()}


def _from_dlpack(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def from_dlpack(ext_tensor: Any) -> torch.Tensor:
        """`torch.from_dlpack`: a simulated GPU tensor's DLPack view is a tensor on its memory, without autograd."""
        if cuda_tensor.is_simulated_cuda(ext_tensor):
            return ext_tensor.detach()
        return original(ext_tensor)

    return from_dlpack


def _on_cuda_start(gpus: cuda_state.SimGpus) -> None:
    """CUDA starts in this process (or test): each visible GPU is the chosen card, its memory empty."""
    torch.cuda.default_generators = tuple(gpus.generators)  # type: ignore[assignment]  # as torch's CUDA start fills them
    cuda_shapes.configure()
    timing_clock.start(gpu_models.resolve())  # simulated time starts with CUDA
    timing.name_kernels()  # by module, where a trace is asked for
    pyclock.configure()  # and Python's clocks follow it, where ACCEL_SIM_CLOCK=gpu asks
    if os.environ.get(cuda_properties.MEMORY_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        cuda_memory.uninstall()
        return
    cuda_memory.install(gpu_models.resolve(), len(gpus.visible))


def reset(local_rank: int | None = None, fresh: bool = False) -> None:
    """Between tests: current GPU back to `local_rank`, generators to torch's default seed, autocast off.

    `fresh`: as a newly started process, which has not initialised CUDA yet.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    gpus = cuda_state.gpus()
    gpus.reset(local_rank % gpus.physical, initialized=not fresh)
    cuda_autocast.reset()
    sync_debug.set_sync_debug_mode(0)
    torch.use_deterministic_algorithms(False)  # as a new process starts (a test may have left it on)
    pyclock.restore()  # the next task's ACCEL_SIM_CLOCK decides again, when CUDA starts in it


# -- the backend ------------------------------------------------------------------------------------------


class SimCUDABackend(CUDABackend):
    """The real CUDA backend; its "nccl" group refuses CPU tensors as NCCL does (`nccl.process_group`)."""

    name = "sim_cuda"
    comm_backend = "nccl"  # created by accel.sim.runtime.adopt_group as the simulated NCCL group

    @classmethod
    def is_available(cls) -> bool:
        return is_installed()


def _compiled_buffers_runtime() -> compiled_buffers.Runtime:
    """How a compiled region's kept buffers are counted here: on the GPU's allocator, shapes only if on."""
    return compiled_buffers.Runtime(
        counting=cuda_memory.counts_memory,
        count=cuda_memory.track,
        align=lambda args, kwargs: cuda_shapes.align(args, kwargs, {}),
        factory_device=lambda nbytes: torch.device("cpu" if cuda_shapes.keeps_data(nbytes) else "meta"),
        draw=lambda op, args, kwargs, index: cuda_tensor.SIM.draw(index, op, args, kwargs),
        adopt=cuda_tensor.wrap,
        runs_on_device=_runs_on_device,
        on_device=_on_simulated_gpu,
        fused=timing.fused_kernel,
        op_by_op=timing.op_by_op_region,
    )


#: ops handled apart on a simulated GPU (`cuda_tensor.add_special`) that the host runs as well
_HOST_RUNS = frozenset({"aten::_to_copy", "aten::copy_", "aten::_local_scalar_dense", "aten::record_stream"})


def _runs_on_device(op: Any) -> bool:
    """Whether a compiled graph's op runs as the simulated GPU runs it: attention, matmuls (their memory)."""
    return op in cuda_tensor.SimCudaTensor._special and torch_internals.op_schema(op).name not in _HOST_RUNS


def _on_simulated_gpu(op: Any, args: list, kwargs: dict, index: int) -> Any:
    """`op` on host tensors `args` run on simulated GPU `index`, its results the host tensors under them."""
    from torch.utils._pytree import tree_map

    def on_gpu(value: Any) -> Any:
        return cuda_tensor.wrap(value, index) if type(value) is torch.Tensor else value

    def on_host(value: Any) -> Any:
        return cuda_tensor.unwrap(value) if cuda_tensor.is_simulated_cuda(value) else value

    return tree_map(on_host, op(*tree_map(on_gpu, args), **tree_map(on_gpu, kwargs)))
