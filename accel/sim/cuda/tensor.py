"""A tensor on a simulated GPU: a CUDA tensor to Python code, a CPU tensor underneath.

`SimCudaTensor` wraps a CPU tensor (its "inner" tensor, which holds the data). Python
code sees `device(type='cuda', index=k)`, `is_cuda`, and `device='cuda:k'` when
printed; C++ sees a device of its own (PrivateUse1, named `simcuda`), on which autograd
runs. Every op on such tensors comes through `__torch_dispatch__`, which applies CUDA's
device rules (`accel.sim.core.device_rules`), runs the op on the inner CPU tensors, draws
random numbers from the simulated GPU's own generator, and wraps the results.

The tensor is the core's wrapper tensor (`accel.sim.core.wrapper`) with the GPU's own
dispatch. The stable names other modules build on: `is_simulated_cuda(t)`, `unwrap(t)` (the inner
CPU tensor, sharing storage) and `wrap(cpu_tensor, index)`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from accel.sim.core import device_rules, torch_internals
from accel.sim.core.wrapper import WrapperTensor
from accel.sim.cuda import memory as cuda_memory
from accel.sim.cuda import shapes as cuda_shapes
from accel.sim.cuda import state as cuda_state

aten = torch.ops.aten
_make_wrapper = torch_internals.make_wrapper
#: the simulated GPUs' allocators (empty when memory is not counted): every new storage is counted
_COUNTING = cuda_memory.counting_list()
_track = cuda_memory.track
#: [True] while simulated GPUs hold shapes only (`accel.sim.cuda.shapes`)
_SHAPES = cuda_shapes.state()

#: the C++ devices under the simulated GPUs (filled when the GPUs are installed)
_HIDDEN: list[torch.device] = []


def set_device_count(count: int) -> None:
    """Prepare the hidden C++ devices of `count` simulated GPUs (after the backend is registered)."""
    _HIDDEN[:] = [torch.device(cuda_state.HIDDEN_DEVICE, i) for i in range(count)]


class SimCudaTensor(WrapperTensor):
    """A tensor on simulated GPU `k`; `_inner` is the CPU tensor holding its data, `_shown` is `cuda:k`.

    The core's wrapper tensor (`accel.sim.core.wrapper`: what Python sees, printing, copies,
    storages, numpy), with the GPU's own dispatch: memory counted as CUDA's allocator counts
    it, shapes-only tensors, and the common op run inline.
    """

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, requires_grad: bool = False) -> SimCudaTensor:
        if _COUNTING:
            _track(inner, device.index or 0)
        self = _make_wrapper(cls, inner, _HIDDEN[device.index or 0], requires_grad)
        self._inner = inner
        self._shown = device
        return self

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]  # a property, as on Tensor
        return True

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # classmethod form torch documents
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # The common case inline (every op comes here, so each call saved counts): an op with
        # no keyword arguments that returns no argument of its own, on tensors of one
        # simulated GPU, unwrapped in the same pass that checks them. Anything else: `dispatch`.
        facts = getattr(func, _FACTS, None)
        if facts is None:
            facts = _facts(func)
        if kwargs or facts[0] is not None or facts[2] or _SHAPES:
            return dispatch(func, args, kwargs or {})
        device = None
        inner_args = []
        for value in args:
            kind = type(value)
            if kind is SimCudaTensor:
                cuda = value._shown
                if device is None:
                    device = cuda
                elif cuda is not device and cuda != device:
                    break
                inner_args.append(value._inner)
            elif (kind is list or kind is tuple) and value and isinstance(value[0], torch.Tensor):
                cuda = _one_gpu_of(value)  # foreach ops, cat, ...
                if cuda is None or (device is not None and cuda is not device and cuda != device):
                    break
                device = cuda
                inner_args.append([item._inner for item in value] if kind is list else tuple(i._inner for i in value))
            elif isinstance(value, torch.Tensor):
                break  # a CPU tensor: the general rules decide
            else:
                inner_args.append(_inner_of(value) if kind is list or kind is tuple else value)
        else:
            if device is not None:
                out = _draw(device.index or 0, func, inner_args, {}) if facts[1] else func(*inner_args)
                if type(out) is torch.Tensor:
                    if _COUNTING and not facts[4]:  # a view's storage is its base's, counted already
                        _track(out, device.index or 0)
                    self = _make_wrapper(SimCudaTensor, out, _HIDDEN[device.index or 0], False)
                    self._inner = out
                    self._shown = device
                    return self
                return _wrap_results(out, {}, device)
        return dispatch(func, args, {})

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return _item((self,), {}).__format__(spec)
        return object.__format__(self, spec)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickled like a real CUDA tensor (plain torch can load it): torch's rebuild
        # function, with the storage's location recorded as cuda:k.
        return torch_internals.reduce_as_tensor_on(self._inner, self._shown, self.requires_grad)

    def type(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        """`Tensor.type`: 'torch.cuda.FloatTensor' and friends, as on a GPU."""
        if dtype is None:
            return self._inner.type().replace("torch.", "torch.cuda.", 1)
        if isinstance(dtype, torch.dtype):
            return self.to(dtype, non_blocking=non_blocking)
        name = dtype if isinstance(dtype, str) else f"{dtype.__module__}.{dtype.__name__}"
        legacy = getattr(torch, name.rsplit(".", 1)[-1])  # torch.FloatTensor, ...: knows its dtype
        device = self._shown if ".cuda." in name else torch.device("cpu")
        return self.to(device=device, dtype=legacy.dtype, non_blocking=non_blocking)

    def tolist(self) -> Any:
        inner = self._inner
        return (cuda_shapes.on_host(inner) if inner.is_meta else inner).tolist()


# -- the stable helpers --------------------------------------------------------------------------


def is_simulated_cuda(tensor: Any) -> bool:
    """Whether `tensor` lives on a simulated GPU."""
    return isinstance(tensor, SimCudaTensor)


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding a simulated CUDA tensor's data (storage shared); other tensors unchanged."""
    return tensor._inner if type(tensor) is SimCudaTensor else tensor


