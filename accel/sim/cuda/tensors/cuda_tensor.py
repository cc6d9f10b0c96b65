"""A tensor on a simulated GPU: a CUDA tensor to Python code, a CPU tensor underneath.

`SimCudaTensor` is the core's wrapper tensor (`accel.sim.core.wrapper`) on the simulated
GPUs of the rank (`CudaDevice`): Python code sees `device(type='cuda', index=k)`,
`is_cuda`, and `device='cuda:k'` when printed; C++ sees a device of its own
(PrivateUse1, named `simcuda`), on which autograd runs. What the GPU adds to the core:
CUDA's device rules (`accel.sim.core.device_rules`), memory counted as CUDA's allocator
counts it (`accel.sim.cuda.memory.allocator`), shapes-only tensors (`accel.sim.cuda.gpus.shapes`), one
generator per GPU that a given CPU generator cannot replace, and pickling as a real CUDA
tensor.

The stable names other modules build on: `is_simulated_cuda(t)`, `unwrap(t)` (the inner
CPU tensor, sharing storage), `wrap(cpu_tensor, index)` and `wrap_like(cpu, like)`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from accel.sim.core import device_rules, torch_internals
from accel.sim.core import wrapper as core
from accel.sim.cuda.gpus import generators
from accel.sim.cuda.gpus import shapes as cuda_shapes
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.tensors import sync_debug

aten = torch.ops.aten


class CudaDevice(core.SimDevice):
    """The simulated GPUs of the rank, as the core sees them (their state is `accel.sim.cuda.gpus.state`'s)."""

    type = "cuda"
    hidden = cuda_state.HIDDEN_DEVICE
    takes_ordinals = True
    swaps_data_with_host = True

    def __init__(self) -> None:
        super().__init__(0)
        # The memory counters and the shapes-only switch are lists changed in place: the
        # core tests their truth on every op. Their functions are called as they are.
        self.counting = cuda_memory.counting_list()
        self.general = cuda_shapes.state()
        self.track = cuda_memory.track  # type: ignore[method-assign]  # the same call, unbound
        self.follow = cuda_memory.follow  # type: ignore[method-assign]
        self.align = cuda_shapes.align  # type: ignore[method-assign]

    def resolve(self, device: Any) -> torch.device:
        return cuda_state.gpus().resolve(device)

    def generator(self, index: int) -> torch.Generator:
        return cuda_state.gpus().generators[index]

    def common_device(self, func: Any, args: tuple, kwargs: dict) -> torch.device | None:
        return device_rules.common_device(func, args, kwargs)

    def draw(self, index: int, func: Any, args: Any, kwargs: dict) -> Any:
        given = kwargs.get("generator")
        found = generators.device_of(given) if given is not None else None
        if found is not None and found.type != "cuda":
            # a GPU kernel takes only a CUDA generator (`torch.Generator(device="cuda")`, `gpus.generators`)
            raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{found.type}'")
        with generators.drawing(given if given is not None else self.generator(index)) as drawn:
            result = super().draw(index, func, args, kwargs)
            drawn(result)
        return result


class SimCudaTensor(core.WrapperTensor):
    """A tensor on simulated GPU `k`; `_inner` is the CPU tensor holding its data, `_shown` is `cuda:k`."""

    _sim = CudaDevice()

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]  # a property, as on Tensor
        return True

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled like a real CUDA tensor (plain torch can load it): torch's rebuild
        # function, with the storage's location recorded as cuda:k.
        return torch_internals.reduce_as_tensor_on(self._inner, self._shown, self.requires_grad)

    def tolist(self) -> Any:
        sync_debug.waiting()
        inner = self._inner
        return (cuda_shapes.on_host(inner) if inner.is_meta else inner).tolist()


SIM = SimCudaTensor._sim


def set_device_count(count: int) -> None:
    """Prepare the hidden C++ devices of `count` simulated GPUs (after the backend is registered)."""
    SIM.attach(count)


