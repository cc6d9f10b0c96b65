"""Generators of simulated GPUs: `torch.Generator(device="cuda")` and `torch.cuda.default_generators`.

A CPU build cannot make a CUDA generator (it raises "Cannot get CUDA generator without
ATen_cuda library"), and a CUDA build asks the driver. Programs make them all the same
(diffusers' pipelines and training scripts, samplers seeded per device, dropout masks
drawn reproducibly), so in simulated ranks `torch.Generator` is this module's `Generator`:
for a CPU device it makes torch's own generator, and for a simulated GPU a host generator
that says it is that GPU's (`.device` is `cuda:k`). Random ops on a simulated GPU take it
and refuse a CPU one, as a GPU's kernels do (`accel.sim.cuda.tensors.cuda_tensor`).

Its state is CUDA's Philox state, 16 bytes: the seed and an offset that each random op moves
on by the values it draws (rounded up to 4, as DTensor counts them). Code reads and sets that
state as on a GPU: DTensor's RNG tracker moves the offset to each shard's place, LocalTensor
keeps one per rank, activation checkpointing restores it to draw again. A random op draws
with the CPU generator's algorithm from a seed made of (seed, offset) (`drawing`), so the
numbers are a function of the state, as Philox's are, though not Philox's numbers; right
after `manual_seed(s)` they are the CPU generator's for seed `s`. `isinstance(g,
torch.Generator)` holds for every generator, as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from accel.sim.core import torch_internals


class _GeneratorType(type(torch._C.Generator)):  # type: ignore[misc]  # torch's own metaclass (it varies by torch)
    """`torch.Generator` as a type: every torch generator is one (`isinstance`, `issubclass`)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, torch._C.Generator)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, torch._C.Generator)


#: the simulated GPU of each GPU generator, by its C++ generator (`_cdata`): ops receive a new Python object
#: for the generator they were given, so the GPU is found by the generator underneath
_GPU_OF: dict[int, torch.device] = {}


#: each GPU generator's Python object, by its C++ generator: an op given one receives a plain torch._C.Generator
#: for it (whose C++ state is the host generator's), and code there reads the state as a GPU's
_OBJECTS: weakref.WeakValueDictionary[int, GpuGenerator] = weakref.WeakValueDictionary()


def as_gpu_generator(generator: Any) -> Any:
    """The simulated GPU's generator object behind `generator` (what code reads the Philox state of), else it."""
    if generator is None or isinstance(generator, GpuGenerator):
        return generator
    return _OBJECTS.get(torch_internals.generator_key(generator), generator)


def device_of(generator: torch.Generator) -> torch.device:
    """The device `generator` draws for: a simulated GPU for a GPU generator, else its own."""
    return _GPU_OF.get(torch_internals.generator_key(generator), generator.device)


_BITS = (1 << 64) - 1
#: each GPU generator's Philox state, [seed, offset], by its C++ generator (as `_GPU_OF`)
_PHILOX: dict[int, list[int]] = {}
#: the bytes of a CUDA generator's state: a uint64 seed, then an int64 offset
_STATE_BYTES = 16


def _host_seed(seed: int, offset: int) -> int:
    """The host generator's seed for Philox state (seed, offset): the seed itself at offset 0."""
    if offset == 0:
        return seed
    mixed = (seed ^ (offset * 0x9E3779B97F4A7C15)) & _BITS  # splitmix64 of the pair
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _BITS
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _BITS
    return mixed ^ (mixed >> 31)


@contextlib.contextmanager
def drawing(generator: torch.Generator) -> Iterator[Any]:
    """A random op drawing from GPU generator `generator` in the block: its host generator is seeded from
    the Philox state before, and the offset moves on after by what the op drew (`drawn(result)`)."""
    philox = _PHILOX.get(torch_internals.generator_key(generator))
    if philox is None:  # not a simulated GPU's: the op takes it as it is
        yield lambda result: None
        return
    torch._C.Generator.manual_seed(generator, _host_seed(*philox))

    def drawn(result: Any) -> None:
        first = result[0] if isinstance(result, tuple | list) and result else result
        count = first.numel() if isinstance(first, torch.Tensor) else 1
        philox[1] += (count + 3) // 4 * 4

    yield drawn