def wrap(cpu_tensor: torch.Tensor, index: int) -> torch.Tensor:
    """`cpu_tensor` seen as a tensor on simulated GPU `index` (storage shared, not copied)."""
    if type(cpu_tensor) is SimCudaTensor:
        raise TypeError(f"wrap() takes a CPU tensor; this one is already on {cpu_tensor.device}")
    return SimCudaTensor(cpu_tensor, cuda_state.gpus().resolve(index))


def set_data(tensor: torch.Tensor, new: torch.Tensor) -> bool:
    """`tensor.data = new` where either is on a simulated GPU, as on a GPU; False when torch's setter serves.

    On a GPU, `set_data` lets a tensor (a parameter, typically) change device and dtype while
    it stays the same Python object: libraries move and shard parameters that way (FSDP2's
    `param.data = param.to(device)`). torch's own setter cannot move a tensor between the
    CPU and the hidden device, so the object's contents are swapped for a tensor sharing
    `new`'s data (`torch.utils.swap_tensors`, as `nn.Module.to` does for such tensors). Its
    attributes, `requires_grad` and whether it is a parameter are kept; a gradient is kept
    when it still fits (same device and dtype), as torch requires of any gradient.
    """
    old, now = type(tensor) is SimCudaTensor, type(new) is SimCudaTensor
    if not (old or now):
        return False
    if old and now:
        # Both wrappers: torch's setter takes the sizes, dtype and flags; the data is the inner tensor's.
        torch_internals.data_descriptor().__set__(tensor, new)
        tensor._inner = new._inner  # type: ignore[attr-defined]  # both are SimCudaTensor here
        tensor._shown = new._shown  # type: ignore[attr-defined]
        return True
    is_param = isinstance(tensor, torch.nn.Parameter)
    with torch.no_grad():
        if type(new) is SimCudaTensor:
            replacement: torch.Tensor = SimCudaTensor(new._inner, new._shown)
            replacement.requires_grad_(tensor.requires_grad)
            if is_param:
                replacement._is_param = True  # what Parameter() marks a subclass with
        elif is_param:
            replacement = torch.nn.Parameter(new.detach(), requires_grad=tensor.requires_grad)
        else:
            replacement = new.detach().requires_grad_(tensor.requires_grad)
    kept = {k: v for k, v in vars(tensor).items() if k not in ("_inner", "_shown", "_is_param")}
    grad = tensor.grad
    replacement.__dict__.update(kept)
    try:
        torch.utils.swap_tensors(tensor, replacement)
    except RuntimeError as error:
        raise RuntimeError(
            f"`tensor.data = x` cannot move a tensor between {new.device if old else tensor.device} and "
            f"{new.device if now else tensor.device} on a simulated GPU while something else holds it ({error}). "
            "On a simulated GPU such a move replaces the tensor's contents, which torch allows only for a tensor "
            "nothing else references (no weak references, no autograd graph, not yet wrapped by DDP); move it "
            "before wrapping, or use module.to(device)."
        ) from error
    if grad is not None and grad.device == tensor.device and grad.dtype == tensor.dtype:
        tensor.grad = grad
    return True