# -- the stable helpers --------------------------------------------------------------------------

unwrap = core.unwrap
#: run an aten op on simulated CUDA tensors (`apart=False`: past its handler, for a handler that did its part)
dispatch = functools.partial(core.dispatch, SimCudaTensor)
#: the device an op runs on, given its arguments (CUDA's error for arguments on different devices)
op_device = functools.partial(core.op_device, SimCudaTensor)
#: run `func` on CPU tensors for a simulated GPU, on that GPU's generator if it draws
run_on = functools.partial(core.run_on, SimCudaTensor)
#: have ops handled apart on simulated GPUs (`handler(args, kwargs)`)
add_special = functools.partial(core.add_special, SimCudaTensor)


def is_simulated_cuda(tensor: Any) -> bool:
    """Whether `tensor` lives on a simulated GPU."""
    return isinstance(tensor, SimCudaTensor)


def wrap(cpu_tensor: torch.Tensor, index: int) -> torch.Tensor:
    """`cpu_tensor` seen as a tensor on simulated GPU `index` (storage shared, not copied)."""
    return core.wrap(SimCudaTensor, cpu_tensor, index)


def host_tensors(*values: Any) -> list[Any]:
    """The host tensors under simulated ones (others as given); all shapes when one is (shapes only), so that a
    kernel written on host tensors computes shapes only."""
    inner = [unwrap(v) if isinstance(v, torch.Tensor) else v for v in values]
    inner, _ = cuda_shapes.align(inner, {}, {})
    return inner


def wrap_like(cpu_tensor: torch.Tensor, like: torch.Tensor) -> SimCudaTensor:
    """A CPU result seen as a tensor on the simulated GPU of `like` (storage shared)."""
    return SimCudaTensor(cpu_tensor, like.device)


# -- ops a GPU handles apart from the core: memory and shapes ------------------------------------------


def to_copy(args: tuple, kwargs: dict) -> Any:
    """`_to_copy`: a copy of a tensor on another device and/or dtype; the GPU's memory is taken before the host's."""
    source = args[0]
    target, kwargs = core.copy_target(SimCudaTensor, args, kwargs)
    inner = unwrap(source)
    if target.type != "cuda":
        sync_debug.blocking_copy(kwargs)
        if SIM.general and inner.is_meta:
            return cuda_shapes.on_host(inner, kwargs.get("dtype"))
        return aten._to_copy.default(inner, **kwargs)
    # a copy that cannot fit fails first
    dtype = kwargs.get("dtype") or source.dtype
    nbytes = source.numel() * dtype.itemsize
    if SIM.general and (inner.is_meta or not cuda_shapes.keeps_data(nbytes)):
        kwargs["device"] = torch.device("meta")
    reserved = cuda_memory.reserve(target.index or 0, nbytes) if SIM.counting else None
    try:
        out = aten._to_copy.default(inner, **kwargs)
    except BaseException:
        cuda_memory.unreserve(target.index or 0, reserved)
        raise
    cuda_memory.track(out, target.index or 0, reserved)
    return SimCudaTensor(out, target)


def _copy_(args: tuple, kwargs: dict) -> Any:
    target, source = unwrap(args[0]), unwrap(args[1])
    if is_simulated_cuda(args[0]) != is_simulated_cuda(args[1]):  # between the host and the GPU
        sync_debug.blocking_copy(kwargs, args)
    if SIM.general and source.is_meta and not target.is_meta:
        return args[0]  # shapes only: the target keeps its shape, and its data mean nothing
    target.copy_(source, *args[2:], **kwargs)
    return args[0]


def _item(args: tuple, kwargs: dict) -> Any:
    sync_debug.waiting()
    inner = args[0]._inner
    return cuda_shapes.value(inner) if inner.is_meta else inner.item()


add_special({aten._to_copy.default: to_copy, aten.copy_.default: _copy_, aten._local_scalar_dense.default: _item})
