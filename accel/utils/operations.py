"""Operations on nested structures of tensors, within one process and across processes.

Every function accepts a tensor or any nesting of lists, tuples, namedtuples and
mappings of tensors; values that are not tensors pass through unchanged. The
cross-process operations pack all tensors of one dtype into one buffer, so a nested
structure of k tensors costs one collective per dtype rather than k. In debug mode
(`PartialState(debug=True)` or `ACCEL_DEBUG_MODE=1`) they first compare shapes across
ranks and raise `DistributedOperationException` listing every rank's shapes, instead
of hanging or returning garbage.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from accel.utils.random import set_seed, synchronize_rng_state, synchronize_rng_states  # noqa: F401  (public here too)


class DistributedOperationException(RuntimeError):
    """A collective was called with inputs that do not match across processes."""


# -- walking nested structures --------------------------------------------------------


def is_torch_tensor(tensor: Any) -> bool:
    """Whether `tensor` is a `torch.Tensor` (the default leaf test of `recursively_apply`)."""
    return isinstance(tensor, torch.Tensor)


is_tensor = is_torch_tensor


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether `tensor_info` is a `TensorInformation` (a tensor described by `get_data_structure`)."""
    return isinstance(tensor_info, TensorInformation)


class CannotPadNestedTensorWarning(UserWarning):
    """`pad_across_processes` met a nested (ragged) tensor, which it cannot pad, and returned it as it is."""


def is_namedtuple(data: Any) -> bool:
    """Whether `data` is an instance of a `collections.namedtuple` (or `typing.NamedTuple`) class."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


_is_namedtuple = is_namedtuple


def honor_type(obj: Any, generator: Any) -> Any:
    """A list, tuple or namedtuple of the same type as `obj` holding the items of `generator`."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def _rebuild(container: Any, items: Any) -> Any:
    """A container of the same kind as `container` holding `items`."""
    if _is_namedtuple(container):
        return type(container)(*items)
    if isinstance(container, (list, tuple)):
        return type(container)(items)
    try:
        return type(container)(items)
    except TypeError:
        # Mappings whose constructor takes something else (e.g. a defaultdict) become dicts.
        return dict(items)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply `func(leaf, *args, **kwargs)` to every leaf of `data` that passes `test_type`.

    Containers are rebuilt with the same type; other leaves are returned as they are,
    or rejected with a TypeError when `error_on_other_type` is set.
    """
    if test_type(data):
        return func(data, *args, **kwargs)
    if isinstance(data, (list, tuple)):
        return _rebuild(
            data,
            [
                recursively_apply(
                    func, o, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for o in data
            ],
        )
    if isinstance(data, Mapping):
        return _rebuild(
            data,
            {
                k: recursively_apply(
                    func, v, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for k, v in data.items()
            },
        )
    if error_on_other_type:
        # Accelerate's words, which its users' tests compare
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', test_type)}` "
            "should be passed."
        )
    return data


def _leaves(data: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Append every tensor of `data` to `out`, in the order `recursively_apply` visits them."""
    if isinstance(data, torch.Tensor):
        out.append(data)
    elif isinstance(data, (list, tuple)):
        for o in data:
            _leaves(o, out)
    elif isinstance(data, Mapping):
        for v in data.values():
            _leaves(v, out)
    return out


def _replace_leaves(data: Any, new: Sequence[torch.Tensor | None]) -> Any:
    """`data` with its tensors replaced, in visiting order, by those of `new`."""
    it = iter(new)
    return recursively_apply(lambda _t: next(it), data)


def send_to_device(
    tensor: Any, device: Any, non_blocking: bool = False, skip_keys: Sequence[str] | str | None = None
) -> Any:
    """Move every tensor of a nested structure (or any object with `.to`) to `device`.

    Tensors already on `device` are returned as they are, so CPU-to-CPU costs nothing.
    Keys of mappings listed in `skip_keys` are left where they are.
    """
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    if isinstance(tensor, torch.Tensor):
        if tensor.device == device or str(tensor.device) == str(device):
            return tensor
        return tensor.to(device, non_blocking=non_blocking)
    if isinstance(tensor, (list, tuple)):
        return _rebuild(tensor, [send_to_device(t, device, non_blocking, skip_keys) for t in tensor])
    if isinstance(tensor, Mapping):
        skip = skip_keys or ()
        return _rebuild(
            tensor,
            {k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys) for k, v in tensor.items()},
        )
    if hasattr(tensor, "to") and not isinstance(tensor, type):
        try:
            return tensor.to(device, non_blocking=non_blocking)
        except TypeError:
            return tensor.to(device)
    return tensor