def check_grad(tensor: torch.Tensor, grad: Any) -> None:
    """Before `tensor.grad = grad`: a gradient on another kind of device fails as on a GPU (CUDA's words)."""
    if not isinstance(grad, torch.Tensor):
        return
    kinds = (grad.device.type, tensor.device.type)
    if kinds[0] != kinds[1] and "cuda" in kinds:
        raise RuntimeError(
            f"attempting to assign a gradient with device type '{grad.device.type}' to a tensor with device type "
            f"'{tensor.device.type}'. Please ensure that the gradient and the tensor are on the same device"
        )


def wrap_like(cpu_tensor: torch.Tensor, like: torch.Tensor) -> SimCudaTensor:
    """A CPU result seen as a tensor on the simulated GPU of `like` (storage shared)."""
    return _new(cpu_tensor, like.device)


# -- dispatch ------------------------------------------------------------------------------------

_SEEDED = torch.Tag.nondeterministic_seeded
#: in-place ops that may change a tensor's sizes, strides or offset (besides out= ops)
_RESHAPING = {
    "resize_", "resize_as_", "set_", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_",
    "swapdims_", "swapaxes_", "_resize_output_", "resize_as_sparse_",
}  # fmt: skip
#: attribute of an op holding its facts (kept on the op: a dict keyed by ops would hash
#: them in Python on every call)
_FACTS = "_accel_sim_cuda_facts"


def _facts(func: Any) -> tuple[Any, bool, bool, bool, bool]:
    """(special handler or None, draws random numbers, tracks its argument wrappers, may reshape an argument,
    returns a view of an argument: no new storage to count).

    An op that writes into an argument and returns something (add_, out= ops) returns that
    argument: its wrappers are tracked so the very wrapper is given back. One that returns
    nothing (the in-place foreach ops) needs no tracking unless it may reshape.
    """
    facts = getattr(func, _FACTS, None)
    if facts is None:
        schema = func._schema
        reshapes = schema.is_mutable and (
            any(a.is_out for a in schema.arguments) or schema.name.split("::")[-1] in _RESHAPING
        )
        tracks = schema.is_mutable and (reshapes or len(schema.returns) > 0)
        special = _SPECIAL.get(func)
        if special is None and torch_internals.is_composite(func):
            # Below autograd (inside another subclass's __torch_dispatch__: DTensor's ops) composite
            # ops come here whole; a GPU runs their decomposition, so do we (`to.device` would
            # otherwise copy the inner CPU tensor to the hidden device: a wrapper in a wrapper).
            special = functools.partial(_decompose, func)
        facts = (special, _SEEDED in func.tags, tracks, reshapes, func.is_view)
        setattr(func, _FACTS, facts)
    return facts


def _decompose(func: Any, args: tuple, kwargs: dict) -> Any:
    return func.decompose(*args, **kwargs)


def _inner_of(value: Any) -> Any:
    kind = type(value)
    if kind is SimCudaTensor:
        return value._inner
    if kind is list or kind is tuple:
        items = [item._inner if type(item) is SimCudaTensor else item for item in value]
        return items if kind is list else tuple(items)
    return value


def _unwrap_args(value: Any, seen: dict[int, SimCudaTensor]) -> Any:
    # As `_inner_of`, remembering each wrapper by its inner tensor (an in-place op returns it).
    if type(value) is SimCudaTensor:
        inner = value._inner
        seen[id(inner)] = value
        return inner
    kind = type(value)
    if (kind is list or kind is tuple) and value:
        items = [_unwrap_args(item, seen) if type(item) is SimCudaTensor else item for item in value]
        return items if kind is list else tuple(items)
    if isinstance(value, (list, tuple)) and value and any(type(item) is SimCudaTensor for item in value):
        return kind(_unwrap_args(item, seen) for item in value)
    return value


