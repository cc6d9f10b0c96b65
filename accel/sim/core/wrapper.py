"""The wrapper tensor of a simulated device: a device tensor to Python, a CPU tensor underneath.

A `WrapperTensor` subclass (one per kind of simulated device) wraps a CPU tensor, its
"inner" tensor, which holds the data. Python code sees the device the subclass's
`SimDevice` shows (`xla:0`, ...); C++ sees the hidden PrivateUse1 device
(`accel.sim.core.hidden`), on which autograd runs. Every op on such tensors comes through
`__torch_dispatch__`, which asks the device which device the op computes on (its rules:
mixing with CPU tensors raises the real device's error), runs the op on the inner CPU
tensors, draws random numbers from the device's own generator, and wraps the results.

The stable names a device builds on: `SimDevice` (what a device tells the core),
`WrapperTensor`, `unwrap(t)` (the inner CPU tensor, sharing storage) and `wrap(cpu, device)`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from accel.sim.core import torch_internals

aten = torch.ops.aten
_make_wrapper = torch_internals.make_wrapper


class SimDevice:
    """What a kind of simulated device tells the core: its type, its hidden devices, generators and rules.

    Subclasses override `common_device` (which device an op computes on, raising the real
    device's error on a mismatch) and may override the other methods.
    """

    #: the device type Python code sees ("xla")
    type: str = ""
    #: the name of the hidden PrivateUse1 device under its tensors ("simxla")
    hidden: str = ""

    def __init__(self, count: int = 1) -> None:
        #: the hidden C++ devices, one per shown device (filled by `attach`, once the hidden device is registered)
        self.hidden_devices: list[torch.device] = []
        self.devices = [torch.device(self.type, i) for i in range(count)]
        self.generators = [torch.Generator() for _ in range(count)]
        self.current = 0

    def attach(self) -> None:
        """The hidden device is registered: make its C++ devices."""
        self.hidden_devices = [torch.device(self.hidden, i) for i in range(len(self.devices))]

    def resolve(self, device: Any) -> torch.device:
        """The shown device for any way of naming one of this device's ("xla", "xla:0", hidden); others unchanged."""
        device = torch.device(device)
        if device.type not in (self.type, self.hidden):
            return device
        index = self.current if device.index is None else device.index
        if not 0 <= index < len(self.devices):
            raise RuntimeError(f"{self.type}:{index} is not a device of this process (it has {len(self.devices)})")
        return self.devices[index]

    def is_mine(self, device: Any) -> bool:
        """Whether `device` (a device, or a string naming one) is one of this kind's, shown or hidden."""
        if isinstance(device, str):
            return device.split(":", 1)[0] in (self.type, self.hidden)
        return isinstance(device, torch.device) and device.type in (self.type, self.hidden)

    def common_device(self, func: Any, args: tuple, kwargs: dict) -> torch.device | None:
        """The device `func` computes on, given arguments mixing devices; raises as the real device does."""
        raise NotImplementedError(f"{type(self).__name__} must say how its ops mix devices")

    def generator(self, index: int) -> torch.Generator:
        """The generator random ops on device `index` draw from."""
        return self.generators[index]


class WrapperTensor(torch.Tensor):
    """A tensor on a simulated device; `_inner` is the CPU tensor holding its data, `_shown` its device."""

    _inner: torch.Tensor
    _shown: torch.device
    #: the kind of device this subclass's tensors live on (set by each subclass)
    _sim: ClassVar[SimDevice]

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, requires_grad: bool = False) -> WrapperTensor:
        self = _make_wrapper(cls, inner, cls._sim.hidden_devices[device.index or 0], requires_grad)
        self._inner = inner
        self._shown = device
        return self

    # -- what Python sees ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:  # type: ignore[override]  # a property, as on Tensor
        return self._shown

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]  # a property, as on Tensor
        return False

    def get_device(self) -> int:
        return self._shown.index or 0

    __torch_function__ = torch_internals.disabled_torch_function  # type: ignore[assignment]  # C++ signature

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # classmethod form torch documents
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        # The common case inline (every op comes here): no keyword arguments, nothing special,
        # no argument reshaped, all tensors of this class on one device. Else: `dispatch`.
        facts = getattr(func, _FACTS, None)
        if facts is None:
            facts = _facts(func)
        if kwargs or facts[0] is not None or facts[3]:
            return dispatch(cls, func, args, kwargs or {})
        device = None
        inner_args = []
        for value in args:
            kind = type(value)
            if kind is cls:
                shown = value._shown
                if device is None:
                    device = shown
                elif shown is not device and shown != device:
                    break
                inner_args.append(value._inner)
            elif isinstance(value, torch.Tensor) or (
                (kind is list or kind is tuple) and value and isinstance(value[0], torch.Tensor)
            ):
                break  # lists of tensors, CPU tensors: the general path
            else:
                inner_args.append(value)
        else:
            if device is not None:
                if facts[1]:
                    with on_generator(cls._sim.generator(device.index or 0)):
                        out = func(*inner_args)
                else:
                    out = func(*inner_args)
                if facts[2]:  # written into an argument (add_, ...): that very wrapper comes back
                    seen = {id(value._inner): value for value in args if type(value) is cls}
                    same = seen.get(id(out))
                    return same if same is not None else _wrap_results(cls, out, seen, device)
                if type(out) is torch.Tensor:
                    self = _make_wrapper(cls, out, cls._sim.hidden_devices[device.index or 0], False)
                    self._inner = out
                    self._shown = device
                    return self
                return _wrap_results(cls, out, {}, device)
        return dispatch(cls, func, args, kwargs or {})

    # A "traceable wrapper subclass": nn.Module.to swaps parameter objects instead of
    # `param.data = new`, which would turn a device parameter into a CPU one.
    def __tensor_flatten__(self) -> tuple[list[str], torch.device]:
        return ["_inner"], self._shown

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, device: torch.device, outer_size: Any, outer_stride: Any) -> Any:
        return cls(inner["_inner"], device)

    def __repr__(self, *, tensor_contents: str | None = None) -> str:  # type: ignore[override]  # Tensor.__repr__ takes the same keyword, not in the stubs
        with torch.no_grad():
            text, data = torch_internals.tensor_text(self._inner, tensor_contents)
        head = "tensor(" + (tensor_contents if tensor_contents is not None else data)
        suffix = f", device='{self._shown}'"
        text = head + suffix + text[len(head) :] if text.startswith(head) else text[:-1] + suffix + ")"
        if self.grad_fn is not None:
            text = text[:-1] + f", grad_fn=<{type(self.grad_fn).__name__}>)"
        elif self.requires_grad:
            text = text[:-1] + ", requires_grad=True)"
        if getattr(self, "_is_param", False):
            text = "Parameter containing:\n" + text
        return text

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self._inner.item().__format__(spec)
        return object.__format__(self, spec)

    def __deepcopy__(self, memo: dict) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = type(self)(self._inner.clone(memory_format=torch.preserve_format), self._shown)
        if self.requires_grad:
            new.requires_grad_(True)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in ("_inner", "_shown"):
                setattr(new, key, copy.deepcopy(value, memo))
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        return new

    def untyped_storage(self) -> torch.UntypedStorage:
        # The inner tensor's storage (what shares memory with what), reporting the shown device.
        return torch_internals.show_storage_on(self._inner.untyped_storage(), self._shown)

    def data_ptr(self) -> int:
        return self._inner.data_ptr()

    def tolist(self) -> Any:
        return self._inner.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        if force:
            return self._inner.detach().numpy()
        # torch's own words (tensor_numpy.cpp) for a tensor not on the CPU
        raise TypeError(
            f"can't convert {self._shown} device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
            "host memory first."
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        return self.numpy()


# -- the stable helpers --------------------------------------------------------------------------


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding a wrapper's data (storage shared); other tensors unchanged."""
    return tensor._inner if isinstance(tensor, WrapperTensor) else tensor


def wrap(cls: type[WrapperTensor], cpu_tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """`cpu_tensor` seen as a tensor of `cls` on `device` (storage shared, not copied)."""
    if isinstance(cpu_tensor, WrapperTensor):
        raise TypeError(f"wrap() takes a CPU tensor; this one is already on {cpu_tensor.device}")
    return cls(cpu_tensor, cls._sim.resolve(device))


# -- dispatch ------------------------------------------------------------------------------------

_SEEDED = torch.Tag.nondeterministic_seeded
#: in-place ops that may change a tensor's sizes, strides or offset (besides out= ops)
_RESHAPING = {
    "resize_", "resize_as_", "set_", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_",
    "swapdims_", "swapaxes_", "_resize_output_", "resize_as_sparse_",
}  # fmt: skip
#: attribute of an op holding its facts for the core's wrappers
_FACTS = "_accel_sim_core_facts"


def _facts(func: Any) -> tuple[Any, bool, bool, bool]:
    """(special handler or None, draws random numbers, tracks its argument wrappers, may reshape an argument)."""
    facts = getattr(func, _FACTS, None)
    if facts is None:
        schema = func._schema
        reshapes = schema.is_mutable and (
            any(a.is_out for a in schema.arguments) or schema.name.split("::")[-1] in _RESHAPING
        )
        tracks = schema.is_mutable and (reshapes or len(schema.returns) > 0)
        special = _SPECIAL.get(func)
        if special is None and torch_internals.is_composite(func):
            # Below autograd (inside another subclass's dispatch) composite ops come whole: run
            # their decomposition, as the real device does.
            special = functools.partial(_decompose, func)
        facts = (special, _SEEDED in func.tags, tracks, reshapes)
        setattr(func, _FACTS, facts)
    return facts


def _decompose(func: Any, cls: type[WrapperTensor], args: tuple, kwargs: dict) -> Any:
    return func.decompose(*args, **kwargs)


def _unwrap_args(value: Any, seen: dict[int, WrapperTensor]) -> Any:
    if isinstance(value, WrapperTensor):
        inner = value._inner
        seen[id(inner)] = value
        return inner
    if isinstance(value, (list, tuple)) and value:
        items = [_unwrap_args(item, seen) for item in value]
        return items if type(value) is list else type(value)(items)
    return value


def _wrap_results(cls: type[WrapperTensor], value: Any, seen: dict[int, WrapperTensor], device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        same = seen.get(id(value))  # an in-place or out= op returns one of its inputs: that very wrapper
        return same if same is not None else cls(value, device)
    if isinstance(value, (list, tuple)):
        items = [_wrap_results(cls, item, seen, device) for item in value]
        return items if type(value) is list else type(value)(items)
    return value


def _one_device(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the tensor arguments when they are all of `cls` and on one device (the common case)."""
    device = None
    for values in (args, kwargs.values()) if kwargs else (args,):
        for value in values:
            if type(value) is cls:
                shown = value._shown
                if device is None:
                    device = shown
                elif shown != device:
                    return None
            elif isinstance(value, torch.Tensor):
                return None
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                for item in value:
                    if type(item) is not cls:
                        return None
                    if device is None:
                        device = item._shown
                    elif item._shown != device:
                        return None
    return device


@contextlib.contextmanager
def on_generator(generator: torch.Generator) -> Iterator[None]:
    """Random ops in the block draw from `generator` (a CPU one), not torch's default CPU generator."""
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(cpu.get_state())
        cpu.set_state(saved)


def run_on(cls: type[WrapperTensor], device: torch.device, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` on CPU tensors for `device`, drawing from that device's generator if it draws."""
    if _facts(func)[1] and kwargs.get("generator") is None:
        with on_generator(cls._sim.generator(device.index or 0)):
            return func(*args, **kwargs)
    return func(*args, **kwargs)


def dispatch(cls: type[WrapperTensor], func: Any, args: tuple, kwargs: dict) -> Any:
    """Run aten op `func` whose arguments include tensors of `cls`."""
    special, seeded, tracks, reshapes = _facts(func)
    if special is not None:
        return special(cls, args, kwargs)
    sim = cls._sim
    device = _one_device(cls, args, kwargs)
    if device is None:
        device = sim.common_device(func, args, kwargs)
    requested = kwargs.get("device") if kwargs else None
    if requested is not None:  # an op that also creates (new_zeros, *_like(device=...))
        device = sim.resolve(requested)
        if device.type == sim.type:
            kwargs = dict(kwargs, device=torch.device("cpu"))
            kwargs.pop("pin_memory", None)
    seen: dict[int, WrapperTensor] = {}
    inner_args = [_unwrap_args(a, seen) for a in args]
    inner_kwargs = {k: _unwrap_args(v, seen) for k, v in kwargs.items()} if kwargs else kwargs
    if device is None or device.type != sim.type:
        return func(*inner_args, **inner_kwargs)  # a CPU result was asked for
    if seeded and inner_kwargs.get("generator") is None:
        with on_generator(sim.generator(device.index or 0)):
            out = func(*inner_args, **inner_kwargs)
    else:
        out = func(*inner_args, **inner_kwargs)
    if reshapes and tracks:
        for wrapper in seen.values():
            _follow_inner(wrapper)
    if not tracks:
        seen.clear()
    if type(out) is torch.Tensor:
        same = seen.get(id(out))
        return same if same is not None else cls(out, device)
    return _wrap_results(cls, out, seen, device)


def _follow_inner(wrapper: WrapperTensor) -> None:
    # An in-place op may resize or restride the inner tensor (resize_, out=, t_): the wrapper follows.
    inner = wrapper._inner
    if (
        wrapper.shape != inner.shape
        or wrapper.stride() != inner.stride()
        or wrapper.storage_offset() != inner.storage_offset()
    ):
        torch_internals.sync_metadata(wrapper, inner)


# -- ops handled apart ---------------------------------------------------------------------------------


def to_copy(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> Any:
    """`_to_copy`: a copy of a tensor on another device and/or dtype."""
    source = args[0]
    sim = cls._sim
    target = kwargs.get("device")
    target = source.device if target is None else sim.resolve(target)
    kwargs = dict(kwargs, device=torch.device("cpu") if target.type == sim.type else target)
    kwargs.pop("pin_memory", None)  # nothing to pin: the data stay in host memory
    out = aten._to_copy.default(unwrap(source), **kwargs)
    return cls(out, target) if target.type == sim.type else out


def _copy_(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> Any:
    unwrap(args[0]).copy_(unwrap(args[1]), *args[2:], **kwargs)
    return args[0]


def _item(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> Any:
    return args[0]._inner.item()


#: ops handled apart: copies across devices, reading a value, stream bookkeeping
_SPECIAL: dict[Any, Any] = {
    aten._to_copy.default: to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _item,
    aten.record_stream.default: lambda cls, args, kwargs: None,
}


# -- how tensors get onto the device: factory kernels ---------------------------------------------------

#: factories that never target a device, or that torch.tensor / as_tensor replace in Python
_NOT_FACTORIES = {
    "_make_dep_token", "_cudnn_init_dropout_state", "from_file", "_empty_affine_quantized",
    "_sparse_coo_tensor_with_dims", "sparse_coo_tensor", "_sparse_compressed_tensor_with_dims",
    "Generator", "tensor", "as_tensor",
}  # fmt: skip
_libraries: list[torch.library.Library] = []


def factory_kernel(cls: type[WrapperTensor], op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run factory `op` aimed at `cls`'s device on the CPU, and wrap what it made."""
    sim = cls._sim
    device = kwargs.get("device")
    if device is None or not sim.is_mine(device):
        raise NotImplementedError(
            f"{op} reached the simulated {sim.type} device without a device argument naming it; the simulator has "
            "no kernel for it (please report this with the code that called it)"
        )
    device = sim.resolve(device)
    kwargs = dict(kwargs, device=torch.device("cpu"))
    kwargs.pop("pin_memory", None)
    out = run_on(cls, device, op, args, kwargs)
    if isinstance(out, torch.Tensor):
        return cls(out, device)
    return type(out)(cls(t, device) for t in out)


def _copy_kernel(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # Reached with the Python key excluded (C++ internals copying into a new tensor).
    unwrap(self).copy_(unwrap(src), non_blocking)
    return self


def register_factories(keys: tuple[str, ...], kernel: Callable[..., Any]) -> None:
    """Give dispatch keys `keys` (the shown device's, "PrivateUse1") `kernel(op, *args, **kwargs)` for every factory.

    A factory aimed at the shown device (`torch.zeros(..., device="xla")`, the empty tensor
    behind `.to("xla")`) is dispatched by torch to that device's key, where a CPU build has
    no kernel; factories with composite kernels get one of their own, so the composite
    never resizes a wrapper's inner tensor behind its back. Once per process: the
    registrations are process-wide. (`factory_kernel` is the plain kernel, for a class.)
    """
    fallback = torch.library.Library("_", "IMPL")
    for key in keys:
        fallback.fallback(kernel, key)
    kernels = torch.library.Library("aten", "IMPL")
    for name in torch_internals.factory_op_names():
        base, _, overload = name.partition(".")
        if base in _NOT_FACTORIES:
            continue
        op = getattr(getattr(aten, base, None), overload or "default", None)
        if op is None:
            continue
        for key in keys:
            kernels.impl(name, functools.partial(kernel, op), key)
    for key in keys:
        kernels.impl("copy_", _copy_kernel, key)
    _libraries.extend([fallback, kernels])