@dataclasses.dataclass(frozen=True)
class TensorInformation:
    """Shape and dtype of a tensor: what a receiving process needs to allocate it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def get_data_structure(data: Any) -> Any:
    """The same nesting with each tensor replaced by its `TensorInformation`: cheap to compare and to send."""
    return recursively_apply(lambda t: TensorInformation(tuple(t.shape), t.dtype), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors shaped as described by `get_data_structure`."""
    return recursively_apply(
        lambda info: torch.empty(info.shape, dtype=info.dtype),
        data_structure,
        test_type=lambda obj: isinstance(obj, TensorInformation),
    )


def find_batch_size(data: Any) -> int:
    """Size of the first dimension of the first tensor found in `data`."""
    leaves = _leaves(data, [])
    if not leaves:
        raise TypeError(f"Cannot find a batch size in {type(data).__name__}: it holds no tensor")
    first = leaves[0]
    if first.dim() == 0:
        raise ValueError("Cannot find a batch size: the first tensor found is a 0-d scalar")
    return first.shape[0]


def ignorant_find_batch_size(data: Any) -> int | None:
    """`find_batch_size`, or None where that raises (no tensor, or a 0-d one first)."""
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate a list of structurally identical nested structures tensor by tensor.

    A list of one non-tensor leaf gives that leaf back; several non-tensor leaves cannot
    be concatenated and raise TypeError (as in Accelerate: keeping one of them silently
    would lose the others).
    """
    if not data:
        raise ValueError("concatenate() needs at least one element")
    first = data[0]
    if isinstance(first, (list, tuple)):
        return _rebuild(first, [concatenate([d[i] for d in data], dim=dim) for i in range(len(first))])
    if isinstance(first, Mapping):
        return _rebuild(first, {k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(
        f"concatenate() can only concatenate tensors, got {len(data)} values of type {type(first).__name__}; "
        "drop or gather the non-tensor values separately (e.g. with gather_object)"
    )


def listify(data: Any) -> Any:
    """The same nesting with every tensor turned into (nested lists of) Python numbers, e.g. for JSON logs."""

    def to_list(t: torch.Tensor) -> Any:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()  # .tolist() goes through NumPy-like conversion that has no bfloat16
        return t.tolist()

    return recursively_apply(to_list, data)


def find_device(data: Any) -> torch.device | None:
    """Device of the first tensor found in a nested structure (None when it holds no tensor)."""
    leaves = _leaves(data, [])
    return leaves[0].device if leaves else None


def _is_half(obj: Any) -> bool:
    return hasattr(obj, "dtype") and obj.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """The same nesting with every float16/bfloat16 tensor converted to float32 (other leaves unchanged)."""
    return recursively_apply(lambda t: t.float(), tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """Callable wrapper of a forward function whose outputs come back in float32 (see `convert_outputs_to_fp32`)."""

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> Any:
        raise pickle.PicklingError(
            "cannot pickle a model prepared for mixed precision (its forward converts outputs to fp32): "
            "pickle accelerator.unwrap_model(model) instead"
        )


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so that its half-precision outputs are returned in float32.

    Used after autocast, so that losses and metrics computed from the outputs are not in
    half precision. The result is a `ConvertOutputsToFp32` (a class, not a local function),
    whose `__wrapped__` and `model_forward` are `model_forward`: unwrapping
    (`extract_model_from_parallel(..., keep_fp32_wrapper=False)`) follows `__wrapped__`
    back to the original forward.
    """
    return ConvertOutputsToFp32(model_forward)


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad (with zeros, along dim 0) every tensor of a batch of `batch_size` so that `num_processes` can split it.

    Used before splitting an uneven batch between processes: the result's first
    dimension is what Accelerate's rule gives (a multiple of `num_processes` in the
    cases that matter, at least `num_processes`); the padding rows are zeros.
    """

    def pad(t: torch.Tensor) -> torch.Tensor:
        per_process = batch_size // num_processes
        last_inputs = batch_size - per_process * num_processes
        to_pad = num_processes - batch_size if per_process == 0 else num_processes - per_process
        # Accelerate's rule, kept for identical shapes: a non-positive `to_pad` is turned around.
        if last_inputs > to_pad and to_pad < 1:
            to_pad = last_inputs - to_pad
        shape = list(t.shape)
        shape[0] = batch_size + to_pad
        out = t.new_zeros(shape)
        out.narrow(dim, 0, t.shape[dim]).copy_(t)
        return out

    return recursively_apply(pad, tensor, error_on_other_type=True)


def slice_tensors(
    data: Any, tensor_slice: slice | int, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Index every tensor of a nested structure with `tensor_slice` (non-tensors pass through)."""
    return recursively_apply(lambda t: t[tensor_slice], data)