def _wrap_results(value: Any, seen: dict[int, SimCudaTensor], device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        # An in-place or out= op returns one of its inputs: give back that very wrapper.
        same = seen.get(id(value))
        return same if same is not None else _new(value, device)
    if isinstance(value, (list, tuple)):
        items = [_wrap_results(item, seen, device) for item in value]
        return items if type(value) is list else type(value)(items)
    return value


def _new(inner: torch.Tensor, device: torch.device) -> SimCudaTensor:
    # `SimCudaTensor(inner, device)` without the class call's overhead: every op's result comes here
    if _COUNTING:
        _track(inner, device.index or 0)
    self = _make_wrapper(SimCudaTensor, inner, _HIDDEN[device.index or 0], False)
    self._inner = inner
    self._shown = device
    return self


@contextlib.contextmanager
def on_generator_of(index: int) -> Iterator[None]:
    """Random ops in the block draw from simulated GPU `index`'s generator, not the CPU one."""
    generator = cuda_state.gpus().generators[index]
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(cpu.get_state())
        cpu.set_state(saved)


def _draw(index: int, func: Any, args: Any, kwargs: dict) -> Any:
    """Run random op `func`: on simulated GPU `index`'s generator, or on the one given if a GPU takes it."""
    given = kwargs.get("generator")
    if given is None:
        with on_generator_of(index):
            return func(*args, **kwargs)
    # A GPU kernel takes only a CUDA generator, which a simulated GPU cannot have (see the README).
    raise RuntimeError(f"Expected a 'cuda' device type for generator but found '{given.device.type}'")


def run_on(device: torch.device, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` on CPU tensors for simulated GPU `device`, on that GPU's generator if it draws."""
    if _facts(func)[1]:
        return _draw(device.index or 0, func, args, kwargs)
    return func(*args, **kwargs)


def to_copy(args: tuple, kwargs: dict) -> Any:
    """`_to_copy`: a copy of a tensor on another device and/or dtype."""
    source = args[0]
    gpus = cuda_state.gpus()
    target = kwargs.get("device")
    target = source.device if target is None else gpus.resolve(target)
    # on the GPU, the data stay in host memory; elsewhere (the host, meta) they go where asked
    kwargs = dict(kwargs, device=torch.device("cpu") if target.type == "cuda" else target)
    kwargs.pop("pin_memory", None)  # nothing to pin: the data stay in host memory
    inner = unwrap(source)
    if target.type != "cuda":
        if _SHAPES and inner.is_meta:
            return cuda_shapes.on_host(inner, kwargs.get("dtype"))
        return aten._to_copy.default(inner, **kwargs)
    # the GPU's memory is taken before the host's: a copy that cannot fit fails first
    dtype = kwargs.get("dtype") or source.dtype
    nbytes = source.numel() * dtype.itemsize
    if _SHAPES and (inner.is_meta or not cuda_shapes.keeps_data(nbytes)):
        kwargs["device"] = torch.device("meta")
    reserved = cuda_memory.reserve(target.index or 0, nbytes) if _COUNTING else None
    try:
        out = aten._to_copy.default(inner, **kwargs)
    except BaseException:
        cuda_memory.unreserve(target.index or 0, reserved)
        raise
    _track(out, target.index or 0, reserved)
    return SimCudaTensor(out, target)


def _one_gpu_of(tensors: list | tuple) -> torch.device | None:
    """The device of `tensors` when they are all simulated and on one GPU."""
    device = None
    for item in tensors:
        if type(item) is not SimCudaTensor:
            return None
        cuda = item._shown
        if device is None:
            device = cuda
        elif cuda is not device and cuda != device:
            return None
    return device


def _one_gpu(args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the tensor arguments when they are all simulated and on one GPU (the common case)."""
    device = None
    for values in (args, kwargs.values()) if kwargs else (args,):
        for value in values:
            if type(value) is SimCudaTensor:
                cuda = value._shown
                if device is None:
                    device = cuda
                elif cuda is not device and cuda != device:
                    return None
            elif isinstance(value, torch.Tensor):
                return None  # a CPU tensor: the general rules decide
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                shared = _one_gpu_of(value)  # foreach ops, cat, ...
                if shared is None:
                    return None
                if device is None:
                    device = shared
                elif shared is not device and shared != device:
                    return None
    return device


def _copy_(args: tuple, kwargs: dict) -> Any:
    target, source = unwrap(args[0]), unwrap(args[1])
    if _SHAPES and source.is_meta and not target.is_meta:
        return args[0]  # shapes only: the target keeps its shape, and its data mean nothing
    target.copy_(source, *args[2:], **kwargs)
    return args[0]


def _item(args: tuple, kwargs: dict) -> Any:
    inner = args[0]._inner
    return cuda_shapes.value(inner) if inner.is_meta else inner.item()


#: ops handled apart: copies across devices, reading a value, stream bookkeeping
_SPECIAL = {
    aten._to_copy.default: to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _item,
    aten.record_stream.default: lambda args, kwargs: None,  # one stream per simulated GPU: nothing to record
}


def add_special(handlers: dict[Any, Any]) -> None:
    """Have ops handled apart (`handler(args, kwargs)`), before any of them ran on a simulated GPU."""
    for func in handlers:
        if hasattr(func, _FACTS):
            delattr(func, _FACTS)
    _SPECIAL.update(handlers)


def op_device(func: Any, args: tuple, kwargs: dict) -> torch.device | None:
    """The device op `func` runs on, given its arguments (CUDA's error for arguments on different devices)."""
    device = _one_gpu(args, kwargs)
    return device if device is not None else device_rules.common_device(func, args, kwargs)


def dispatch(func: Any, args: tuple, kwargs: dict, *, apart: bool = True) -> Any:
    """Run aten op `func` whose arguments include simulated CUDA tensors.

    `apart=False`: run it as any op, past its handler (`add_special`), for a handler that did its part.
    """
    facts = getattr(func, _FACTS, None)
    special, seeded, tracks, reshapes, _ = _facts(func) if facts is None else facts
    if special is not None and apart:
        return special(args, kwargs)
    device = op_device(func, args, kwargs)
    if kwargs:
        requested = kwargs.get("device")
        if requested is not None:  # an op that also creates (new_zeros, *_like(device=...))
            device = cuda_state.gpus().resolve(requested)
            if device.type == "cuda":
                kwargs = dict(kwargs, device=torch.device("cpu"))
                kwargs.pop("pin_memory", None)
    seen: dict[int, SimCudaTensor] = {}
    if tracks:
        inner_args = [_unwrap_args(a, seen) for a in args]
        inner_kwargs = {k: _unwrap_args(v, seen) for k, v in kwargs.items()} if kwargs else kwargs
    else:
        inner_args = [
            a._inner if type(a) is SimCudaTensor else _inner_of(a) if type(a) is list or type(a) is tuple else a
            for a in args
        ]
        inner_kwargs = {k: _inner_of(v) for k, v in kwargs.items()} if kwargs else kwargs
    if _SHAPES:
        inner_args, inner_kwargs = cuda_shapes.align(inner_args, inner_kwargs, seen)
    if device is None or device.type != "cuda":
        return func(*inner_args, **inner_kwargs)  # a CPU result was asked for
    out = _draw(device.index or 0, func, inner_args, inner_kwargs) if seeded else func(*inner_args, **inner_kwargs)
    if reshapes:
        for wrapper in seen.values():
            _follow_inner(wrapper)
    if type(out) is torch.Tensor:
        same = seen.get(id(out))
        return same if same is not None else _new(out, device)
    return _wrap_results(out, seen, device)


def _follow_inner(wrapper: SimCudaTensor) -> None:
    # An in-place op may resize or restride the inner tensor (resize_, out=, t_):
    # the wrapper must report the same shape, and the GPU count the storage's new size.
    inner = wrapper._inner
    if _COUNTING:
        cuda_memory.follow(inner)
    if (
        wrapper.shape != inner.shape
        or wrapper.stride() != inner.stride()
        or wrapper.storage_offset() != inner.storage_offset()
    ):
        torch_internals.sync_metadata(wrapper, inner)
