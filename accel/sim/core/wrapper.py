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
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from accel.sim.core import moves, torch_internals

aten = torch.ops.aten
_make_wrapper = torch_internals.make_wrapper


class SimDevice:
    """What a kind of simulated device tells the core: its type, its hidden devices, generators and rules.

    Subclasses override `common_device` (which device an op computes on, raising the real
    device's error on a mismatch) and may override the other methods. A device that counts
    its memory fills `counting` while it does (every new storage then goes to `track`); one
    that must see every op's arguments (shapes-only tensors) fills `general` (then `align`
    sees them).
    """

    #: the device type Python code sees ("xla")
    type: str = ""
    #: the name of the hidden PrivateUse1 device under its tensors ("simxla")
    hidden: str = ""
    #: whether a plain int names one of its devices (`.to(0)` means cuda:0 on a GPU host)
    takes_ordinals: bool = False
    #: whether `t.data = x` may move a tensor between the host and this device (torch lets
    #: CPU and CUDA tensors swap data, `has_compatible_shallow_copy_type`; not XLA tensors)
    swaps_data_with_host: bool = False

    def __init__(self, count: int = 1) -> None:
        #: the hidden C++ devices, one per shown device (filled by `attach`, once the hidden device is registered)
        self.hidden_devices: list[torch.device] = []
        self.devices = [torch.device(self.type, i) for i in range(count)]
        self.generators = [torch.Generator() for _ in range(count)]
        self.current = 0
        #: non-empty while the device counts its memory (its counters): new storages go to `track`
        self.counting: list[Any] = []
        #: non-empty while every op must take the general path (`dispatch`, where `align` sees it)
        self.general: list[Any] = []
        #: non-empty while a clock times each op on the device (then `time_op` hears of each)
        self.timing: list[Any] = []

    def attach(self, count: int | None = None) -> None:
        """The hidden device is registered: make its C++ devices (`count` of them; default: one per shown device)."""
        count = len(self.devices) if count is None else count
        self.hidden_devices = [torch.device(self.hidden, i) for i in range(count)]

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

    def names_me(self, value: Any) -> bool:
        """Whether `value`, given where a device goes (`.to(value)`), names one of this kind's."""
        if self.takes_ordinals and isinstance(value, int) and not isinstance(value, bool):
            return True
        return self.is_mine(value)

    def common_device(self, func: Any, args: tuple, kwargs: dict) -> torch.device | None:
        """The device `func` computes on, given arguments mixing devices; raises as the real device does."""
        raise NotImplementedError(f"{type(self).__name__} must say how its ops mix devices")

    def generator(self, index: int) -> torch.Generator:
        """The generator random ops on device `index` draw from."""
        return self.generators[index]

    def draw(self, index: int, func: Any, args: Any, kwargs: dict) -> Any:
        """Run random op `func` on CPU tensors for device `index`: from the generator given, else the device's."""
        if kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        with on_generator(self.generator(index)):
            return func(*args, **kwargs)

    def track(self, inner: torch.Tensor, index: int, reserved: Any = None) -> None:
        """A new storage on device `index` (while `counting`): count it (`reserved`: its memory, taken already)."""

    def follow(self, inner: torch.Tensor) -> None:
        """An in-place op may have resized `inner`'s storage (while `counting`)."""

    def align(self, args: list, kwargs: dict, seen: dict[int, Any]) -> tuple[list, dict]:
        """The CPU arguments of an op, as the device runs it (while `general`)."""
        return args, kwargs

    def time_op(self, index: int, func: Any, args: Any, kwargs: dict, out: Any) -> None:
        """Op `func` ran on device `index` with these arguments and result (while `timing`)."""