# -- across processes -----------------------------------------------------------------


def _state() -> Any:
    from accel.state import PartialState

    return PartialState()


def _check_shapes(state: Any, data: Any, operation: str, same_dim0: bool = True) -> None:
    """In debug mode, raise if the tensors of `data` differ in shape across processes."""
    shapes = [tuple(t.shape) for t in _leaves(data, [])]
    everyone = state.hardware.all_gather_object(shapes)
    if any(s != everyone[0] for s in everyone):
        listing = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(everyone))
        raise DistributedOperationException(
            f"Cannot apply {operation}: the tensors must have the same shapes on every process, but got\n{listing}\n"
            "Use pad_across_processes() first when the sizes differ."
        )


def _check_ranks(state: Any, data: Any) -> None:
    """In debug mode, raise if the tensors of `data` differ in number or in number of dimensions across
    processes (`pad_across_processes` pads sizes, not dimensions)."""
    ranks = [t.dim() for t in _leaves(data, [])]
    everyone = state.hardware.all_gather_object(ranks)
    if any(r != everyone[0] for r in everyone):
        listing = "\n".join(f"  rank {i}: {r}" for i, r in enumerate(everyone))
        raise DistributedOperationException(
            "Cannot apply pad_across_processes: the tensors must have the same number of dimensions on every "
            f"process (only their sizes may differ), but their numbers of dimensions are\n{listing}"
        )


def _packed(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """Indices of `tensors`, grouped by dtype in first-seen order."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return groups


def _flat(tensors: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
    if len(idx) == 1:
        return tensors[idx[0]].detach().reshape(-1)
    return torch.cat([tensors[i].detach().reshape(-1) for i in idx])


def gather(tensor: Any) -> Any:
    """Gather every tensor of a nested structure from all processes, concatenated on dim 0.

    Each tensor must have the same shape on every process (see `pad_across_processes`);
    0-d tensors are gathered as one-element vectors.
    """
    state = _state()
    if state.num_processes == 1:
        return tensor
    if state.debug:
        _check_shapes(state, tensor, "gather")
    hardware, world = state.hardware, state.num_processes
    if isinstance(tensor, torch.Tensor):
        return _gather_one(hardware, world, tensor)
    tensors = _leaves(tensor, [])
    if not tensors:
        return tensor
    gathered: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in _packed(tensors).values():
        if len(idx) == 1:
            gathered[idx[0]] = _gather_one(hardware, world, tensors[idx[0]])
            continue
        flat = _flat(tensors, idx)
        out = hardware.all_gather_into(flat.new_empty(world * flat.numel()), flat).view(world, -1)
        offset = 0
        for i in idx:
            t = tensors[i]
            n = t.numel()
            shape = t.shape if t.dim() else (1,)
            gathered[i] = out[:, offset : offset + n].reshape(world * shape[0], *shape[1:])
            offset += n
    return _replace_leaves(tensor, gathered)


def _gather_one(hardware: Any, world: int, t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        t = t.reshape(1)
    # Collectives are not differentiable: a tensor that requires grad (a parameter) is sent as data,
    # which Gloo's gather into views of the output needs ("view created in no_grad mode" otherwise).
    t = t.detach().contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    return hardware.all_gather_into(out, t)


def gather_object(object: Any) -> list[Any]:  # Accelerate's parameter name
    """Gather a picklable object from every process.

    Lists and tuples are concatenated in rank order (`[a, b]` on two ranks gives
    `[a0, b0, a1, b1]`); any other object gives the list of every rank's object.
    """
    obj = object
    state = _state()
    if state.num_processes == 1:
        return list(obj) if isinstance(obj, (list, tuple)) else [obj]
    everyone = state.hardware.all_gather_object(obj)
    if all(isinstance(o, (list, tuple)) for o in everyone):
        return [x for o in everyone for x in o]
    return everyone


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Give every tensor of a nested structure the values it has on `from_process`, in place.

    The receiving processes must hold tensors of the same shapes and dtypes (for
    structures whose shapes only the sender knows, send `get_data_structure` first with
    `broadcast_object_list`).
    """
    state = _state()
    if state.num_processes == 1:
        return tensor
    if state.debug:
        _check_shapes(state, tensor, "broadcast")
    hardware = state.hardware
    if isinstance(tensor, torch.Tensor):
        if tensor.is_contiguous():
            return hardware.broadcast(tensor, src=from_process)
        return tensor.copy_(hardware.broadcast(tensor.contiguous(), src=from_process))
    tensors = _leaves(tensor, [])
    for idx in _packed(tensors).values():
        flat = _flat(tensors, idx).contiguous()
        hardware.broadcast(flat, src=from_process)
        if len(idx) == 1 and flat.data_ptr() == tensors[idx[0]].data_ptr():
            continue
        offset = 0
        for i in idx:
            t = tensors[i]
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return tensor


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace, in place, the items of `object_list` by those of process `from_process`."""
    state = _state()
    if state.num_processes > 1:
        state.hardware.broadcast_object_list(object_list, src=from_process)
    return object_list


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor that exists on one process only (None on the others) given to every process, on its device.

    Unlike `broadcast`, the receivers need not know its shape or dtype. Exactly one
    process must pass a tensor.
    """
    state = _state()
    if state.num_processes == 1:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: the only process passed None; pass the tensor to copy")
        return tensor.to(state.device)
    described = None if tensor is None else (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
    everyone = state.hardware.all_gather_object(described)
    holders = [rank for rank, info in enumerate(everyone) if info is not None]
    if len(holders) != 1:
        raise ValueError(
            f"copy_tensor_to_devices needs the tensor on exactly one process and None on the others; processes "
            f"{holders or 'none'} passed a tensor"
        )
    shape, dtype_name = everyone[holders[0]]
    if tensor is None:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype_name), device=state.device)
    else:
        tensor = tensor.to(state.device).contiguous()
    return state.hardware.broadcast(tensor, src=holders[0])