class GpuGenerator(torch._C.Generator):
    """A generator of simulated GPU `device`: a host generator underneath, CUDA's Philox state to Python."""

    _device: torch.device

    def __new__(cls, device: torch.device) -> GpuGenerator:
        made = super().__new__(cls)  # a CPU generator, seeded as torch seeds a new one (CUDA's seed too)
        made._device = device
        key = torch_internals.generator_key(made)
        _GPU_OF[key] = device
        _PHILOX[key] = [torch._C.Generator.initial_seed(made), 0]
        _OBJECTS[key] = made
        weakref.finalize(made, _forget, key)
        return made

    @property
    def _philox(self) -> list[int]:
        return _PHILOX[torch_internals.generator_key(self)]

    def manual_seed(self, seed: Any) -> GpuGenerator:
        seed = int(seed) & _BITS
        self._philox[:] = [seed, 0]
        return self

    def seed(self) -> int:
        drawn = torch._C.Generator.seed(self)  # a non-deterministic seed, as torch draws one
        self._philox[:] = [drawn, 0]
        return drawn

    def initial_seed(self) -> int:
        return self._philox[0]

    def get_offset(self) -> int:
        return self._philox[1]

    def set_offset(self, offset: int) -> GpuGenerator:
        self._philox[1] = int(offset)
        return self

    # the state is read and made without tensor ops, as CUDA's C++ does: a FakeTensorMode around the call
    # (DTensor's sharding propagation) would refuse a real tensor in one
    def get_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(struct.pack("<Qq", *self._philox)), dtype=torch.uint8)

    def set_state(self, new_state: torch.Tensor) -> GpuGenerator:
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8 or new_state.is_cuda:
            kind = type(new_state).__name__ if not isinstance(new_state, torch.Tensor) else new_state.type()
            raise TypeError(f"expected a torch.ByteTensor, but got {kind}")
        if new_state.numel() not in (_STATE_BYTES, _STATE_BYTES // 2):
            raise RuntimeError(
                f"RNG state is wrong size: a CUDA generator's state is {_STATE_BYTES} bytes (seed and offset, "
                f"what torch.cuda.get_rng_state() gives), not {new_state.numel()}"
            )
        if not new_state.is_contiguous():
            new_state = new_state.contiguous()
        data = ctypes.string_at(new_state.data_ptr(), new_state.numel())
        seed = struct.unpack_from("<Q", data)[0]
        self._philox[:] = [seed, struct.unpack_from("<q", data, 8)[0] if len(data) == _STATE_BYTES else 0]
        return self

    def clone_state(self) -> GpuGenerator:
        twin = GpuGenerator(self._device)
        twin._philox[:] = self._philox
        return twin

    @property
    def device(self) -> torch.device:  # type: ignore[override]  # a property, as on torch.Generator
        return self._device

    def __repr__(self) -> str:
        return f"<torch.Generator object on {self._device}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (and deep-copied) as a GPU's generator: `torch.Generator(device="cuda:k")` with its state
        return (torch.Generator, (self._device,), (self.initial_seed(), self.get_offset(), self.get_state()))

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.set_state(state[2])


def _forget(key: int) -> None:
    _GPU_OF.pop(key, None)
    _PHILOX.pop(key, None)


def generator_type(resolve: Any) -> type:
    """The `torch.Generator` of simulated ranks; `resolve(device)` names the simulated GPU a device means
    (raising as a GPU host does for one it lacks), or gives back any other device."""

    class Generator(torch._C.Generator, metaclass=_GeneratorType):
        __doc__ = torch._C.Generator.__doc__

        def __new__(cls, device: Any = "cpu") -> Any:  # torch's or a GPU's generator
            target = resolve(device)
            if isinstance(target, torch.device) and target.type == "cuda":
                return GpuGenerator(target)
            return torch._C.Generator(device)

    Generator.__module__, Generator.__qualname__ = "torch", "Generator"
    return Generator
