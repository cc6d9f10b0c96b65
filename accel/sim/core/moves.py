"""Tensors that move keep their identity, as on a GPU: `t.data = x`, `Module.to` / `cuda` / `cpu` / `half` / `_apply`.

On a GPU, `param.data = x` changes what a tensor holds (device, dtype, storage) while it
stays the same Python object over the same C++ TensorImpl, so whatever holds it (weak
references, an optimizer's state keyed by it, a live autograd graph, views of it, FSDP's
flat parameters and gradient hooks) still holds it. A simulated device's tensor is a
wrapper subclass (`accel.sim.core.wrapper`) whose TensorImpl is the hidden device's; C++
lets such a TensorImpl take another one's data (`set_data`), never a CPU TensorImpl's. So
`move(cls, tensor, new)`, which serves `tensor.data = new`:

* device to device (another GPU, another dtype): C++ `set_data` in place, and the wrapper
  takes the new inner tensor;
* device to host: when only Python holds the tensor, the TensorImpls are swapped (it becomes
  a plain CPU tensor); otherwise it stays a wrapper that shows the CPU (`HostTensor`): a CPU
  tensor to Python, whose ops run on its CPU data and give plain CPU tensors, and which
  becomes a device tensor again, in place, when it moves back;
* host to device: the TensorImpls are swapped when only Python holds the tensor; otherwise
  the move is refused, naming why (the C++ holders would keep the CPU TensorImpl).

`nn.Module._apply` moves a parameter with `torch.utils.swap_tensors` when the converted
tensor is a traceable wrapper subclass, which a simulated one is (torch.compile needs it);
torch's function refuses weakly referenced or otherwise held tensors, where a GPU's
`param.data = x` does not. `install` makes the swaps torch's own code makes for that
reason such moves; and `Module.cpu()` moves parameters in place (`param.data = cpu`), as on a GPU.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, ClassVar

import torch

from accel.sim.core import torch_internals

_CPU = torch.device("cpu")
_STRIDED = torch.strided
#: device wrapper class -> its class of tensors shown on the host (`host_class`)
_HOSTS: dict[type, type[HostTensor]] = {}


def install(cls: type) -> None:
    """In this process, tensors of wrapper class `cls` keep their identity when they move (see the module's doc).

    Patches `torch.utils.swap_tensors`, torch's shallow-copy check and the `.grad` setter;
    `tensor.data = x` calls `move` through the core's data setter (`wrapper.set_data`).
    """
    host_class(cls)
    original = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        """`torch.utils.swap_tensors`; where torch's own code swaps only because a simulated tensor is a wrapper
        subclass, `t1.data = t2` as a GPU does it (`move`): `t1` keeps its identity and whatever holds it."""
        if (
            (_is_mine(cls, t1) or _is_mine(cls, t2))
            and not torch.__future__.get_swap_module_params_on_conversion()  # then a GPU swaps too
            and sys._getframe(1).f_globals.get("__name__", "").startswith("torch.")
            and move(cls, t1, t2)
        ):
            return
        original(t1, t2)

    swap_tensors.__wrapped__ = original  # type: ignore[attr-defined]
    torch.utils.swap_tensors = swap_tensors
    torch_internals.patch_shallow_copy_check(lambda a, b: compatible(cls, a, b))
    torch_internals.convert_grads(lambda tensor, grad: grad_for(cls, tensor, grad))


def _is_mine(cls: type, tensor: Any) -> bool:
    kind = type(tensor)
    return kind is cls or kind is _HOSTS.get(cls)


def _is_host_data(tensor: Any) -> bool:
    """Whether `tensor` is a dense CPU tensor whose data a GPU tensor may take: a plain tensor, a parameter or
    a subclass of theirs without a dispatch of its own (FSDP's `FlatParameter`), on a CPU TensorImpl."""
    return (
        isinstance(tensor, torch.Tensor)
        and type(tensor).__torch_dispatch__ is _PLAIN_DISPATCH
        and tensor.layout is _STRIDED
        and torch_internals.cpp_device(tensor).type == "cpu"
    )


#: what `__torch_dispatch__` is for a tensor class without one of its own (a C function, not a classmethod)
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


# -- `tensor.data = new` --------------------------------------------------------------------------------


def move(cls: type, tensor: torch.Tensor, new: torch.Tensor) -> bool:
    """`tensor.data = new` where either is `cls`'s (on its device or shown on the host), as on the device.

    False where torch's own setter serves: neither is; or the device's tensors take no host
    data (XLA's, `swaps_data_with_host`); or the other one is no dense CPU tensor (torch's
    setter then fails with its own words, as on a GPU).
    """
    old_mine, new_mine = _is_mine(cls, tensor), _is_mine(cls, new)
    if not (old_mine or new_mine):
        return False
    if new is tensor:
        return True
    if old_mine and new_mine:
        _take(tensor, new)
        return True
    if not cls._sim.swaps_data_with_host or not _is_host_data(new if old_mine else tensor):  # type: ignore[attr-defined]
        return False
    if not old_mine:  # host tensor onto the device, or host data shown on the host
        if type(new) is not cls:
            torch_internals.data_descriptor().__set__(tensor, new._inner)  # type: ignore[attr-defined]
        else:
            _swap_onto_device(cls, tensor, new)
        return True
    _check_differentiable(tensor, new)
    if torch_internals.use_count(tensor) == 1 and (tensor.grad is None or tensor.grad.shape == new.shape):
        _swap(tensor, _plain(tensor, new))
    else:  # C++ holds it (or its gradient would not fit): a wrapper that shows the host
        _take(tensor, host_alias(cls, tensor, new.detach() if new.requires_grad else new))
    return True


def _take(tensor: Any, new: Any) -> None:
    """Wrapper `tensor` (on the device or shown on the host) takes wrapper `new`'s data in place (C++ `set_data`)."""
    if new._inner is not tensor._inner or new._shown != tensor._shown:
        torch_internals.data_descriptor().__set__(tensor, new)
        tensor._inner = new._inner
        tensor._shown = new._shown
    if type(tensor) is not type(new):
        tensor.__class__ = type(new)


def _check_differentiable(tensor: torch.Tensor, new: torch.Tensor) -> None:
    # C++ set_data's check, in its words: a swap would otherwise fail in requires_grad_()
    if tensor.requires_grad and not (new.dtype.is_floating_point or new.dtype.is_complex):
        raise RuntimeError("data set to a tensor that requires gradients must be floating point or complex dtype")


def _plain(tensor: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor (a parameter if `tensor` is one) sharing `new`'s data, for `tensor` to swap with."""
    with torch.no_grad():
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(new.detach(), requires_grad=tensor.requires_grad)
        return new.detach().requires_grad_(tensor.requires_grad)


def _swap_onto_device(cls: type, tensor: torch.Tensor, new: Any) -> None:
    """Host tensor `tensor` takes device tensor `new`'s data: a swap of TensorImpls, refused if C++ holds `tensor`."""
    kind = cls._sim.type  # type: ignore[attr-defined]
    held = torch_internals.holders_before_a_swap(tensor)
    if held > 1:
        raise RuntimeError(
            f"`tensor.data = x` cannot move a tensor between cpu and {new.device} on a simulated {kind} device while "
            f"something else holds it (C++ holds it {held - 1} more times: a view of it, an autograd graph that saved "
            "it, a hook on its gradient accumulator). A simulated device's tensor is a C++ TensorImpl of another "
            "kind, which a CPU one cannot become in place; move the tensor (or its module) to the device before that."
        )
    grad = tensor.grad
    if grad is not None and grad.shape != new.shape:
        raise RuntimeError(
            f"`tensor.data = x` cannot move a tensor whose gradient has shape {tuple(grad.shape)} onto {new.device} "
            f"with data of shape {tuple(new.shape)} on a simulated {kind} device: C++ gives a simulated device's "
            "tensor no gradient from the host, and this one cannot be converted along (a GPU would leave it as it "
            "is); set `tensor.grad = None` first."
        )
    _check_differentiable(tensor, new)
    with torch.no_grad():
        replacement = cls(new._inner, new._shown)
        replacement.requires_grad_(tensor.requires_grad)
    if isinstance(tensor, torch.nn.Parameter):
        replacement._is_param = True  # what Parameter() marks a subclass with
    _swap(tensor, replacement)


def _swap(tensor: torch.Tensor, replacement: torch.Tensor) -> None:
    """`tensor` becomes `replacement` (only Python holds it), keeping its attributes, hooks and gradient.

    A gradient that no longer fits (another device or dtype) is converted along: C++ gives
    a plain tensor no gradient on another device, where a GPU's `t.data = x` leaves it be.
    """
    kept = {k: v for k, v in vars(tensor).items() if k not in ("_inner", "_shown", "_is_param")}
    grad = tensor.grad
    if grad is not None:
        tensor.grad = None
    replacement.__dict__.update(kept)
    torch_internals.swap_impls(tensor, replacement)
    if grad is not None:
        with torch.no_grad():
            fits = grad.device == tensor.device and grad.dtype == tensor.dtype
            tensor.grad = grad if fits else grad.to(device=tensor.device, dtype=tensor.dtype)


def compatible(cls: type, a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """`torch._has_compatible_shallow_copy_type(a, b)` for `cls`'s tensors: True for one of them and a dense CPU
    tensor, as for a GPU tensor and a CPU tensor (where `swaps_data_with_host`); None: torch's answer."""
    if not cls._sim.swaps_data_with_host:  # type: ignore[attr-defined]
        return None
    if _is_mine(cls, a):
        return True if _is_host_data(b) else None
    if _is_mine(cls, b):
        return True if _is_host_data(a) else None
    return None


def grad_for(cls: type, tensor: torch.Tensor, grad: Any) -> Any:
    """What `tensor.grad = grad` assigns: C++ takes a gradient on the tensor's own C++ device only.

    A tensor shown on the host (a `HostTensor`) gets a CPU gradient shown the same way; a
    plain tensor gets the data of a `HostTensor` gradient.
    """
    host = _HOSTS.get(cls)
    if host is None or not isinstance(grad, torch.Tensor):
        return grad
    if type(tensor) is host and type(grad) is not host and _is_host_data(grad):
        return host_alias(cls, tensor, grad)
    if type(grad) is host and type(tensor) is not host and not _is_mine(cls, tensor):
        return grad._inner
    return grad


# -- tensors shown on the host ----------------------------------------------------------------------


def host_class(cls: type) -> type[HostTensor]:
    """The class of `cls`'s tensors that moved to the host while C++ held them (one per device class)."""
    host = _HOSTS.get(cls)
    if host is None:
        host = type(f"{cls.__name__}OnHost", (HostTensor,), {"_home": cls, "__module__": __name__})
        _HOSTS[cls] = host
    return host


def host_alias(cls: type, like: torch.Tensor, cpu: torch.Tensor) -> HostTensor:
    """A `host_class(cls)` tensor holding `cpu`'s data, on `like`'s C++ device (what `tensor.data =` takes in place)."""
    alias = torch_internals.make_wrapper(host_class(cls), cpu, torch_internals.cpp_device(like), False)
    alias._inner = cpu
    alias._shown = _CPU
    return alias


class HostTensor(torch.Tensor):
    """A simulated device's tensor that moved to the host while C++ held it: a CPU tensor to Python.

    Its C++ TensorImpl is still the hidden device's, so that the views, graphs and hooks
    holding it hold it still and it can move back in place; `_inner` holds its data. Every
    op runs on the inner CPU tensors and gives plain CPU tensors (an in-place op gives the
    tensor itself back); mixed with device tensors, the device's rules decide.
    """

    _inner: torch.Tensor
    _shown: torch.device
    #: the device wrapper class it moved from
    _home: ClassVar[type]

    __torch_function__ = torch_internals.disabled_torch_function  # type: ignore[assignment]  # C++ signature

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # classmethod form torch documents
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        seen: dict[int, HostTensor] = {}
        out = func(*_unwrap_hosts(args, seen), **_unwrap_hosts(kwargs or {}, seen))
        return _rewrap(out, seen)

    @property
    def device(self) -> torch.device:  # type: ignore[override]  # a property, as on Tensor
        return _CPU

    @property
    def is_cpu(self) -> bool:  # type: ignore[override]  # a property, as on Tensor
        return True

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return False

    def get_device(self) -> int:
        return -1  # what a CPU tensor answers

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """`Tensor.to`: itself when nothing changes (C++ would compare its hidden device with the CPU and copy)."""
        device, dtype, _, memory_format = torch_internals.parse_to(*args, **kwargs)
        unchanged = (device is None or device.type == "cpu") and (dtype is None or dtype == self.dtype)
        if unchanged and memory_format in (None, torch.preserve_format) and not kwargs.get("copy", False):
            return self
        return torch.Tensor.to(self, *args, **kwargs)

    def cpu(self, memory_format: torch.memory_format = torch.preserve_format) -> Any:
        return self.to(_CPU, memory_format=memory_format)

    def type(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        """`Tensor.type`, as a CPU tensor answers it."""
        if dtype is None:
            return self._inner.type()
        return self._inner.type(dtype, non_blocking, **kwargs)

    def data_ptr(self) -> int:
        return self._inner.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._inner.untyped_storage()

    def tolist(self) -> Any:
        return self._inner.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        if self.requires_grad and not force:  # torch's words for a CPU tensor
            raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use tensor.detach().numpy() instead.")
        return self._inner.detach().numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    def __repr__(self, *, tensor_contents: str | None = None) -> str:  # type: ignore[override]
        with torch.no_grad():
            text = torch_internals.tensor_text(self._inner, tensor_contents)[0]
        if self.grad_fn is not None:
            text = text[:-1] + f", grad_fn=<{type(self.grad_fn).__name__}>)"
        elif self.requires_grad:
            text = text[:-1] + ", requires_grad=True)"
        return "Parameter containing:\n" + text if getattr(self, "_is_param", False) else text

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self._inner.item().__format__(spec)
        return object.__format__(self, spec)

    def _plain_copy(self, data: torch.Tensor) -> torch.Tensor:
        # the CPU tensor (or parameter) this one shows, holding `data`
        if getattr(self, "_is_param", False):
            return torch.nn.Parameter(data, requires_grad=self.requires_grad)
        return data.requires_grad_(self.requires_grad)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickled as the CPU tensor it shows: plain torch loads it
        return self._plain_copy(self._inner.detach()).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> Any:
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self._plain_copy(self._inner.clone(memory_format=torch.preserve_format))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key not in ("_inner", "_shown", "_is_param"):
                setattr(new, key, copy.deepcopy(value, memo))
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        return new


def _unwrap_hosts(value: Any, seen: dict[int, HostTensor]) -> Any:
    """`value` with each `HostTensor` replaced by its inner CPU tensor (remembered in `seen`, by the inner's id)."""
    if isinstance(value, HostTensor):
        seen[id(value._inner)] = value
        return value._inner
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(_unwrap_hosts(item, seen) for item in value)
    if kind is dict:
        return {key: _unwrap_hosts(item, seen) for key, item in value.items()}
    return value


def _rewrap(value: Any, seen: dict[int, HostTensor]) -> Any:
    """An op's result: an inner tensor it wrote into gives back its `HostTensor` (metadata followed), else as is."""
    if isinstance(value, torch.Tensor):
        host = seen.get(id(value))
        if host is None:
            return value
        if (
            host.shape != value.shape
            or host.stride() != value.stride()
            or host.storage_offset() != value.storage_offset()
        ):
            torch_internals.sync_metadata(host, value)  # resize_, set_, t_ ...
        return host
    kind = type(value)
    if kind is list or kind is tuple:
        return kind(_rewrap(item, seen) for item in value)
    return value