_REDUCTIONS = ("mean", "sum", "max", "min", "none")


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce every tensor of a nested structure across processes: "mean", "sum", "max", "min" or "none".

    Returns new tensors (the inputs are left untouched); the result is multiplied by
    `scale`. "mean" of integer tensors gives floating-point tensors.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduce(reduction={reduction!r}) is not supported; use one of {', '.join(_REDUCTIONS)}")
    state = _state()
    world = state.num_processes
    if world > 1 and reduction != "none" and state.debug:
        _check_shapes(state, tensor, "reduce")
    op = reduction if reduction in ("max", "min") else "sum"
    tensors = _leaves(tensor, [])
    reduced: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in _packed(tensors).values():
        flat = _flat(tensors, idx).clone()
        if world > 1 and reduction != "none":
            state.hardware.all_reduce(flat, op)
        if reduction == "mean" and world > 1:
            flat = flat / world if not flat.is_floating_point() else flat.div_(world)
        if scale != 1.0:
            flat = flat * scale
        offset = 0
        for i in idx:
            t = tensors[i]
            reduced[i] = flat[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
    return _replace_leaves(tensor, reduced)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad every tensor of a nested structure along `dim` to its largest size over all processes.

    Sizes are exchanged in a single collective for the whole structure. Padding
    (`pad_index`) goes at the end, or at the start with `pad_first`. Tensors with fewer
    than `dim + 1` dimensions are returned as they are.
    """
    tensors = _leaves(tensor, [])
    if not tensors:
        return tensor
    nested = [getattr(t, "is_nested", False) for t in tensors]
    if any(nested):
        warnings.warn(
            "pad_across_processes cannot pad nested tensors (their sizes vary inside the tensor): "
            "they are returned unpadded; pad their components before nesting them",
            CannotPadNestedTensorWarning,
            stacklevel=2,
        )
    state = _state()
    if state.num_processes == 1:
        return tensor
    if state.debug:
        _check_ranks(state, tensor)
    # per tensor: the padded dimension counted from 0, or None (nested, or `dim` out of its range: left as is)
    dims = [None if n or not -t.dim() <= dim < t.dim() else dim % t.dim() for t, n in zip(tensors, nested, strict=True)]
    sizes = torch.tensor(
        [-1 if d is None else t.shape[d] for t, d in zip(tensors, dims, strict=True)],
        dtype=torch.int64,
        device=state.device,
    )
    everyone = state.hardware.all_gather_into(sizes.new_empty(state.num_processes * len(tensors)), sizes)
    largest = everyone.view(state.num_processes, -1).max(dim=0).values.tolist()
    padded = [
        t if d is None else _pad(t, d, size, pad_index, pad_first)
        for t, d, size in zip(tensors, dims, largest, strict=True)
    ]
    return _replace_leaves(tensor, padded)


def _pad(t: torch.Tensor, dim: int, size: int, pad_index: int, pad_first: bool) -> torch.Tensor:
    if t.dim() <= dim or t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_full(shape, pad_index)
    start = size - t.shape[dim] if pad_first else 0
    out.narrow(dim, start, t.shape[dim]).copy_(t)
    return out