class WrapperTensor(torch.Tensor):
    """A tensor on a simulated device; `_inner` is the CPU tensor holding its data, `_shown` its device."""

    _inner: torch.Tensor
    _shown: torch.device
    #: the kind of device this subclass's tensors live on (set by each subclass)
    _sim: ClassVar[SimDevice]
    #: this subclass's ops handled apart: op -> handler(args, kwargs) (`add_special`)
    _special: ClassVar[dict[Any, Callable[[tuple, dict], Any]]]
    #: the attribute of an op holding its facts for this subclass (`_facts`)
    _facts_key: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The core's handlers, bound to this class; facts cached on each op per class
        # (a dict keyed by ops would hash them in Python on every call).
        cls._special = {op: functools.partial(handler, cls) for op, handler in _SPECIAL.items()}
        cls._facts_key = f"_accel_sim_facts_{cls.__module__.replace('.', '_')}_{cls.__qualname__}"

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, requires_grad: bool = False) -> WrapperTensor:
        return _new(cls, inner, device, requires_grad)

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
        # The common case inline (every op comes here, so each call saved counts): an op with
        # no keyword arguments that reshapes none of its arguments, on tensors of one device,
        # unwrapped in the same pass that checks them. Anything else: `dispatch`.
        sim = cls._sim
        facts = getattr(func, cls._facts_key, None)
        if facts is None:
            facts = _facts(cls, func)
        if kwargs or facts[0] is not None or facts[3] or sim.general:
            if len(types) > 1:  # another library's tensor subclass too: its dispatch first, as on the device
                return _after_other_subclasses(cls, func, types, args, kwargs or {})
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
            elif (kind is list or kind is tuple) and value and isinstance(value[0], torch.Tensor):
                shared = _one_device_of(cls, value)  # foreach ops, cat, ...
                if shared is None or (device is not None and shared is not device and shared != device):
                    break
                device = shared
                inner_args.append([item._inner for item in value] if kind is list else tuple(i._inner for i in value))
            elif isinstance(value, torch.Tensor):
                break  # a CPU tensor: the device's rules decide
            elif (kind is list or kind is tuple) and value and value[0] is None:
                break  # an index list with tensors after a None (x[:, idx]): the device's rules decide
            else:
                inner_args.append(value)
        else:
            if device is not None:
                index = device.index or 0
                out = sim.draw(index, func, inner_args, {}) if facts[1] else func(*inner_args)
                if sim.timing and not _inside and not _tracing:
                    sim.time_op(index, func, inner_args, {}, out)
                if facts[2]:  # written into an argument (add_, ...): that very wrapper comes back
                    seen = {id(value._inner): value for value in args if type(value) is cls}
                    same = seen.get(id(out))
                    return same if same is not None else _wrap_results(cls, out, seen, device)
                if type(out) is torch.Tensor:
                    if sim.counting and not facts[4]:  # a view's storage is its base's, counted already
                        sim.track(out, index)
                    self = _make_wrapper(cls, out, sim.hidden_devices[index], False)
                    self._inner = out
                    self._shown = device
                    return self
                return _wrap_results(cls, out, {}, device)
        if len(types) > 1:
            return _after_other_subclasses(cls, func, types, args, {})
        return dispatch(cls, func, args, {})

    # A "traceable wrapper subclass": nn.Module.to swaps parameter objects instead of
    # `param.data = new`, which would turn a device parameter into a CPU one.
    def __tensor_flatten__(self) -> tuple[list[str], torch.device]:
        return ["_inner"], self._shown

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, device: torch.device, outer_size: Any, outer_stride: Any) -> Any:
        return cls(inner["_inner"], device)

    def __repr__(self, *, tensor_contents: str | None = None) -> str:  # type: ignore[override]  # Tensor.__repr__ takes the same keyword, not in the stubs
        if torch_internals.is_fake(self._inner):  # while Dynamo traces: no data to print
            return f"FakeTensor(..., device='{self._shown}', size={tuple(self.shape)}, dtype={self.dtype})"
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
            return self._special[_ITEM]((self,), {}).__format__(spec)
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

    def type(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        """`Tensor.type`: 'torch.<type>.FloatTensor' and friends, as on the real device."""
        kind = f".{self._shown.type}."
        if dtype is None:
            return self._inner.type().replace("torch.", "torch" + kind, 1)
        if isinstance(dtype, torch.dtype):
            return self.to(dtype, non_blocking=non_blocking)
        name = dtype if isinstance(dtype, str) else f"{dtype.__module__}.{dtype.__name__}"
        legacy = getattr(torch, name.rsplit(".", 1)[-1])  # torch.FloatTensor, ...: knows its dtype
        device = self._shown if kind in name else torch.device("cpu")
        return self.to(device=device, dtype=legacy.dtype, non_blocking=non_blocking)

    def untyped_storage(self) -> torch.UntypedStorage:
        # The inner tensor's storage (what shares memory with what), reporting the shown device;
        # the wrapper's own while Dynamo describes it (torch_internals.describe_wrappers_for_tracing).
        if torch_internals.describing_wrapper():
            return torch.Tensor.untyped_storage(self)
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


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` and in the lists and tuples nested in it, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding a wrapper's data (storage shared); other tensors unchanged."""
    return tensor._inner if isinstance(tensor, WrapperTensor) else tensor


def wrap(cls: type[WrapperTensor], cpu_tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """`cpu_tensor` seen as a tensor of `cls` on `device` (storage shared, not copied)."""
    if isinstance(cpu_tensor, WrapperTensor):
        raise TypeError(f"wrap() takes a CPU tensor; this one is already on {cpu_tensor.device}")
    return cls(cpu_tensor, cls._sim.resolve(device))


def add_special(cls: type[WrapperTensor], handlers: dict[Any, Callable[[tuple, dict], Any]]) -> None:
    """Have `cls`'s ops in `handlers` handled apart (`handler(args, kwargs)`); replaces any handler they had."""
    for func in handlers:
        if hasattr(func, cls._facts_key):
            delattr(func, cls._facts_key)
    cls._special.update(handlers)


# -- dispatch ------------------------------------------------------------------------------------

_SEEDED = torch.Tag.nondeterministic_seeded
#: in-place ops that may change a tensor's sizes, strides or offset (besides out= ops)
_RESHAPING = {
    "resize_", "resize_as_", "set_", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_",
    "swapdims_", "swapaxes_", "_resize_output_", "resize_as_sparse_",
}  # fmt: skip


def _facts(cls: type[WrapperTensor], func: Any) -> tuple[Any, bool, bool, bool, bool]:
    """(special handler or None, draws random numbers, tracks its argument wrappers, may reshape an argument,
    returns a view of an argument: no new storage to count).

    An op that writes into an argument and returns something (add_, out= ops) returns that
    argument: its wrappers are tracked so the very wrapper is given back. One that returns
    nothing (the in-place foreach ops) needs no tracking unless it may reshape.
    """
    facts = getattr(func, cls._facts_key, None)
    if facts is None:
        schema = func._schema
        reshapes = schema.is_mutable and (
            any(a.is_out for a in schema.arguments) or schema.name.split("::")[-1] in _RESHAPING
        )
        tracks = schema.is_mutable and (reshapes or len(schema.returns) > 0)
        special = cls._special.get(func)
        if special is None and torch_internals.is_composite(func):
            # Below autograd (inside another subclass's __torch_dispatch__: DTensor's ops) composite
            # ops come here whole; the real device runs their decomposition, so do we (`to.device`
            # would otherwise copy the inner CPU tensor to the hidden device: a wrapper in a wrapper).
            special = functools.partial(_decompose, func)
        if special is None:
            special = _python_custom_op(cls, func)
        facts = (special, _SEEDED in func.tags, tracks, reshapes, func.is_view)
        setattr(func, cls._facts_key, facts)
    return facts


def _decompose(func: Any, args: tuple, kwargs: dict) -> Any:
    return func.decompose(*args, **kwargs)


def _python_custom_op(cls: type[WrapperTensor], func: Any) -> Callable[[tuple, dict], Any] | None:
    """An op written in Python (`torch.library.custom_op`) runs its function on the device's tensors, as on the
    device: what it asks of them (`is_cuda`) and the ops it calls (device-only kernels) are the device's."""
    kernel = torch_internals.python_custom_op_kernel(func, cls._sim.type)
    if kernel is None:
        return None
    return lambda args, kwargs: kernel(*args, **kwargs)


def _inner_of(cls: type[WrapperTensor], value: Any) -> Any:
    kind = type(value)
    if kind is cls:
        return value._inner
    if kind is list or kind is tuple:
        items = [item._inner if type(item) is cls else item for item in value]
        return items if kind is list else tuple(items)
    return value


def _unwrap_args(cls: type[WrapperTensor], value: Any, seen: dict[int, WrapperTensor]) -> Any:
    # As `_inner_of`, remembering each wrapper by its inner tensor (an in-place op returns it).
    if type(value) is cls:
        inner = value._inner
        seen[id(inner)] = value
        return inner
    kind = type(value)
    if (kind is list or kind is tuple) and value:
        items = [_unwrap_args(cls, item, seen) if type(item) is cls else item for item in value]
        return items if kind is list else tuple(items)
    if isinstance(value, (list, tuple)) and value and any(type(item) is cls for item in value):
        return kind(_unwrap_args(cls, item, seen) for item in value)
    return value


def _new(cls: type[WrapperTensor], inner: torch.Tensor, device: torch.device, requires_grad: bool = False) -> Any:
    # `cls(inner, device)` without the class call's overhead: every op's result comes here
    sim = cls._sim
    if sim.counting:
        sim.track(inner, device.index or 0)
    self = _make_wrapper(cls, inner, sim.hidden_devices[device.index or 0], requires_grad)
    self._inner = inner
    self._shown = device
    return self


def _wrap_results(cls: type[WrapperTensor], value: Any, seen: dict[int, WrapperTensor], device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        # An in-place or out= op returns one of its inputs: give back that very wrapper.
        same = seen.get(id(value))
        return same if same is not None else _new(cls, value, device)
    if isinstance(value, (list, tuple)):
        items = [_wrap_results(cls, item, seen, device) for item in value]
        return items if type(value) is list else type(value)(items)
    return value


def _one_device_of(cls: type[WrapperTensor], tensors: list | tuple) -> torch.device | None:
    """The device of `tensors` when they are all of `cls` and on one device."""
    device = None
    for item in tensors:
        if type(item) is not cls:
            return None
        shown = item._shown
        if device is None:
            device = shown
        elif shown is not device and shown != device:
            return None
    return device


def _one_device(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the tensor arguments when they are all of `cls` and on one device (the common case)."""
    device = None
    for values in (args, kwargs.values()) if kwargs else (args,):
        for value in values:
            if type(value) is cls:
                shown = value._shown
                if device is None:
                    device = shown
                elif shown is not device and shown != device:
                    return None
            elif isinstance(value, torch.Tensor):
                return None  # a CPU tensor: the device's rules decide
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                shared = _one_device_of(cls, value)  # foreach ops, cat, ...
                if shared is None:
                    return None
                if device is None:
                    device = shared
                elif shared is not device and shared != device:
                    return None
            elif isinstance(value, (list, tuple)) and any(isinstance(item, torch.Tensor) for item in value):
                return None  # tensors after a None (index lists: x[:, idx]): the device's rules decide
    return device


@contextlib.contextmanager
def on_generator(generator: torch.Generator) -> Iterator[None]:
    """Random ops in the block draw from `generator` (a CPU one), not torch's default CPU generator."""
    # the host generators' own states (torch._C.Generator's): a simulated GPU's shows Python another one
    host_state, set_host_state = torch._C.Generator.get_state, torch._C.Generator.set_state
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.set_state(host_state(generator))
    try:
        yield
    finally:
        set_host_state(generator, cpu.get_state())
        cpu.set_state(saved)


def run_on(cls: type[WrapperTensor], device: torch.device, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` on CPU tensors for `device`, drawing from that device's generator if it draws."""
    if _facts(cls, func)[1]:
        return cls._sim.draw(device.index or 0, func, args, kwargs)
    return func(*args, **kwargs)


def op_device(cls: type[WrapperTensor], func: Any, args: tuple, kwargs: dict) -> torch.device | None:
    """The device op `func` runs on, given its arguments (the real device's error for a mismatch)."""
    device = _one_device(cls, args, kwargs)
    return device if device is not None else cls._sim.common_device(func, args, kwargs)


def _after_other_subclasses(cls: type[WrapperTensor], func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """`dispatch`, once the `__torch_dispatch__` of the other tensor subclasses among the arguments had its turn.

    On the device, a library's subclass (torchao's float8 tensors, DTensor) meets plain
    tensors, which have no `__torch_dispatch__`: its own runs, sees only its types, and
    unwraps itself. A simulated tensor is a subclass too, which torch may try first: ours
    running then would hand the library's subclass our CPU data (or make a plain tensor of
    a DTensor's op). So each other subclass runs first, shown the types the device would
    show it. One that hands the op back unchanged, as DTensor's Python `__torch_dispatch__`
    does (its real one is torch's C++ path, which torch's own order reaches), gets it back
    by NotImplemented: torch then goes on to that subclass. Those of torch's fake and
    functional modes (`torch._subclasses`) meet simulated tensors while Dynamo traces:
    `dispatch` takes them in.
    """
    others = tuple(
        kind for kind in types if not issubclass(kind, cls) and not kind.__module__.startswith("torch._subclasses.")
    )
    if not others:
        return dispatch(cls, func, args, kwargs)
    handing = _handing.__dict__.setdefault("ops", set())
    if any((func, kind) in handing for kind in others):
        return NotImplemented
    for kind in others:
        handing.add((func, kind))
        try:
            out = kind.__torch_dispatch__(func, others, args, kwargs)
        finally:
            handing.discard((func, kind))
        if out is not NotImplemented:
            return out
    return dispatch(cls, func, args, kwargs)


#: the (op, subclass) pairs whose `__torch_dispatch__` `_after_other_subclasses` is running, per thread
_handing = threading.local()


def dispatch(cls: type[WrapperTensor], func: Any, args: tuple, kwargs: dict, *, apart: bool = True) -> Any:
    """Run aten op `func` whose arguments include tensors of `cls`.

    `apart=False`: run it as any op, past its handler (`add_special`), for a handler that did its part.
    """
    facts = getattr(func, cls._facts_key, None)
    special, seeded, tracks, reshapes, _ = _facts(cls, func) if facts is None else facts
    if _tracing:
        # Dynamo's fake tensors: the op's own fake kernel gives the shapes; the handlers (real
        # collectives, memory, the attention backends' choice) are for the run itself
        apart = False
        args, kwargs = _adopt_fakes(cls, args), _adopt_fakes(cls, kwargs)
    sim = cls._sim
    if special is not None and apart:
        if not sim.timing or _tracing:
            return special(args, kwargs)
        return _timed_special(cls, special, func, args, kwargs)
    device = op_device(cls, func, args, kwargs)
    if kwargs:
        requested = kwargs.get("device")
        if requested is not None:  # an op that also creates (new_zeros, *_like(device=...))
            device = sim.resolve(requested)
            if device.type == sim.type:
                kwargs = dict(kwargs, device=torch.device("cpu"))
                kwargs.pop("pin_memory", None)
    seen: dict[int, WrapperTensor] = {}
    if tracks:
        inner_args = [_unwrap_args(cls, a, seen) for a in args]
        inner_kwargs = {k: _unwrap_args(cls, v, seen) for k, v in kwargs.items()} if kwargs else kwargs
    else:
        inner_args = [
            a._inner if type(a) is cls else _inner_of(cls, a) if type(a) is list or type(a) is tuple else a
            for a in args
        ]
        inner_kwargs = {k: _inner_of(cls, v) for k, v in kwargs.items()} if kwargs else kwargs
    if sim.general:
        inner_args, inner_kwargs = sim.align(inner_args, inner_kwargs, seen)
    if device is None or device.type != sim.type:
        return func(*inner_args, **inner_kwargs)  # a CPU result was asked for
    out = sim.draw(device.index or 0, func, inner_args, inner_kwargs) if seeded else func(*inner_args, **inner_kwargs)
    if sim.timing and not _inside and not _tracing:  # (Dynamo's fake tensors launch nothing)
        sim.time_op(device.index or 0, func, inner_args, inner_kwargs, out)
    if reshapes:
        for wrapper in seen.values():
            _follow_inner(wrapper)
    if type(out) is torch.Tensor:
        same = seen.get(id(out))
        return same if same is not None else _new(cls, out, device)
    return _wrap_results(cls, out, seen, device)


#: non-empty while Dynamo compiles (`tracing`): the tensors met are fake
_tracing: list[bool] = []
#: while special handlers run with the clock on, one flag each: whether a handler it called timed itself
_inside: list[list[bool]] = []


def _timed_special(cls: type[WrapperTensor], special: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """A special handler's op, timed as the one kernel the device launches for it: the ops it runs on the
    device's tensors are its own doing, not kernels; a handler that routes to another (the attention
    composite to its backend's op) leaves the timing to that one."""
    frame = [False]
    _inside.append(frame)
    try:
        out = special(args, kwargs)
    finally:
        _inside.pop()
    if _inside:
        _inside[-1][0] = True
    if frame[0] or _tracing:
        return out
    device = _first_device(cls, args, out)  # the handler checked the devices; the op ran on its tensors' GPU
    if device is not None:
        cls._sim.time_op(device.index or 0, func, args, kwargs, out)
    return out


def _first_device(cls: type[WrapperTensor], args: tuple, out: Any) -> torch.device | None:
    """The device of the first `cls` tensor among `args` (one level into lists), else of the result."""
    for value in (*args, out):
        if type(value) is cls:
            return value._shown
        if type(value) is list or type(value) is tuple:
            for item in value:
                if type(item) is cls:
                    return item._shown
    return None


def tracing(active: bool) -> None:
    """Dynamo starts (True) or ends (False) compiling: ops then meet its fake tensors (`_adopt_fakes`)."""
    _tracing[:] = [True] if active else []


def is_tracing() -> bool:
    return bool(_tracing)


def _adopt_fakes(cls: type[WrapperTensor], values: Any) -> Any:
    # A factory traced by Dynamo (`torch.ones(n, device="cuda")`) gives a plain fake tensor
    # on the shown device, where the program's run gives a simulated one: seen as one of ours.
    # So does a tensor C++ makes on a simulated tensor's own device, the hidden one (the
    # value of `x[mask] = 0`, which DTensor's loss parallelism does).
    if isinstance(values, dict):
        return {key: _adopt_fakes(cls, value) for key, value in values.items()}
    if type(values) is list or type(values) is tuple:
        return type(values)(_adopt_fakes(cls, value) for value in values)
    if (
        isinstance(values, torch.Tensor)
        and type(values) is not cls
        and cls._sim.is_mine(values.device)
        and torch_internals.is_fake(values)
    ):
        # made under Dynamo's fake mode, so itself fake: a host tensor of the same layout
        inner = torch.empty_strided(values.size(), values.stride(), dtype=values.dtype, device="cpu")
        return cls(inner, cls._sim.resolve(values.device), values.requires_grad)
    return values


def _follow_inner(wrapper: WrapperTensor) -> None:
    # An in-place op may resize or restride the inner tensor (resize_, out=, t_): the
    # wrapper must report the same shape, and a device that counts memory the storage's size.
    inner = wrapper._inner
    sim = wrapper._sim
    if sim.counting:
        sim.follow(inner)
    if (
        wrapper.shape != inner.shape
        or wrapper.stride() != inner.stride()
        or wrapper.storage_offset() != inner.storage_offset()
    ):
        torch_internals.sync_metadata(wrapper, inner)


# -- ops handled apart ---------------------------------------------------------------------------------


def copy_target(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> tuple[torch.device, dict]:
    """`_to_copy`'s target device, and its keyword arguments for the CPU kernel (the data stay in host memory)."""
    sim = cls._sim
    target = kwargs.get("device")
    target = args[0].device if target is None else sim.resolve(target)
    kwargs = dict(kwargs, device=torch.device("cpu") if target.type == sim.type else target)
    kwargs.pop("pin_memory", None)  # nothing to pin: the data stay in host memory
    return target, kwargs


def to_copy(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> Any:
    """`_to_copy`: a copy of a tensor on another device and/or dtype."""
    target, kwargs = copy_target(cls, args, kwargs)
    out = aten._to_copy.default(unwrap(args[0]), **kwargs)
    return cls(out, target) if target.type == cls._sim.type else out


def _copy_(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> Any:
    unwrap(args[0]).copy_(unwrap(args[1]), *args[2:], **kwargs)
    return args[0]


def _item(cls: type[WrapperTensor], args: tuple, kwargs: dict) -> Any:
    return args[0]._inner.item()


_ITEM = aten._local_scalar_dense.default
#: ops handled apart: copies across devices, reading a value, stream bookkeeping (one stream per device)
_SPECIAL: dict[Any, Callable[..., Any]] = {
    aten._to_copy.default: to_copy,
    aten.copy_.default: _copy_,
    _ITEM: _item,
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


def factory_target(cls: type[WrapperTensor], op: Any, kwargs: dict) -> tuple[torch.device, dict]:
    """The device factory `op` aims at, and its keyword arguments for the CPU kernel."""
    sim = cls._sim
    device = kwargs.get("device")
    if device is None or not sim.is_mine(device):
        raise NotImplementedError(
            f"{op} reached the simulated {sim.type} device without a device argument naming it; the simulator has "
            "no kernel for it (please report this with the code that called it)"
        )
    kwargs = dict(kwargs, device=torch.device("cpu"))
    kwargs.pop("pin_memory", None)
    return sim.resolve(device), kwargs


def factory_kernel(cls: type[WrapperTensor], op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run factory `op` aimed at `cls`'s device on the CPU, and wrap what it made."""
    device, kwargs = factory_target(cls, op, kwargs)
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


# -- Python entry points: tensors onto the device, `.data` and `.grad` -------------------------------------


def python_entry_points(cls: type[WrapperTensor]) -> dict[str, Callable[..., Any]]:
    """`Tensor.to`, `torch.tensor` and `torch.as_tensor` for `cls`'s device (to patch in; torch's now are the fallback).

    `Tensor.to` resolves a plain device name ("xla", "cuda") to the current device and
    returns `self` when nothing changes (C++ would compare its hidden device with the shown
    one and always copy); `torch.tensor` / `as_tensor` build on the CPU and then wrap
    (simpler and safer than giving C++ a device guard).
    """
    sim = cls._sim
    original_to, original_tensor, original_as_tensor = torch.Tensor.to, torch.tensor, torch.as_tensor

    def tensor_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`Tensor.to`: the device's plain name means its current device; `self` when nothing changes."""
        if args and sim.names_me(args[0]):
            args = (sim.resolve(args[0]), *args[1:])
        if kwargs.get("device") is not None and sim.names_me(kwargs["device"]):
            kwargs["device"] = sim.resolve(kwargs["device"])
        # other libraries' wrappers shown on this device (DTensor: built on the hidden one) too
        if not kwargs.get("copy", False) and (type(self) is cls or self.device.type == sim.type):
            device, dtype, _, memory_format = torch_internals.parse_to(*args, **kwargs)
            same_device = device is None or device == (self._shown if type(self) is cls else self.device)
            same_dtype = dtype is None or dtype == self.dtype
            same_format = memory_format is None or memory_format == torch.preserve_format
            if same_device and same_dtype and same_format and (device is not None or dtype is not None):
                return self
        return original_to(self, *args, **kwargs)

    def tensor(
        data: Any, *, dtype: Any = None, device: Any = None, requires_grad: bool = False, pin_memory: bool = False
    ) -> torch.Tensor:
        """`torch.tensor`: on the simulated device, built on the CPU and then wrapped."""
        if isinstance(data, cls) and device is None:
            device = data.device
        host_data = unwrap(data) if isinstance(data, torch.Tensor) else data
        if device is None or not sim.names_me(device):
            out = original_tensor(host_data, dtype=dtype, device=device)
        else:
            out = cls(original_tensor(host_data, dtype=dtype), sim.resolve(device))
        return out.requires_grad_(requires_grad) if requires_grad else out

    def as_tensor(data: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
        """`torch.as_tensor`: no copy where none is needed, a copy onto the simulated device otherwise."""
        if isinstance(data, torch.Tensor):
            return tensor_to(data, device=device, dtype=dtype) if (device is not None or dtype is not None) else data
        if device is None or not sim.names_me(device):
            return original_as_tensor(data, dtype=dtype, device=device)
        return cls(original_as_tensor(data, dtype=dtype), sim.resolve(device))

    return {"to": tensor_to, "tensor": tensor, "as_tensor": as_tensor}


def install_entry_points(cls: type[WrapperTensor]) -> dict[str, Callable[..., Any]]:
    """Patch `python_entry_points(cls)` into torch, and `.data` / `.grad` setters that know `cls`'s device."""
    points = python_entry_points(cls)
    torch.Tensor.to = points["to"]  # type: ignore[method-assign]  # same signature
    torch.tensor = points["tensor"]
    torch.as_tensor = points["as_tensor"]
    torch_internals.script_as_builtins({points["tensor"]: "aten::tensor", points["as_tensor"]: "aten::as_tensor"})
    torch_internals.patch_data_setter(functools.partial(set_data, cls))
    torch_internals.check_grad_device(functools.partial(check_grad, cls._sim.type))
    return points


def set_data(cls: type[WrapperTensor], tensor: torch.Tensor, new: torch.Tensor) -> bool:
    """`tensor.data = new` where either is `cls`'s, as on that device; False when torch's setter serves.

    On a GPU, `set_data` lets a tensor (a parameter, typically) change device and dtype
    while it stays the same Python object over the same TensorImpl: libraries move and
    shard parameters that way (FSDP's `param.data = param.to(device)`). `moves.move` does
    it for simulated tensors (how, and where it cannot: `accel.sim.core.moves`).
    """
    return moves.move(cls, tensor, new)


def check_grad(device_type: str, tensor: torch.Tensor, grad: Any) -> None:
    """Before `tensor.grad = grad`: a gradient on another kind of device fails in torch's words, naming the device.

    torch's own check runs in C++ and would name the hidden device.
    """
    if not isinstance(grad, torch.Tensor):
        return
    kinds = (grad.device.type, tensor.device.type)
    if kinds[0] != kinds[1] and device_type in kinds:
        raise RuntimeError(
            f"attempting to assign a gradient with device type '{grad.device.type}' to a tensor with device type "
            f"'{tensor.device.type}'. Please ensure that the gradient and the tensor are on the same device"
        )
