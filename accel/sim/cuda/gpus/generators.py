"""Generators of simulated GPUs: `torch.Generator(device="cuda")` and `torch.cuda.default_generators`.

A CPU build cannot make a CUDA generator (it raises "Cannot get CUDA generator without
ATen_cuda library"), and a CUDA build asks the driver. Programs make them all the same
(diffusers' pipelines and training scripts, samplers seeded per device, dropout masks
drawn reproducibly), so in simulated ranks `torch.Generator` is this module's `Generator`:
for a CPU device it makes torch's own generator, and for a simulated GPU a host generator
that says it is that GPU's (`.device` is `cuda:k`). Random ops on a simulated GPU take it
and refuse a CPU one, as a GPU's kernels do (`accel.sim.cuda.tensors.cuda_tensor`). Its numbers follow
the CPU generator's algorithm, as every simulated GPU's do (not CUDA's Philox stream), and
its state is a CPU generator's (`get_state`). `isinstance(g, torch.Generator)` holds for
every generator, as before.
"""

from __future__ import annotations

import weakref
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


def device_of(generator: torch.Generator) -> torch.device:
    """The device `generator` draws for: a simulated GPU for a GPU generator, else its own."""
    return _GPU_OF.get(torch_internals.generator_key(generator), generator.device)


class GpuGenerator(torch._C.Generator):
    """A generator of simulated GPU `device`: a host generator underneath, `cuda:k` to Python."""

    _device: torch.device

    def __new__(cls, device: torch.device) -> GpuGenerator:
        made = super().__new__(cls)  # a CPU generator, seeded as torch seeds a new one
        made._device = device
        key = torch_internals.generator_key(made)
        _GPU_OF[key] = device
        weakref.finalize(made, _GPU_OF.pop, key, None)
        return made

    @property
    def device(self) -> torch.device:  # type: ignore[override]  # a property, as on torch.Generator
        return self._device

    def __repr__(self) -> str:
        return f"<torch.Generator object on {self._device}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled (and deep-copied) as a GPU's generator: `torch.Generator(device="cuda:k")` with its state
        return (torch.Generator, (self._device,), *super().__reduce__()[2:])


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
