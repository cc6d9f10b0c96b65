"""Every private torch API the simulated devices (GPU, TPU) rely on, each in one small function.

A simulated CUDA tensor needs a few things torch offers only privately: a wrapper tensor
subclass, a Python backend registered on the PrivateUse1 dispatch key (C++ must see a
device it can run autograd on, which a CPU-only build cannot do for CUDA), the dispatch
key sets used to step over autocast, the metadata-only `set_` kernel of the Meta key,
the hook that rebuilds tensors from checkpoints, and a few more. Nothing else in
`accel.sim` touches `torch._C` or an underscored torch name: when a torch upgrade breaks
one of them, this is the only module to fix, and `tests/test_sim_cuda_internals.py`
names which one broke.

`check_supported()` is what `--simulate cuda` calls at start: it fails with a message
naming the supported torch versions when the installed torch is none of them, or lacks
one of the internals.

Supported: torch 2.13, 2.14 and 2.15, CPU and CUDA builds alike. What changed between them
is listed in `TORCH_CHANGES` (the release that changed it, what the simulated devices do
about it, and the test that checks it on every supported torch).
"""

from __future__ import annotations

import functools
import io
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

#: torch versions (major.minor) the simulated devices are built and tested against, CPU and CUDA builds
#: (pyproject.toml's torch range says the same; CI runs the simulator's tests on two of them)
SUPPORTED_TORCH = ("2.13", "2.14", "2.15")


class UnsupportedTorchError(RuntimeError):
    """The installed torch is not a supported version, or lacks an internal the simulated devices need."""


def release(version: str | None = None) -> str:
    """'2.14' of '2.14.1+cu130' (of this torch's version when None)."""
    match = re.match(r"(\d+)\.(\d+)", str(torch.__version__ if version is None else version))
    if match is None:
        raise UnsupportedTorchError(f"cannot read a torch release from the version {version!r}")
    return f"{match.group(1)}.{match.group(2)}"


def at_least(wanted: str, version: str | None = None) -> bool:
    """Whether this torch (or `version`) is release `wanted` ('2.14') or a later one."""
    have = tuple(int(part) for part in release(version).split("."))
    return have >= tuple(int(part) for part in wanted.split("."))


class TorchChange(NamedTuple):
    """One difference between supported torch versions, as the simulated devices meet it."""

    #: the release that changed it ('2.14': from 2.14 on)
    since: str
    #: what changed in torch
    what: str
    #: what the simulated devices do about it ("torch's own": they do as torch does, nothing to adapt)
    handled: str
    #: the test that checks it on every supported torch, as "path::function"
    test: str


#: every difference between the supported torch versions that the simulator or its tests meet
TORCH_CHANGES: tuple[TorchChange, ...] = (
    TorchChange(
        "2.14",
        "Dynamo asks torch.cuda.is_current_stream_capturing() before it traces a frame: a CUDA build's asks the "
        "driver (a host without one fails, a GPU host would be touched), a CPU build's raises",
        "simulated ranks answer False (no CUDA graph is ever captured there): accel/sim/cuda/fake.py",
        "tests/multiproc/test_sim_compile.py::test_dynamo_asks_no_driver_whether_a_cuda_graph_is_captured",
    ),
    TorchChange(
        "2.14",
        "new_group(...) of a bound default group hands the group it could split from to every new backend's "
        "C++ options, which take a C++ backend only (a Python group: TypeError)",
        "keep_python_groups_out_of_splits: a Python group is never handed on (it splits on its own)",
        "tests/multiproc/test_sim_nccl_semantics.py::test_new_group_of_a_bound_group",
    ),
    TorchChange(
        "2.14",
        "split_group(...) gives a rank in none of the groups GroupMember.NON_GROUP_MEMBER, not None",
        "torch's own",
        "tests/multiproc/test_sim_nccl_semantics.py::test_split_group",
    ),
    TorchChange(
        "2.14",
        "DTensor redistributes Shard to Partial(sum); Replicate to Partial is refused in new words",
        "torch's own",
        "tests/multiproc/test_sim_cuda_tensor_parallel.py::test_redistribute_between_shard_replicate_and_partial",
    ),
    TorchChange(
        "2.14",
        "all_gather_into_tensor and reduce_scatter_tensor are deprecated (FutureWarning) for all_gather_single "
        "and reduce_scatter_single",
        "the stand-in torch_xla calls reduce_scatter_single; the collective check checks it too",
        "tests/test_sim_diagnoses.py::test_reduce_ops_and_subgroups_are_checked_too",
    ),
    TorchChange(
        "2.15",
        "each new process group gets a C++ flight recorder unless its backends record themselves; it reads the "
        "group's C++ name, which a Python group does not have (RuntimeError: ProcessGroup name not set)",
        "record_no_flights_of: the simulator's Python groups (accel.sim.core.carried.PythonGroup) get none",
        "tests/test_sim_cuda_internals.py::test_the_simulators_python_groups_get_no_flight_recorder",
    ),
    TorchChange(
        "2.15",
        "the private _get_split_source(pg) of torch 2.14 takes the requested backend too: (pg, backend)",
        "keep_python_groups_out_of_splits passes on whatever torch gives it",
        "tests/multiproc/test_sim_nccl_semantics.py::test_new_group_of_a_bound_group",
    ),
    TorchChange(
        "2.15",
        "split_group(...) no longer needs the default group bound to a device (init_process_group(device_id=...))",
        "torch's own: the simulated NCCL subgroup sets its communicator up at its first collective, as NCCL's",
        "tests/multiproc/test_sim_nccl_semantics.py::test_split_group_of_a_group_bound_to_no_device",
    ),
    TorchChange(
        "2.15",
        "Dynamo's current-stream look-up (torch._dynamo.utils.get_current_stream) moved to C++, which checks the "
        "device against C++'s accelerator: the hidden device",
        "ask_python_for_dynamos_current_stream: torch.accelerator.current_stream, as up to 2.14",
        "tests/multiproc/test_sim_compile.py::test_dynamo_asks_no_driver_whether_a_cuda_graph_is_captured",
    ),
    TorchChange(
        "2.15",
        "FSDP2 records the stream of its gradient outputs by its stream_id",
        "a simulated GPU's stream has the default stream's id, 0: accel/sim/cuda/torch_cuda/streams.py",
        "tests/multiproc/test_sim_cuda_tensor_parallel.py::test_fsdp2_on_dp_by_tensor_parallel_on_tp",
    ),
)


# -- presence checks: one per internal, each naming why it is needed ------------------------


def _has(path: str) -> bool:
    obj: Any = torch
    for part in path.split(".")[1:]:
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


#: internal -> why the simulated GPU needs it (the tests check each one is present and works)
INTERNALS: dict[str, str] = {
    "torch.Tensor._make_wrapper_subclass": (
        "a tensor whose Python device is cuda:k and whose data is a CPU tensor; "
        "other libraries' wrappers given cuda:k are built on the hidden device"
    ),
    "torch._C._disabled_torch_function_impl": "the subclass runs no __torch_function__ of its own (speed)",
    "torch.utils.backend_registration._setup_privateuseone_for_python_backend": (
        "C++ sees the wrapper on a Python-registered PrivateUse1 device, on which autograd runs"
    ),
    "torch._C._acc.DeviceGuard": "the PrivateUse1 device guard written in Python",
    "torch._C._acc.PrivateUse1Hooks": "the PrivateUse1 hooks written in Python",
    "torch._C._autograd.DeviceType": "the device type the Python guard reports",
    "torch._C.DispatchKey": "the autocast key of the PrivateUse1 device",
    "torch._C.DispatchKeySet": "stepping over that autocast key inside the autocast kernels",
    "torch._C._ExcludeDispatchKeyGuard": "stepping over that autocast key inside the autocast kernels",
    "torch._C._jit_get_all_schemas": "finding the factory ops that must run for the CUDA key",
    "torch._C._nn._parse_to": "reading Tensor.to's arguments exactly as torch does",
    "torch._tensor_str._str": "printing a simulated tensor as a CUDA tensor prints",
    "torch._tensor_str._tensor_str": "printing a simulated tensor as a CUDA tensor prints",
    "torch._utils._rebuild_tensor": "checkpoints tagged cuda:k load back on that simulated GPU",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor": "simulated XLA tensors pickle as torch pickles XLA tensors",
    "torch.optim.optimizer._foreach_supported_types": "optimizers take the foreach path as on a real GPU",
    "torch._C._distributed_c10d._create_work_from_future": "the simulated NCCL group returns finished work",
    "torch._C._get_accelerator": "torch.accelerator and torch's own device look-ups answer CUDA, not the hidden device",
    "torch._C._accelerator_getAccelerator": "torch.accelerator.current_accelerator() answers CUDA",
    "torch._C.TensorBase.data": "`param.data = x` moves a parameter onto or off a simulated GPU",
    "torch._C.TensorBase.device": "DTensor and other wrappers of simulated CUDA tensors report CUDA",
    "torch._C.TensorBase.grad": "assigning a gradient on the wrong device fails with CUDA's words",
    "torch._C.TensorBase._use_count": "a tensor moving between host and GPU keeps its identity, knowing who holds it",
    "torch._C._swap_tensor_impl": "a tensor nothing else holds moves between host and GPU, weakly referenced or not",
    "torch._C.TensorBase._backward_hooks": "a tensor that moved between host and GPU still runs its gradient hooks",
    "torch._C.TensorBase._post_accumulate_grad_hooks": "and its post-accumulate-grad hooks",
    "torch._has_compatible_shallow_copy_type": "Module.cpu() keeps parameters as a GPU does: it moves them in place",
    "torch._C.TensorBase.is_cuda": "DTensor and other wrappers of simulated CUDA tensors are CUDA tensors",
    "torch._C._distributed_c10d.Logger": "DDP does not warn that it has no timer for the hidden device",
    "torch.distributed.distributed_c10d._resolve_process_group": "functional collectives name their group",
    "torch._C._distributed_c10d.ProcessGroupGloo._allgather_base": "Gloo carries all_gather_single",
    "torch._C._dispatch_has_kernel_for_dispatch_key": "composite ops reaching a simulated GPU whole are decomposed",
    "torch.distributed.distributed_c10d._get_default_group": "the collective check numbers each backend of a group",
    "torch.distributed.distributed_c10d._get_object_coll_device": "the collective check numbers backends apart",
    "torch.distributed.distributed_c10d._maybe_attach_flight_recorder": (
        "no flight recorder on the simulator's Python groups: C++ cannot read their names (torch 2.15 on)"
    ),
    "torch.distributed.distributed_c10d._get_split_source": (
        "new_group of a bound simulated NCCL group: its Python group is not handed to the new backend to split from"
    ),
    "torch._C._distributed_c10d.ProcessGroupGloo._reduce_scatter_base": "Gloo carries reduce_scatter_single",
    "torch.distributed.tensor._op_schema._rebuild_tensor_from_dtensor_meta": (
        "DTensor works out output shapes on fake tensors of the hidden device, which has a device guard"
    ),
    "torch.distributed.tensor._random.OffsetBasedRNGTracker": (
        "DTensor's random ops (sharded init, dropout) draw from the simulated GPU's CPU generator"
    ),
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.reset_sharded_param": (
        "FSDP2 keeps a sharded parameter's padded storage (what `model.state_dict()` shares) on simulated GPUs"
    ),
    "torch.distributed.tensor._random.OffsetBasedRNGTracker._distribute_region": (
        "DTensor's random ops given a GPU generator read its Philox state, not the host generator's"
    ),
    "torch.distributed.fsdp._init_utils._get_device_from_device_id": "FSDP1's device_id=<index> means cuda:<index>",
    "torch.distributed.fsdp._init_utils._init_device_handle": "FSDP1's device_id=<index> means cuda:<index>",
    "torch.distributed.fsdp._init_utils._get_compute_device": "FSDP1 computes on cuda:k, not on the hidden device",
    "torch.distributed.fsdp._init_utils._get_orig_params": "FSDP1 computes on cuda:k for a module without parameters",
    "torch.distributed.fsdp._init_utils._materialize_meta_module": "FSDP1 materialises meta modules on cuda:k",
    "torch._dynamo.callback.CompilationCallbackHandler": (
        "the simulated GPU counts no memory for Dynamo's fake tensors, and again once Dynamo has compiled"
    ),
    "torch._subclasses.fake_tensor.FakeTensor": "a fake CUDA tensor made while Dynamo traces joins simulated ones",
    "torch._higher_order_ops.flex_attention.flex_attention": "compiled flex attention runs on simulated tensors",
    "torch._higher_order_ops.flex_attention.flex_attention_backward": "and so does its backward",
    "torch._dynamo.utils.get_current_stream": "compiled code asks the simulated device for its current stream",
    "torch._dynamo.guards.get_current_stream": "and so do Dynamo's guards",
    "torch._dynamo.trace_rules.add": "torch.compile never traces the simulator's own code (it is the device)",
    "torch._subclasses.meta_utils.MetaTensorDescriber": (
        "torch.compile's Dynamo makes fake tensors of simulated ones from their own storage, not their data's"
    ),
    "torch._C._current_autograd_node": (
        "out-of-memory in backward waits until backward returns: C++ would abort unwinding it through the guard"
    ),
    "torch._C._accelerator_setAllocatorSettings": (
        "torch.cuda.memory._set_allocator_settings(...) reaches the simulated caching allocator"
    ),
    "torch._C._accelerator_getAllocatorSettings": "and the settings it took are read back",
    "torch._dynamo.backends.common.aot_autograd": (
        "compiled regions are traced forward and backward together as Inductor traces them (what backward keeps)"
    ),
    "torch._functorch.partitioners.min_cut_rematerialization_partition": (
        "Inductor's partitioner chooses what a compiled region saves for backward"
    ),
    "torch._inductor.decomposition.select_decomp_table": "the ops Inductor decomposes before it partitions",
    "torch._dynamo.backends.distributed.DDPOptimizer": (
        "a DDP model's compiled pieces (split at its buckets) are counted as eager code"
    ),
    "torch._ops.OpOverload": (
        "an op of a compiled region's graph, whose tags (and schema, `_schema`) say how Inductor treats it"
    ),
}


def missing_internals() -> list[str]:
    """The internals of `INTERNALS` that this torch lacks (empty when all are there).

    Those in DTensor and FSDP (`LAZY`) are checked when a rank imports them (`after_import`):
    importing them costs seconds, which a rank that does not use them should not pay.
    """
    missing = [name for name in INTERNALS if not name.startswith(LAZY) and expected(name) and not _has_dotted(name)]
    if not os.path.exists(autocast_header()):
        missing.append(autocast_header())
    return missing


#: internals of `INTERNALS` that torch has only from a later release than the oldest supported -> that release
INTERNALS_SINCE: dict[str, str] = {
    "torch.distributed.distributed_c10d._maybe_attach_flight_recorder": "2.15",
}


def expected(name: str) -> bool:
    """Whether this torch should have internal `name` (those of `INTERNALS_SINCE` only from their release)."""
    return at_least(INTERNALS_SINCE.get(name, SUPPORTED_TORCH[0]))


#: packages whose internals are checked (and patched) only once a rank imports them
LAZY = (
    "torch.distributed.tensor.",
    "torch.distributed.fsdp.",
    "torch._subclasses.",
    "torch._dynamo.",
    "torch._higher_order_ops.",
    "torch._functorch.",
    "torch._inductor.",
)


def _has_dotted(name: str) -> bool:
    if name.startswith(LAZY):
        import importlib

        module, attribute = name.rsplit(".", 1)
        if name.count(".") > 1 and module.rsplit(".", 1)[1][:1].isupper():  # module.Class.attribute
            module, owner = module.rsplit(".", 1)
            return hasattr(getattr(importlib.import_module(module), owner, None), attribute)
        return hasattr(importlib.import_module(module), attribute)
    if name.startswith("torch.utils.backend_registration."):
        import torch.utils.backend_registration as registration

        return hasattr(registration, name.rsplit(".", 1)[1])
    if name.startswith("torch.distributed.distributed_c10d."):
        from torch.distributed import distributed_c10d

        return hasattr(distributed_c10d, name.rsplit(".", 1)[1])
    if name.startswith("torch.optim.optimizer."):
        import torch.optim.optimizer as optimizer

        return hasattr(optimizer, name.rsplit(".", 1)[1])
    return _has(name)


def check_supported(version: str | None = None) -> None:
    """Raise `UnsupportedTorchError` naming the supported versions if this torch cannot host simulated GPUs.

    `version`: check that version string instead of this torch's (its internals are still this torch's).
    """
    version = str(torch.__version__ if version is None else version)
    if release(version) not in SUPPORTED_TORCH:
        raise UnsupportedTorchError(
            f"simulated devices do not support torch {version}; supported torch versions: "
            f"{', '.join(SUPPORTED_TORCH)}. Install one of them (pip install 'torch>={SUPPORTED_TORCH[0]},"
            f"<{_next_release(SUPPORTED_TORCH[-1])}'), or simulate 'cpu'."
        )
    missing = missing_internals()
    if missing:
        raise UnsupportedTorchError(
            f"simulated CUDA needs torch internals that torch {torch.__version__} lacks ({', '.join(missing)}); "
            f"supported torch versions: {', '.join(SUPPORTED_TORCH)}. Install one of them, or simulate 'cpu'."
        )


def _next_release(last: str) -> str:
    major, minor = last.split(".")
    return f"{major}.{int(minor) + 1}"


# -- the wrapper subclass ---------------------------------------------------------------------


#: the subclass's `__torch_function__`: none of its own, which keeps each op cheap
disabled_torch_function = torch._C._disabled_torch_function_impl


def make_wrapper(cls: type, inner: torch.Tensor, device: torch.device, requires_grad: bool) -> Any:
    """An instance of `cls` shaped like `inner`, on C++ device `device`, holding no data itself."""
    if inner.is_nested and inner.layout is _STRIDED:  # a wrapper has sizes; a strided nested tensor has none
        raise NotImplementedError(
            "nested tensors of torch.strided layout are not simulated on a simulated device (nn.TransformerEncoder "
            "makes them in eval mode given a padding mask): use torch.nested's layout=torch.jagged, or "
            "TransformerEncoder(..., enable_nested_tensor=False)"
        )
    if inner.layout is _STRIDED and inner.is_contiguous() and not inner.storage_offset():
        # the common case, and cheaper: contiguous strides and offset 0 are the defaults
        # (and so is requires_grad=False: each keyword given costs parsing time)
        if requires_grad:
            return _make_wrapper_subclass(cls, inner.size(), dtype=inner.dtype, device=device, requires_grad=True)
        return _make_wrapper_subclass(cls, inner.size(), dtype=inner.dtype, device=device)
    return _make_wrapper_subclass(
        cls,
        inner.size(),
        strides=inner.stride(),
        storage_offset=inner.storage_offset(),
        dtype=inner.dtype,
        layout=inner.layout,
        device=device,
        requires_grad=requires_grad,
    )


_STRIDED = torch.strided
_make_wrapper_subclass = torch.Tensor._make_wrapper_subclass


def tensor_text(inner: torch.Tensor, contents: str | None) -> tuple[str, str]:
    """(torch's full repr text of `inner`, the data part alone) as torch formats them."""
    strings: Any = torch._tensor_str
    text = strings._str(inner, tensor_contents=contents)
    data = "[]" if inner.numel() == 0 else strings._tensor_str(inner, len("tensor("))
    return text, data


_META_KEYS = None


def sync_metadata(wrapper: torch.Tensor, inner: torch.Tensor) -> None:
    """Give `wrapper` the sizes, strides and offset `inner` now has (an op resized it in place).

    `set_`'s Meta kernel changes the metadata of a TensorImpl without touching data and
    without re-entering Python dispatch.
    """
    global _META_KEYS
    if _META_KEYS is None:
        _META_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _META_KEYS,
        wrapper,
        torch.Tensor.untyped_storage(wrapper),  # the wrapper's own (empty) storage, not the inner one
        inner.storage_offset(),
        inner.size(),
        inner.stride(),
    )


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """(device, dtype, non_blocking, memory_format) as `Tensor.to` reads its arguments."""
    return torch._C._nn._parse_to(*args, **kwargs)


def factory_op_names() -> Iterator[str]:
    """`name.overload` of every aten op that takes a `device` and no tensor (a pure factory)."""
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        if any(a.name == "device" for a in schema.arguments) and not any(
            "Tensor" in str(a.type) for a in schema.arguments
        ):
            base = schema.name[len("aten::") :]
            yield base + ("." + schema.overload_name if schema.overload_name else "")


# -- the PrivateUse1 backend under the wrapper ----------------------------------------------------


def register_python_backend(name: str, module: Any) -> None:
    """Register PrivateUse1, renamed `name`, as a Python backend (process-wide, irreversible).

    Its guard and hooks say the device exists; autograd then runs on the wrapper tensors.
    """
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    acc: Any = torch._C._acc
    device_type = torch._C._autograd.DeviceType.PrivateUse1

    class Guard(acc.DeviceGuard):
        def type_(self) -> Any:
            return device_type

    class Hooks(acc.PrivateUse1Hooks):
        def is_available(self) -> bool:
            return True

        def has_primary_context(self, device_index: int) -> bool:
            return True

        def is_built(self) -> bool:
            return True

    guard, hooks = Guard(), Hooks()
    _KEEP_ALIVE.extend([guard, hooks])  # C++ keeps raw pointers to them
    _setup_privateuseone_for_python_backend(name, module, hooks, guard)


_KEEP_ALIVE: list[Any] = []


def privateuse1_name() -> str:
    """The name PrivateUse1 has in this process ('privateuseone' until someone renames it)."""
    return torch._C._get_privateuse1_backend_name()


def autocast_key_guard() -> Any:
    """A context in which the PrivateUse1 autocast key is skipped (autocast kernels call on)."""
    key: Any = torch._C.DispatchKey  # its stubs lack the autocast keys
    keys = torch._C.DispatchKeySet(key.AutocastPrivateUse1)
    return torch._C._ExcludeDispatchKeyGuard(keys)


# -- autocast policy: CUDA's op lists, as torch ships them -------------------------------------------


def autocast_header() -> str:
    """Path of the C++ header in which torch lists CUDA's autocast policy."""
    return os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")


#: macro in autocast_mode.h -> our policy name
AUTOCAST_MACROS = {
    "AT_FORALL_LOWER_PRECISION_FP": "lower",
    "AT_FORALL_FP32": "fp32",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_opt",
    "AT_FORALL_PROMOTE": "promote",
}


def autocast_op_lists() -> dict[str, list[tuple[str, str]]]:
    """Policy name -> [(op, overload)] read from torch's own autocast header.

    The header is what CUDA's autocast kernels are generated from, so the simulated GPU
    follows whatever policy the installed torch has.
    """
    with open(autocast_header()) as header:
        text = header.read()
    lists: dict[str, list[tuple[str, str]]] = {}
    for macro, policy in AUTOCAST_MACROS.items():
        match = re.search(r"#define " + macro + r"\(_\)\s*\\\n(.*?)\n\n", text, re.S)
        if match is None:
            raise UnsupportedTorchError(
                f"{autocast_header()} has no {macro} list any more: the simulated GPU cannot read CUDA's autocast "
                f"policy from torch {torch.__version__}; supported torch versions: {', '.join(SUPPORTED_TORCH)}"
            )
        ops = re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", match.group(1))
        lists[policy] = [(op, overload or "default") for op, overload in ops]
    return lists


def native_functions_yaml() -> str | None:
    """Path of the op declarations torch ships (in its `torchgen` package), or None without them.

    They say how each op checks devices on CUDA (TensorIterator or argument by argument)
    and the name of its generated CUDA wrapper, which the GPU's error messages quote.
    """
    import importlib.util

    spec = importlib.util.find_spec("torchgen")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "packaged", "ATen", "native", "native_functions.yaml")
    return path if os.path.exists(path) else None


# -- checkpoints and optimizers ------------------------------------------------------------------


def patch_rebuild_tensor(make: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]) -> None:
    """Replace `torch._utils._rebuild_tensor` (called for every tensor a checkpoint holds) by `make(original)`."""
    import torch._utils as utils

    utils._rebuild_tensor = make(utils._rebuild_tensor)


INTERNALS["torch.storage._load_from_bytes"] = (
    "plain pickling of a simulated GPU tensor (multiprocessing queues, object collectives) keeps its GPU: its "
    "storage pickles as torch's storages do, through this loader"
)


class _StorageOnDevice(torch.storage.TypedStorage):
    """The storage of a simulated tensor being pickled: its location is its `_fake_device`, also under plain
    pickle (multiprocessing queues, object collectives), as a GPU's storage is.

    torch.save never pickles a storage itself (its persistent ids name them, with `_fake_device`); plain pickle
    calls `__reduce__`, whose torch version writes the legacy format, which records the host's location.
    """

    _fake_device: torch.device

    def __reduce__(self) -> tuple[Any, tuple]:
        data = io.BytesIO()
        torch.save(self, data)  # the zip format, which records `_fake_device`; torch's loader reads both
        return torch.storage._load_from_bytes, (data.getvalue(),)


def reduce_as_tensor_on(inner: torch.Tensor, device: torch.device, requires_grad: bool) -> tuple[Any, tuple]:
    """`__reduce_ex__` of a plain tensor holding `inner`'s data whose storage is on `device`.

    torch's own rebuild function, so that plain torch loads the file; `torch.save` records
    a storage's `_fake_device` as its location.
    """
    from collections import OrderedDict

    import torch._utils as utils

    storage = torch.storage.TypedStorage(wrap_storage=inner.untyped_storage(), dtype=inner.dtype, _internal=True)
    storage.__class__ = _StorageOnDevice  # (TypedStorage's constructor takes subclasses for its legacy types)
    storage._fake_device = device  # read by torch.serialization
    args: tuple = (storage, inner.storage_offset(), tuple(inner.size()), inner.stride(), requires_grad, OrderedDict())
    return utils._rebuild_tensor_v2, args


def reduce_as_device_tensor(inner: torch.Tensor, device: torch.device, requires_grad: bool) -> tuple[Any, tuple]:
    """`__reduce_ex__` of a tensor on a storage-less device (XLA): a CPU copy of its data, the device named.

    What torch's own `Tensor._reduce_ex_internal` gives for an XLA tensor; loading calls
    `torch._utils._rebuild_device_tensor_from_cpu_tensor`, which moves the data to that device.
    """
    import torch._utils as utils

    cpu = inner.detach().clone()
    return utils._rebuild_device_tensor_from_cpu_tensor, (cpu, inner.dtype, str(device), requires_grad)


def allow_foreach(cls: type) -> None:
    """Let optimizers take their foreach path for tensors of `cls` (they do for real CUDA tensors)."""
    import torch.optim.optimizer as optimizer

    supported: list[Any] = optimizer._foreach_supported_types
    if cls not in supported:
        supported.append(cls)


# -- process groups ------------------------------------------------------------------------------


def completed_work(result: Any) -> Any:
    """A finished `dist.Work` whose future holds `result` (what a Python process group returns).

    torch's Python process groups must return a Work; only this private factory builds one
    from a future (`dist.Work` itself cannot be completed from Python).
    """
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # not in stubs

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def keep_python_groups_out_of_splits(cls: type) -> None:
    """`new_group` never hands a `cls` group to the new group's backend as the group to split from.

    With a bound default group, `new_group` looks for a backend to split the new one from
    (`distributed_c10d._get_split_source`, private); torch 2.14 then hands it to every new
    backend's C++ options, Gloo's included, which take a C++ backend only: a Python group
    (the simulated NCCL group) fails with a TypeError. A `cls` group splits on its own
    (its backend creates the subgroup); NCCL's non-members' no-colour split is a no-op for it.
    """
    from torch.distributed import distributed_c10d

    find = distributed_c10d._get_split_source
    if getattr(find, "_accel_sim", False):
        return

    def _get_split_source(pg: Any, *args: Any, **kwargs: Any) -> Any:  # torch 2.15 passes the requested backend
        found = find(pg, *args, **kwargs)
        return None if isinstance(found, cls) else found

    _get_split_source._accel_sim = True  # type: ignore[attr-defined]
    distributed_c10d._get_split_source = _get_split_source


def record_no_flights_of(cls: type) -> None:
    """torch's flight recorder is not attached to `cls` groups, process groups written in Python (torch 2.15 on).

    From torch 2.15 `_new_process_group_helper` attaches a C++ `FlightRecorderHook` to each
    new group whose backends do not record themselves (`_maybe_attach_flight_recorder`,
    private). It files entries under the group's C++ name, which a Python group keeps in
    Python (`accel.sim.core.carried.PythonGroup`): "ProcessGroup name not set" at
    `init_process_group`. torch skips the Python groups it can tell (no device types);
    these report their devices, for torch's object collectives. Before 2.15: nothing to do.
    """
    name = "torch.distributed.distributed_c10d._maybe_attach_flight_recorder"
    if not expected(name):
        return
    from torch.distributed import distributed_c10d

    attach = getattr(distributed_c10d, name.rsplit(".", 1)[1], None)
    if attach is None:
        raise UnsupportedTorchError(
            f"simulated devices need {name}, which torch {torch.__version__} lacks; "
            f"supported torch versions: {', '.join(SUPPORTED_TORCH)}"
        )
    if getattr(attach, "_accel_sim", False):
        return

    def _maybe_attach_flight_recorder(pg: Any, *args: Any, **kwargs: Any) -> Any:
        return None if isinstance(pg, cls) else attach(pg, *args, **kwargs)

    _maybe_attach_flight_recorder._accel_sim = True  # type: ignore[attr-defined]
    setattr(distributed_c10d, name.rsplit(".", 1)[1], _maybe_attach_flight_recorder)  # torch 2.15 on: not in 2.13's


# -- the accelerator torch reports -----------------------------------------------------------------


#: the private `torch._C` entry points behind `torch.accelerator` and torch's own device look-ups
#: (`get_device_module()`, DeviceMesh, FSDP, `init_process_group()`, `barrier`), which C++ answers
#: with the hidden device
ACCELERATOR_ENTRY_POINTS = (
    "_get_accelerator",
    "_accelerator_getAccelerator",
    "_accelerator_getDeviceIndex",
    "_accelerator_setDeviceIndex",
    "_accelerator_exchangeDevice",
    "_accelerator_maybeExchangeDevice",
    "_accelerator_synchronizeDevice",
    "_accelerator_getStream",
    "_accelerator_setStream",
    "_accelerator_getDeviceCapability",
    "_accelerator_isAllocatorInitialized",
    "_accelerator_emptyCache",
    "_accelerator_emptyHostCache",
    "_accelerator_getDeviceStats",
    "_accelerator_resetAccumulatedStats",
    "_accelerator_resetPeakStats",
    "_accelerator_getMemoryInfo",
)


def patch_accelerator(answers: dict[str, Callable[..., Any]]) -> None:
    """Replace the `torch._C` accelerator entry points named in `answers` (all of `ACCELERATOR_ENTRY_POINTS`).

    torch's Python code looks each one up on `torch._C` at call time, so `torch.accelerator`
    and every torch module that asks which accelerator the host has get these answers.
    """
    unknown = set(answers) - set(ACCELERATOR_ENTRY_POINTS)
    missing = [name for name in ACCELERATOR_ENTRY_POINTS if not hasattr(torch._C, name)]
    if unknown or missing:
        raise UnsupportedTorchError(
            f"torch {torch.__version__} lacks the accelerator entry points {missing or sorted(unknown)}; "
            f"supported torch versions: {', '.join(SUPPORTED_TORCH)}"
        )
    for name, answer in answers.items():
        setattr(torch._C, name, answer)


#: torch's own `_accelerator_setAllocatorSettings`, kept before `serve_allocator_settings` replaces it
_torch_set_allocator_settings = torch._C._accelerator_setAllocatorSettings


def serve_allocator_settings(set_settings: Callable[[str], None], get_settings: Callable[[], str]) -> None:
    """Route the caching allocator's run-time settings to the simulated allocator.

    `torch.cuda.memory._set_allocator_settings(text)` calls `torch._C._accelerator_setAllocatorSettings`,
    looked up at call time; C++ would parse the text into settings no simulated GPU reads
    (and a CPU build checks only the keys every accelerator shares).
    """
    torch._C._accelerator_setAllocatorSettings = set_settings  # type: ignore[assignment]  # simulated ranks only
    torch._C._accelerator_getAllocatorSettings = get_settings


def torch_parses_allocator_settings(text: str) -> None:
    """torch's own parse of allocator settings `text` in this process, raising its errors (the tests compare)."""
    _torch_set_allocator_settings(text)


def silence_ddp_time_stats() -> None:
    """DDP keeps no runtime time statistics: its C++ logger would warn that it has no timer for the hidden device.

    A GPU run prints no such warning; the statistics it would keep (CUDA event timings)
    mean nothing on a simulated GPU. The rest of DDP's logging data is unchanged.
    """
    from torch._C._distributed_c10d import Logger

    Logger.set_runtime_stats_and_log = lambda self: None  # type: ignore[method-assign]  # simulated ranks only


# -- storages and `.data` ----------------------------------------------------------------------------

_storage_classes: dict[torch.device, type] = {}


#: called as hook(storage, new_size_in_bytes) before a storage shown on a simulated device is resized
_storage_resize_hooks: list[Callable[[torch.UntypedStorage, int], None]] = []


def on_storage_resize(hook: Callable[[torch.UntypedStorage, int], None]) -> None:
    """Have `hook(storage, nbytes)` called before `storage.resize_(nbytes)` of storages `show_storage_on` marked."""
    if hook not in _storage_resize_hooks:
        _storage_resize_hooks.append(hook)


def in_backward() -> bool:
    """Whether the autograd engine is running a node on this thread (a C++ node calls our ops).

    An exception raised by an op of the hidden device there unwinds through the engine's
    stream guard, whose destructor calls the Python device guard with the Python error
    still set: the process aborts ("terminate called without an active exception").
    """
    return torch._C._current_autograd_node() is not None


def current_autograd_node() -> Any:
    """The autograd node the engine runs on this thread now (None outside backward): the clock times the
    backward of compiled regions that run op by op as fused, knowing them by their nodes."""
    return torch._C._current_autograd_node()


def show_storage_on(storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    """`storage` (host memory) reporting `device` as its device, as a GPU tensor's storage does.

    torch keeps one Python object per storage for its whole life, so giving that object a
    subclass of `UntypedStorage` whose only change is `device` makes every later
    `untyped_storage()` of the tensors sharing it say so; its methods are the host storage's.
    """
    cls = _storage_classes.get(device)
    if cls is None:

        def resize_(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
            # the GPU's memory changes before the host's (FSDP2 frees and re-allocates its
            # unsharded parameters this way): out-of-memory first, as on the GPU
            for hook in _storage_resize_hooks:
                hook(self, size)
            return torch.UntypedStorage.resize_(self, size)

        cls = type(
            "UntypedStorage", (torch.UntypedStorage,), {"device": property(lambda self: device), "resize_": resize_}
        )
        cls.__module__ = torch.UntypedStorage.__module__
        _storage_classes[device] = cls
    if type(storage) is not cls:
        storage.__class__ = cls
    return storage


def patch_data_setter(set_data: Callable[[torch.Tensor, torch.Tensor], bool]) -> None:
    """`tensor.data = new` asks `set_data(tensor, new)` first; torch's own setter runs when it returns False.

    torch's setter (C++ `set_data`) refuses to move a tensor between a CPU tensor and a
    wrapper on the hidden device ("incompatible tensor type"), which on a GPU is allowed;
    `.data` is a C descriptor of `TensorBase`, which `torch.Tensor` can shadow with a property.
    """
    descriptor: Any = torch._C.TensorBase.data
    get = descriptor.__get__
    put = descriptor.__set__

    def data_setter(self: torch.Tensor, new: torch.Tensor) -> None:
        if not set_data(self, new):
            put(self, new)

    torch.Tensor.data = property(get, data_setter, doc=descriptor.__doc__)  # type: ignore[assignment]  # simulated ranks only


def data_descriptor() -> Any:
    """torch's own `.data` descriptor (what `patch_data_setter` shadows)."""
    return torch._C.TensorBase.data


def show_hidden_as(hidden: str, shown: Callable[[int], torch.device]) -> None:
    """Every tensor whose C++ device is `hidden` reports `shown(index)` as `.device` and is CUDA to Python.

    Tensor subclasses built around simulated CUDA tensors (DTensor, FSDP's and the
    functional collectives' wrappers) take the C++ device of what they wrap; `.device` and
    `.is_cuda` are C descriptors of `TensorBase`, which `torch.Tensor` shadows with properties.
    """
    base: Any = torch._C.TensorBase
    device_of = base.device.__get__
    is_cuda_of = base.is_cuda.__get__

    def device(self: torch.Tensor) -> torch.device:
        found = device_of(self)
        return shown(found.index or 0) if found.type == hidden else found

    def is_cuda(self: torch.Tensor) -> bool:
        return is_cuda_of(self) or device_of(self).type == hidden

    torch.Tensor.device = property(device, doc=base.device.__doc__)  # type: ignore[assignment]  # simulated ranks only
    torch.Tensor.is_cuda = property(is_cuda, doc=base.is_cuda.__doc__)  # type: ignore[assignment]


def resolve_group(group_name: Any) -> Any:
    """The process group a functional collective names (torch passes groups to its ops by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# -- pinned host memory ------------------------------------------------------------------------------

#: the headers declaring, in vtable order, the virtual methods of the hidden device's hooks
_HOOK_HEADERS = ("AcceleratorHooksInterface.h", "PrivateUse1HooksInterface.h")


def hook_vtable_order() -> list[str]:
    """The virtual methods of torch's PrivateUse1 hooks in vtable order, read from the headers torch ships.

    A destructor takes two slots (Itanium C++ ABI); `override`s take none of their own.
    """
    order: list[str] = []
    for header in _HOOK_HEADERS:
        with open(os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "detail", header)) as source:
            text = source.read()
        for match in re.finditer(r"\bvirtual\s+(~?\w+)\s*\(|\bvirtual\s+[\w:<>&*\s]+?\b(\w+)\s*\(", text):
            name = match.group(1) or match.group(2)
            order.extend([name, name] if name.startswith("~") else [name])
    return order


def _torch_library(name: str) -> Any:
    import ctypes
    import glob

    found = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", f"lib{name}.*"))
    if not found:
        raise UnsupportedTorchError(f"torch {torch.__version__} ships no lib{name} library next to its package")
    return ctypes.CDLL(found[0])


def serve_pinned_memory() -> None:
    """Pinned host memory asked of the hidden device is host memory, and all host memory counts as pinned.

    torch asks the accelerator's hooks for pinned memory and whether memory is pinned
    (DDP with `find_unused_parameters=True` copies its map of used parameters through a
    pinned buffer in every backward pass and asserts it is pinned; `pin_memory=True`
    factories); the Python-written hooks of a PrivateUse1 device cannot answer (neither
    method is exposed to Python). So two slots of the registered hooks' virtual table are
    replaced: `getPinnedMemoryAllocator` by `c10::GetCPUAllocator` (same calling
    convention: it ignores its argument and returns the allocator) and `isPinnedPtr` by a
    function answering true. The table is copied, not written in place: it lives in
    read-only memory. A simulated GPU reads host memory directly, so page-locking means
    nothing here: every host tensor is as good as pinned (`Tensor.pin_memory` returns it).
    """
    import ctypes

    order = hook_vtable_order()
    slot = order.index("getPinnedMemoryAllocator")
    get_hooks = _torch_library("torch_cpu")._ZN2at6detail19getPrivateUse1HooksEv
    get_hooks.restype = ctypes.c_void_p
    hooks = get_hooks()
    cpu_allocator = ctypes.cast(_torch_library("c10")._ZN3c1015GetCPUAllocatorEv, ctypes.c_void_p).value
    if not hooks:
        raise UnsupportedTorchError("torch has no PrivateUse1 hooks registered: register the backend first")
    vptr = ctypes.c_void_p.from_address(hooks)
    if not vptr.value:
        raise UnsupportedTorchError(f"torch {torch.__version__}: the PrivateUse1 hooks have no virtual table")
    # two words before the first slot: offset to top and type info (kept for dynamic_cast / typeid)
    size = len(order) + 2
    table = (ctypes.c_void_p * size).from_address(vptr.value - 2 * ctypes.sizeof(ctypes.c_void_p))
    copy = (ctypes.c_void_p * size)(*table)
    copy[2 + slot] = cpu_allocator
    pinned = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p)(lambda this, data: True)
    copy[2 + order.index("isPinnedPtr")] = ctypes.cast(pinned, ctypes.c_void_p).value
    _KEEP_ALIVE.extend([copy, pinned])
    vptr.value = ctypes.addressof(copy) + 2 * ctypes.sizeof(ctypes.c_void_p)


def answer_cuda_bad_fork() -> None:
    """`torch._C._cuda_isInBadFork()`, which a CUDA build has and code asks directly (Accelerate's notebook
    launcher checks a fork left CUDA usable): false, nothing of a GPU driver is inherited across a fork."""
    torch._C._cuda_isInBadFork = lambda: False  # type: ignore[attr-defined]  # a CPU build lacks it


# -- Gloo's single-tensor collectives ------------------------------------------------------------------
# ProcessGroupGloo's Python binding has them under their old private names only (no
# `all_gather_single` / `reduce_scatter_single` on the Gloo object itself).


def gloo_all_gather_single(gloo: Any, output: torch.Tensor, input: torch.Tensor, *opts: Any) -> Any:
    """Gloo's all-gather into one output tensor (`ProcessGroupGloo._allgather_base`)."""
    return gloo._allgather_base(output, input, *opts)


def gloo_reduce_scatter_single(gloo: Any, output: torch.Tensor, input: torch.Tensor, *opts: Any) -> Any:
    """Gloo's reduce-scatter of one input tensor (`ProcessGroupGloo._reduce_scatter_base`)."""
    return gloo._reduce_scatter_base(output, input, *opts)


def check_grad_device(check: Callable[[torch.Tensor, Any], None]) -> None:
    """`tensor.grad = g` calls `check(tensor, g)` first (it raises with the GPU's words), then torch's setter.

    torch's own check runs in C++ and names the hidden device; `.grad` is a C descriptor
    of `TensorBase`, which `torch.Tensor` shadows with a property (its getter is torch's).
    """
    descriptor: Any = torch._C.TensorBase.grad
    put = descriptor.__set__

    def grad_setter(self: torch.Tensor, new: Any) -> None:
        check(self, new)
        put(self, new)

    torch.Tensor.grad = property(descriptor.__get__, grad_setter, descriptor.__delete__, doc=descriptor.__doc__)  # type: ignore[assignment]  # simulated ranks only


# -- DTensor and FSDP1 ---------------------------------------------------------------------------------


class _AfterImport:
    """A `sys.meta_path` finder that runs hooks on a module right after it is first imported."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[Any], None]]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        hooks = self.hooks.pop(fullname, None)
        if hooks is None:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            for hook in hooks:
                hook(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this module's own loader
        return spec


_after_import = _AfterImport()


def after_import(name: str, hook: Callable[[Any], None]) -> None:
    """Run `hook(module)` once module `name` is imported (at once if it already is).

    DTensor and FSDP take seconds to import: a rank patches them only if it uses them. The
    internals of `INTERNALS` in that module are checked first (`UnsupportedTorchError`).
    """

    def checked(module: Any) -> None:
        lacking = [n for n in INTERNALS if n.rsplit(".", 1)[0] == name and not hasattr(module, n.rsplit(".", 1)[1])]
        if lacking:
            raise UnsupportedTorchError(
                f"simulated CUDA needs torch internals that torch {torch.__version__} lacks ({', '.join(lacking)}); "
                f"supported torch versions: {', '.join(SUPPORTED_TORCH)}"
            )
        hook(module)

    module = sys.modules.get(name)
    if module is not None:
        checked(module)
        return
    _after_import.hooks.setdefault(name, []).append(checked)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)


def propagate_dtensor_meta_on(hidden: str) -> None:
    """DTensor works out each op's output metadata on fake tensors of the hidden device, not of "cuda".

    DTensor runs an op on fake tensors made on its mesh's device type to learn the output's
    shape, strides and dtype. Fake kernels that are Python decompositions calling Tensor
    methods (`uniform_` calls `Tensor.copy_`) open a device guard for that device, and a
    CPU build of torch has none for CUDA ("PyTorch is not linked with support for cuda
    devices"); the hidden device has one. Only shape, strides and dtype are read back.
    """

    def patch(op_schema: Any) -> None:
        original = op_schema._rebuild_tensor_from_dtensor_meta

        def rebuild(arg: Any) -> Any:
            meta = arg.tensor_meta
            if arg.mesh.device_type != "cuda" or meta is None:
                return original(arg)
            return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=hidden)

        op_schema._rebuild_tensor_from_dtensor_meta = rebuild

    after_import("torch.distributed.tensor._op_schema", patch)


def show_dtensor_the_generators_given(resolve: Callable[[Any], Any]) -> None:
    """DTensor's random ops given a GPU generator read it as the GPU's, not as the host generator under it.

    An op receives a new Python object for the generator it was given, of torch's own
    type, whose state is the host generator's. DTensor's RNG tracker reads and sets that
    state as CUDA's Philox state (`_distribute_region(spec, generator)`): `resolve` gives it
    the simulated GPU's generator object instead.
    """

    def patch(random: Any) -> None:
        tracker = random.OffsetBasedRNGTracker
        original = tracker._distribute_region

        @functools.wraps(original)
        def _distribute_region(self: Any, spec: Any, generator: Any = None) -> Any:
            return original(self, spec, resolve(generator))

        tracker._distribute_region = _distribute_region

    after_import("torch.distributed.tensor._random", patch)


def keep_fsdp2_sharded_storage(plain: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """FSDP2 keeps a sharded parameter's storage at its lazy init on simulated GPUs, as on a GPU.

    `FSDPParam.reset_sharded_param` pads a parameter's shard into new memory unless its
    padded data still shares the parameter's storage, which it checks only when the data's
    type is exactly `torch.Tensor` ("TODO: need to support tensor subclass"). A simulated
    CUDA tensor is a subclass, so each uneven shard moved to new memory at the first
    forward, and a `model.state_dict()` taken before it no longer shared the parameter.
    `plain(t)` is the host tensor under a simulated one (same storage), else None: the
    check reads that.
    """

    def patch(fsdp_param: Any) -> None:
        original = fsdp_param.FSDPParam.reset_sharded_param

        @functools.wraps(original)
        def reset_sharded_param(self: Any) -> None:
            data = getattr(self, "_sharded_param_data", None)
            host = plain(data) if isinstance(data, torch.Tensor) else None
            if host is None:
                original(self)
                return
            self._sharded_param_data = host
            try:
                original(self)
            finally:
                if self._sharded_param_data is host:  # kept: the simulated tensor again
                    self._sharded_param_data = data

        fsdp_param.FSDPParam.reset_sharded_param = reset_sharded_param

    after_import("torch.distributed.fsdp._fully_shard._fsdp_param", patch)


def show_fsdp1_devices_as(hidden: str, shown: Callable[[int], torch.device]) -> None:
    """FSDP1 (`FullyShardedDataParallel`) computes on `shown(k)` where it would build the hidden device.

    FSDP1 turns `device_id=k` and `torch.cuda.current_device()` into devices with
    `torch.device(k)`, which C++ resolves to the current accelerator's type: the hidden
    device (on a GPU host, cuda:k). It then finds the module's cuda:k parameters on a
    device other than `device_id`'s, and its device handle would be the hidden device's.
    """

    def as_shown(device: Any) -> Any:
        if isinstance(device, int) and not isinstance(device, bool):
            return shown(device)
        if isinstance(device, torch.device) and device.type == hidden:
            return shown(device.index or 0)
        return device

    def patch(init_utils: Any) -> None:
        get_device = init_utils._get_device_from_device_id
        init_handle = init_utils._init_device_handle
        compute_device = init_utils._get_compute_device
        materialize = init_utils._materialize_meta_module

        def _get_device_from_device_id(device_id: Any, *args: Any) -> Any:
            return as_shown(get_device(as_shown(device_id), *args))

        def _init_device_handle(state: Any, module: Any, ignored_params: Any, device_id: Any) -> Any:
            return init_handle(state, module, ignored_params, as_shown(device_id))

        def _get_compute_device(module: Any, ignored: Any, from_id: Any, rank: int, handle: Any) -> Any:
            param = next(init_utils._get_orig_params(module, ignored), None)
            if param is not None and param.device.type != "cpu":
                return as_shown(compute_device(module, ignored, from_id, rank, handle))
            # no parameter of its own on the GPU (an auto-wrapped root, a re-wrap): the current
            # GPU, which torch names with a bare index (the hidden device)
            current = shown(handle.current_device())
            if from_id is not None and current != as_shown(from_id):
                raise ValueError(f"Inconsistent compute device and `device_id` on rank {rank}: {current} vs {from_id}")
            return current

        def _materialize_meta_module(root: Any, device_id: Any, *args: Any) -> Any:
            device = shown(torch.cuda.current_device()) if device_id is None else as_shown(device_id)
            return materialize(root, device, *args)

        init_utils._get_device_from_device_id = _get_device_from_device_id
        init_utils._init_device_handle = _init_device_handle
        init_utils._get_compute_device = _get_compute_device
        init_utils._materialize_meta_module = _materialize_meta_module
        # FullyShardedDataParallel binds _init_device_handle by name once _init_utils is imported
        fsdp: Any = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
        if fsdp is not None:
            fsdp._init_device_handle = _init_device_handle

    after_import("torch.distributed.fsdp._init_utils", patch)


# -- dispatch and groups -------------------------------------------------------------------------------


def is_composite(func: Any) -> bool:
    """Whether aten op `func` has a composite (decomposable) kernel, which runs before any backend's."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


INTERNALS["torch._C._DisableAutocast"] = (
    "a CUDA graph's replay runs its recorded ops as captured, not cast again by an autocast region around it"
)


def autocast_off() -> Any:
    """A context in which no autocast casts ops (every device type). Private: torch's own guard, which
    `torch.autocast(enabled=False)` offers for one device type only."""
    return torch._C._DisableAutocast()


INTERNALS["torch._decomp.decomposition_table"] = (
    "CUDA-only ops without a host kernel (the fused RMSNorm's backward) compute what torch's decomposition computes"
)


def decomposition(func: Any) -> Callable[..., Any]:
    """torch's Python decomposition of aten op `func`. Private: `torch._decomp.decomposition_table` is where
    torch keeps them (Inductor and export read it there); no public accessor."""
    from torch._decomp import decomposition_table

    return decomposition_table[func]


INTERNALS["torch._library.custom_ops.OPDEFS"] = (
    "an op written in Python (torch.library.custom_op) runs its own function on simulated tensors, as on the device"
)


def python_custom_op_kernel(func: Any, device_type: str) -> Callable[..., Any] | None:
    """The Python function a `torch.library.custom_op` runs on `device_type` tensors (its kernel for that device,
    else its default one); None for other ops. Private: torch keeps a custom op's functions in
    `torch._library.custom_ops.OPDEFS` (qualified name -> CustomOpDef, `_backend_fns` by device type) and
    offers no public way to ask which function would run."""
    from torch._library import custom_ops

    opdef = custom_ops.OPDEFS.get(func._schema.name)
    if opdef is None:
        return None
    kernels = opdef._backend_fns
    return kernels.get(device_type) or kernels.get(None)


def group_device_types(group: Any) -> list[torch.device]:
    """The device types `group` (None: the default group) has a backend for."""
    from torch.distributed.distributed_c10d import _get_default_group

    return (group or _get_default_group())._device_types


def object_collective_device(group: Any) -> Any:
    """The device `group`'s object collectives (gather_object, ...) run on."""
    from torch.distributed.distributed_c10d import _get_object_coll_device

    return _get_object_coll_device(group)


# -- torch.compile ----------------------------------------------------------------------------

#: set while Dynamo's fake-tensor converter describes a wrapper (`describing_wrapper`)
_describing = threading.local()


def describing_wrapper() -> bool:
    """Whether Dynamo's fake-tensor converter is describing a simulated tensor on this thread."""
    return getattr(_describing, "active", False)


def describe_wrappers_for_tracing(cls: type) -> None:
    """Dynamo's fake copy of a `cls` tensor is built from the wrapper's own storage, not its data's.

    A simulated tensor reports its inner tensor's storage (what aliases what), which the
    fake-tensor converter (`MetaTensorDescriber.describe_tensor`, private) then meets twice,
    once for the wrapper and once for the inner tensor it flattens to, and takes for an alias
    it cannot build ("Attempted to set the storage of a tensor on device simcuda:0 to a
    storage on different device meta"). While it describes a wrapper, `untyped_storage()`
    gives the wrapper's own (`describing_wrapper`); aliasing is still seen through the inner tensors.
    """

    def patch(meta_utils: Any) -> None:
        describe = meta_utils.MetaTensorDescriber.describe_tensor
        if getattr(describe, "_accel_sim", False):
            return

        def describe_tensor(self: Any, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(t, cls) or describing_wrapper():
                return describe(self, t, *args, **kwargs)
            _describing.active = True
            try:
                return describe(self, t, *args, **kwargs)
            finally:
                _describing.active = False

        describe_tensor._accel_sim = True  # type: ignore[attr-defined]
        meta_utils.MetaTensorDescriber.describe_tensor = describe_tensor

    after_import("torch._subclasses.meta_utils", patch)


def keep_dynamo_out_of(package: str) -> None:
    """Dynamo never traces the code of `package` (`trace_rules.add`, private): it runs as the device's, eagerly.

    Ops on a simulated tensor run the simulator's `__torch_dispatch__` in Python; on a GPU
    they are kernels, which Dynamo neither compiles nor inlines. Without this, a frame that
    Dynamo leaves to run eagerly has its simulated ops compiled as user code.
    """
    after_import("torch._dynamo.trace_rules", lambda trace_rules: trace_rules.add(package))


def ask_python_for_dynamos_current_stream() -> None:
    """Code Dynamo compiles looks up the current stream with `torch.accelerator.current_stream`, as up to torch 2.14.

    A compiled frame reads the current stream of the accelerator device it runs on
    (`torch._dynamo.utils.get_current_stream`, private; bound by name in `torch._dynamo.guards`).
    Up to torch 2.14 that is `torch.accelerator.current_stream`, which simulated devices answer;
    torch 2.15 moved it to C++, which checks the device against C++'s accelerator, the hidden
    device: "cuda doesn't match the current accelerator simcuda".
    """

    def get_current_stream(device: torch.device) -> Any:
        return torch.accelerator.current_stream(device)

    for module in ("torch._dynamo.utils", "torch._dynamo.guards"):
        after_import(module, lambda found: setattr(found, "get_current_stream", get_current_stream))


def around_dynamo_compiles(start: Callable[[], None], end: Callable[[], None]) -> None:
    """Call `start()` when Dynamo starts compiling a frame and `end()` when it is done (nested compiles: once).

    While Dynamo traces, the simulated tensors it meets hold fake data: what runs on them
    then is not the program's work (no memory, no random numbers). The handler's methods
    are patched, not its list of callbacks, which `torch._dynamo.reset()` empties.
    """

    def register(callback: Any) -> None:
        handler = callback.CompilationCallbackHandler
        run_start, run_end = handler.run_start_callbacks, handler.run_end_callbacks
        if getattr(run_start, "_accel_sim", False):
            return

        def run_start_callbacks(self: Any, args: Any) -> None:
            start()
            run_start(self, args)

        def run_end_callbacks(self: Any, args: Any) -> None:
            try:
                run_end(self, args)
            finally:
                end()

        run_start_callbacks._accel_sim = True  # type: ignore[attr-defined]
        handler.run_start_callbacks = run_start_callbacks
        handler.run_end_callbacks = run_end_callbacks

    after_import("torch._dynamo.callback", register)


#: torch's FakeTensor class, imported at the first `is_fake` (the allocator asks for every new storage)
_fake_class: list[type] = []


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is one of Dynamo's fake tensors (only while it traces)."""
    if not _fake_class:
        from torch._subclasses.fake_tensor import FakeTensor

        _fake_class.append(FakeTensor)
    return isinstance(tensor, _fake_class[0])


INTERNALS["torch._dynamo.utils.run_node"] = (
    "a tensor a compiled function makes on a simulated GPU is a simulated one while Dynamo traces (x[i] needs it)"
)


def adopt_dynamos_values(adopt: Callable[[Any], Any]) -> None:
    """The fake value Dynamo computes for each op it traces (`torch._dynamo.utils.run_node`, private) is `adopt(value)`.

    A factory Dynamo traces (`torch.arange(n, device="cuda")`) gives a plain fake tensor whose
    C++ device is CUDA, where the run gives a simulated tensor, on the hidden device. Python
    indexing of it (`t[None]`, `t[i] = v`: `THPVariable_getitem`/`setitem`) opens the device
    guard of its C++ device first, which a CPU build lacks: "PyTorch is not linked with
    support for cuda devices" (flex attention's default block mask does, `create_block_mask`
    compiled too). Adopted as the op's value, the fake is a simulated tensor from the start.
    """

    def register(utils: Any) -> None:
        original = utils.run_node
        if getattr(original, "_accel_sim", False):
            return

        @functools.wraps(original)
        def run_node(tracer: Any, node: Any, args: Any, kwargs: Any, nnmodule: Any) -> Any:
            return adopt(original(tracer, node, args, kwargs, nnmodule))

        run_node._accel_sim = True  # type: ignore[attr-defined]
        utils.run_node = run_node  # get_fake_value looks it up there at each op

    after_import("torch._dynamo.utils", register)


# -- other libraries' tensor subclasses ----------------------------------------------------------


def build_wrapper_subclasses_on(hidden: str, shown: str) -> None:
    """Wrapper subclasses that libraries build for a `shown` device (cuda:k) sit on `hidden`:k instead.

    A library's own wrapper around a simulated tensor (torchao's float8 weights for FSDP's
    float8 all-gather, the functional collectives' `AsyncCollectiveTensor`) calls
    `torch.Tensor._make_wrapper_subclass(..., device=inner.device)` (private). The inner
    tensor shows `cuda:k`, and C++ would build a real CUDA tensor, which a CPU build of torch
    cannot run: the first op that opens a device guard on it (`new_tensor(..., device="cpu")`
    in `nn.init.trunc_normal_`) fails with "PyTorch is not linked with support for cuda
    devices". Built on `hidden`:k, the wrapper runs as the simulated tensors do and still
    shows `shown`:k (`show_hidden_as`). The simulator's own wrapper (`make_wrapper`) keeps
    torch's function, bound before this patch.
    """
    original = torch.Tensor._make_wrapper_subclass

    def make_wrapper_subclass(cls: type, size: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int):
            device = torch.device(device)
            if device.type == shown:
                kwargs["device"] = torch.device(hidden) if device.index is None else torch.device(hidden, device.index)
        return original(cls, size, *args, **kwargs)

    if getattr(original, "_accel_sim", False):
        return
    make_wrapper_subclass._accel_sim = True  # type: ignore[attr-defined]
    torch.Tensor._make_wrapper_subclass = staticmethod(make_wrapper_subclass)  # type: ignore[method-assign]  # simulated ranks only


# -- profilers with no tool attached ----------------------------------------------------------------

INTERNALS.update(
    {
        "torch.cuda.nvtx._nvtx": "NVTX ranges and marks answer as a CUDA build's do with no profiling tool attached",
        "torch.cuda._cudart": "torch.cuda.cudart() (torch.cuda.profiler.start/stop) answers as CUDA's runtime does",
        "torch.autograd._supported_activities": "torch.profiler lists CUDA among its activities, as a CUDA build does",
        "torch.autograd.profiler._supported_activities": "a profile asking for CUDA does not warn at every op",
        "torch.autograd.profiler.ProfilerState": (
            "the legacy CUDA profile (use_device='cuda') runs on Kineto: a CPU build cannot record CUDA events"
        ),
    }
)


def serve_nvtx(nvtx: Any) -> None:
    """`torch.cuda.nvtx` calls `nvtx` where a CUDA build calls NVTX's library (`torch.cuda.nvtx._nvtx`, private).

    A CPU build binds a stub that raises "NVTX functions not installed"; the functions of
    `torch.cuda.nvtx` look the object up at each call, so replacing it serves all of them.
    """
    import torch.cuda.nvtx

    torch.cuda.nvtx._nvtx = nvtx  # simulated ranks only


def serve_cudart(cudart: Any) -> None:
    """`torch.cuda.cudart()` returns `cudart` (`torch.cuda._cudart`, private; None in a CPU build).

    `torch.cuda.profiler.start()` / `stop()` and `torch.cuda.check_error` read it there.
    """
    torch.cuda._cudart = cudart  # simulated ranks only


def list_cuda_profiler_activity() -> None:
    """torch's profiler lists `ProfilerActivity.CUDA` as supported (`_supported_activities`, private, C++).

    A CPU build leaves it out, so a profile that asks for CUDA falls back to recording CUDA
    events around every op, which a CPU build cannot do: it warns at each op. Listed, CUDA
    goes to Kineto, which records the ops and has no GPU kernels to add. Patched both where
    `torch.profiler.supported_activities()` and `torch.autograd.profiler.profile` read it.
    """
    import torch.autograd.profiler as autograd_profiler

    original = torch.autograd._supported_activities
    if getattr(original, "_accel_sim", False):
        return

    def supported_activities() -> set[Any]:
        return original() | {torch.profiler.ProfilerActivity.CUDA}

    supported_activities._accel_sim = True  # type: ignore[attr-defined]
    torch.autograd._supported_activities = supported_activities  # simulated ranks only
    autograd_profiler._supported_activities = supported_activities


def run_flex_attention_on(cls: type, run: Callable[..., Any]) -> None:
    """Flex attention's operators (higher-order ops, private) on `cls` tensors are `run(op, *args, **kwargs)`.

    A compiled graph calls flex attention as a higher-order operator, which dispatches on
    tensor subclasses through a table of its own (`py_impl`) rather than `__torch_dispatch__`.
    """

    def register(module: Any) -> None:
        for op in (module.flex_attention, module.flex_attention_backward):
            if cls not in op.python_key_table:
                op.py_impl(cls)(functools.partial(run, op))

    after_import("torch._higher_order_ops.flex_attention", register)


INTERNALS["torch._higher_order_ops.flex_attention.create_fw_bw_graph"] = (
    "flex attention's score_mod is differentiated on host fakes: a fake CUDA tensor needing grad aborts a CPU build"
)


def trace_flex_attention_gradients_on_host(
    cls: type[torch.Tensor], host: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Flex attention differentiates `score_mod` on the host tensors `host(t)` under `cls` tensors (private).

    Flex attention with inputs that need gradients builds the joint graph of `score_mod`
    (`create_fw_bw_graph`) by tracing it with autograd on fresh fake tensors made on its
    example values' device (`torch.empty_strided(..., device=t.device)` in a `FakeTensorMode`),
    while Dynamo traces and again each time it runs. A `cls` tensor shows cuda:k, so the fake
    scores are CUDA tensors to C++ too, and autograd's first edge to one (its `AccumulateGrad`
    takes the device's stream) asks for CUDA's device guard, which a CPU build lacks: "PyTorch
    is not linked with support for cuda devices", an abort rather than an exception. Given the
    host tensors (needing gradients as the wrappers do), torch traces the same graph on CPU
    fakes; flex attention's backward runs it on host tensors anyway (`run_flex_attention_on`).
    """

    def on_host(value: Any) -> Any:
        if not isinstance(value, cls):
            return value
        return host(value).detach().requires_grad_(value.requires_grad)

    def register(module: Any) -> None:
        original = module.create_fw_bw_graph
        if getattr(original, "_accel_sim", False):
            return

        @functools.wraps(original)
        def create_fw_bw_graph(score_mod: Any, index_values: Any, other_buffers: Any) -> Any:
            values, buffers = tuple(map(on_host, index_values)), tuple(map(on_host, other_buffers))
            return original(score_mod, values, buffers)

        create_fw_bw_graph._accel_sim = True  # type: ignore[attr-defined]
        module.create_fw_bw_graph = create_fw_bw_graph  # its callers look it up there (Dynamo's at each call)

    after_import("torch._higher_order_ops.flex_attention", register)


# -- tensors that move keep their identity (accel.sim.core.moves) ------------------------------------


def use_count(tensor: torch.Tensor) -> int:
    """How many C++ references hold `tensor`'s TensorImpl (`Tensor._use_count`): 1 when only its Python object does.

    More means a view of it, an autograd graph that saved it, a hook on its gradient
    accumulator (FSDP's, DeepSpeed's) or its being some tensor's gradient.
    """
    return tensor._use_count()  # type: ignore[attr-defined]  # not in the stubs


def holders_before_a_swap(tensor: torch.Tensor) -> int:
    """`use_count(tensor)`, less a leaf's gradient accumulator, which then refuses backward (as torch's swap does).

    `torch.utils.swap_tensors` lets a leaf whose only other holder is its AccumulateGrad
    node be swapped, and poisons that node: a graph built before the swap cannot put its
    gradient into the tensor that is gone.
    """
    count = use_count(tensor)
    if count == 2 and tensor.is_leaf and tensor.requires_grad:
        node = torch.autograd.graph.get_gradient_edge(tensor).node
        if use_count(tensor) == 2:  # the node existed already: it is the other holder

            def refuse(grad_outputs: Any) -> Any:
                raise RuntimeError(
                    "backward reached the gradient accumulator of a tensor that has since moved onto a simulated "
                    "GPU (`tensor.data = x`); run forward again after the move"
                )

            node.register_prehook(refuse)
            return 1
    return count


def cpp_device(tensor: torch.Tensor) -> torch.device:
    """The device C++ sees `tensor` on (for a simulated one, the hidden device), whatever Python is shown."""
    return torch._C.TensorBase.device.__get__(tensor)


def swap_impls(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """Swap what two tensor objects are (class, attributes, C++ TensorImpl); each keeps its identity.

    `torch.utils.swap_tensors` without its checks: the caller has made sure that only the
    Python objects hold the TensorImpls (`use_count`). torch's function also refuses weakly
    referenced tensors, which a swap does not harm: a weak reference names the Python
    object, which stays the one it named, as a GPU tensor does after `t.data = x`.
    The gradient hooks C++ keeps on the TensorImpl are registered again (`rehook`).
    """
    import copyreg

    slots = set(copyreg._slotnames(type(t1)))  # type: ignore[attr-defined]  # stdlib, private
    if slots != set(copyreg._slotnames(type(t2))):  # type: ignore[attr-defined]
        raise RuntimeError("Cannot swap t1 and t2 if they have different slots")  # torch's words
    t1.__class__, t2.__class__ = type(t2), type(t1)
    dict1, dict2 = t1.__dict__, t2.__dict__
    t1.__dict__, t2.__dict__ = dict2, dict1
    for slot in slots:
        values = [getattr(t, slot, _NO_VALUE) for t in (t1, t2)]
        for tensor, value in zip((t1, t2), reversed(values), strict=True):
            if value is _NO_VALUE:
                if hasattr(tensor, slot):
                    delattr(tensor, slot)
            else:
                setattr(tensor, slot, value)
    torch._C._swap_tensor_impl(t1, t2)
    rehook(t1)
    rehook(t2)


_NO_VALUE = object()


def rehook(tensor: torch.Tensor) -> None:
    """Register `tensor`'s gradient hooks on its present TensorImpl (`register_hook`, post-accumulate-grad hooks).

    Python keeps them on the tensor object and C++ on the TensorImpl: once the TensorImpl
    is swapped they would no longer run. Setting the attribute registers them again.
    """
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(tensor, name, None)
        if hooks is not None:
            setattr(tensor, name, hooks)


def patch_shallow_copy_check(answer: Callable[[torch.Tensor, torch.Tensor], bool | None]) -> None:
    """`torch._has_compatible_shallow_copy_type(a, b)` answers `answer(a, b)`, torch's own answer where that is None.

    `nn.Module._apply` asks it whether a parameter may take a converted tensor's data in
    place (`param.data = new`); C++ answers no for a simulated GPU tensor and a CPU tensor,
    where for a GPU tensor and a CPU tensor it answers yes.
    """
    original = torch._has_compatible_shallow_copy_type

    def _has_compatible_shallow_copy_type(input: torch.Tensor, from_: torch.Tensor) -> bool:
        found = answer(input, from_)
        return original(input, from_) if found is None else found

    torch._has_compatible_shallow_copy_type = _has_compatible_shallow_copy_type


def convert_grads(convert: Callable[[torch.Tensor, Any], Any]) -> None:
    """`tensor.grad = g` assigns `convert(tensor, g)` (through the setter already in place: `check_grad_device`'s).

    C++ accepts only a gradient on the tensor's own C++ device: a tensor shown on the host
    whose TensorImpl is a simulated one's needs its CPU gradient seen the same way. Call it
    after `check_grad_device`, which replaces torch's own setter.
    """
    current: Any = torch.Tensor.__dict__.get("grad", torch._C.TensorBase.grad)
    put = current.__set__

    def grad_setter(self: torch.Tensor, new: Any) -> None:
        put(self, convert(self, new))

    torch.Tensor.grad = property(current.__get__, grad_setter, current.__delete__, doc=current.__doc__)  # type: ignore[assignment]  # simulated ranks only


def profile_legacy_cuda_through_kineto() -> None:
    """`torch.autograd.profiler.profile(use_device="cuda")` without Kineto records the ops through Kineto.

    Its legacy path (`ProfilerState.KINETO_GPU_FALLBACK`, private) times each op with CUDA
    events, which only a CUDA build's C++ can record: a CPU build warns at every op. Switched
    to Kineto with the CUDA activity, it records the ops as a profile asking for CUDA does.
    """
    import torch.autograd.profiler as autograd_profiler

    profile = autograd_profiler.profile
    init = profile.__init__
    if getattr(init, "_accel_sim", False):
        return
    states = autograd_profiler.ProfilerState

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.profiler_kind == states.KINETO_GPU_FALLBACK:
            self.profiler_kind = states.KINETO
            self.kineto_activities.add(torch.profiler.ProfilerActivity.CUDA)

    __init__._accel_sim = True  # type: ignore[attr-defined]
    profile.__init__ = __init__  # type: ignore[method-assign]  # simulated ranks only


# -- scaled_dot_product_attention's backend switches (accel.sim.cuda.attention.backends) ----------------

INTERNALS.update(
    {
        "torch._C._get_overrideable_sdp_enabled": "the fifth SDPA switch, which sdpa_kernel turns off with the others",
        "torch._C._get_sdp_priority_order": "the backend priority sdpa_kernel(set_priority=True) sets",
        "torch._C._set_sdp_priority_order": "cuDNN attention first on the cards where torch puts it first",
    }
)


def overrideable_sdp_enabled() -> bool:
    """The fifth SDPA switch (no public getter; `sdpa_kernel` turns it off with the other four)."""
    return bool(torch._C._get_overrideable_sdp_enabled())


def sdp_priority_order() -> list[int]:
    """The SDPA backends' priority order torch's C++ holds (what `sdpa_kernel(set_priority=True)` sets)."""
    return list(torch._C._get_sdp_priority_order())


def set_sdp_priority_order(order: list[int]) -> None:
    """Set the SDPA backends' priority order (no public setter outside `sdpa_kernel`'s context)."""
    torch._C._set_sdp_priority_order(list(order))


INTERNALS["torch._C._set_sdp_use_overrideable"] = "a test in a warm rank starts with the fifth SDPA switch on"


def restore_sdp_switches(order: list[int]) -> None:
    """Every SDPA backend switch on, as a fresh process has them, and the priority `order`.

    A warm simulated rank runs one test after another: what `sdpa_kernel` or
    `enable_*_sdp(False)` left behind must not reach the next test.
    """
    for enable in (
        torch.backends.cuda.enable_flash_sdp,
        torch.backends.cuda.enable_mem_efficient_sdp,
        torch.backends.cuda.enable_math_sdp,
        torch.backends.cuda.enable_cudnn_sdp,
    ):
        enable(True)
    torch._C._set_sdp_use_overrideable(True)
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
    set_sdp_priority_order(order)


INTERNALS["torch.jit._builtins._register_builtin"] = (
    "TorchScript compiles the simulator's torch.tensor/as_tensor as the aten ops they stand for"
)


def script_as_builtins(functions: dict[Any, str]) -> None:
    """TorchScript sees each of `functions` (replacements of torch's own) as the aten op it names.

    Scripted code (`torch.distributed.optim`'s `@torch.jit.script` optimizers) calls
    `torch.tensor`; TorchScript knows torch's function as a builtin, but would try to compile
    a Python replacement and fail at import (`NotSupportedError`).
    """
    from torch.jit import _builtins

    for function, op in functions.items():
        _builtins._register_builtin(function, op)


def is_op(target: Any) -> bool:
    """Whether an FX node's target is an ATen (or prims) op overload (`torch._ops.OpOverload`, private)."""
    return isinstance(target, torch._ops.OpOverload)


def op_schema(op: Any) -> Any:
    """An op overload's schema (`OpOverload._schema`, private): its qualified name, whether it mutates."""
    return op._schema


def aot_as_inductor(
    compiler: Callable[[Any, list], Any], before_partition: Callable[[Any], None] = lambda gm: None
) -> Callable[..., Any]:
    """A Dynamo backend tracing as Inductor does before it writes kernels, each graph then given to `compiler`.

    AOTAutograd (`aot_autograd`, private) traces forward and backward together with Inductor's
    decompositions (`select_decomp_table`) and splits them with Inductor's partitioner
    (`min_cut_rematerialization_partition` as `compile_fx` calls it), which chooses what the
    forward saves for backward. No public API gives that choice; `accel.sim.core.compiled_buffers`
    uses it to count compiled regions' memory as the card holds it. `before_partition(joint_graph_module)`
    may rewrite the joint graph first, as Inductor's own joint-graph passes do.
    """
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    return aot_autograd(
        fw_compiler=compiler,
        bw_compiler=compiler,
        inference_compiler=compiler,
        partition_fn=functools.partial(_partition_as_inductor, min_cut_rematerialization_partition, before_partition),
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )


def _partition_as_inductor(partition: Any, before: Callable[[Any], None], joint: Any, *args: Any, **kwargs: Any) -> Any:
    before(joint)
    return partition(joint, *args, compiler="inductor", **kwargs)


def compiling_for_ddps_buckets() -> bool:
    """Whether Dynamo's DDP optimizer (`torch._dynamo.backends.distributed.DDPOptimizer.compile_fn`, private)
    is the caller: it splits a DDP model's graph at its gradient buckets and runs each compiled piece on
    fake tensors while it compiles, which AOTAutograd's subclass wrappers around simulated tensors do not
    survive. No public API says so; the caller's frames do.
    """
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_fn" and code.co_filename.endswith(os.path.join("backends", "distributed.py")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


INTERNALS["torch.cuda._exchange_device"] = (
    "torch.cuda.device_of switches simulated GPUs (accel.sim.cuda.fake patches it)"
)
INTERNALS["torch.cuda._maybe_exchange_device"] = "and switches back at the block's end"
INTERNALS["torch._ops.OpOverload.redispatch"] = (
    "an op whose kernel is a composite with no device check runs that kernel on simulated tensors, as on a GPU"
)


def run_composite(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run `op`'s kernel for the hidden PrivateUse1 device, a composite one, on simulated tensors.

    The ops it calls dispatch one by one (to the simulator), as on a GPU, where the composite
    kernel checks no devices itself. Public torch offers no call of one dispatch key's kernel.
    """
    return op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1), *args, **kwargs)


INTERNALS["torch.cuda.memory._record_memory_history_impl"] = (
    "torch.cuda.memory._record_memory_history records the simulated allocators' actions (accel.sim.cuda.fake "
    "patches the three names torch's memory tracker calls)"
)
INTERNALS["torch.cuda.memory._record_memory_history_legacy"] = "and its older form, _record_memory_history(True)"
INTERNALS["torch.cuda.memory._snapshot"] = "and _snapshot / _dump_snapshot hand out the simulated allocators' state"
INTERNALS["torch.cuda.memory._set_memory_metadata"] = "and the text its entries carry (user_metadata)"
INTERNALS["torch.cuda.memory._get_memory_metadata"] = "and reading that text back"
INTERNALS["torch._utils._augment_memory_snapshot_stack_traces"] = (
    "_snapshot(augment_with_fx_traces=True) on simulated GPUs adds the FX nodes to the stacks as torch's does"
)


def augment_memory_snapshot(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A memory snapshot with FX debug fields added to its frames, as `_snapshot(augment_with_fx_traces=True)`."""
    from torch._utils import _augment_memory_snapshot_stack_traces

    return _augment_memory_snapshot_stack_traces(snapshot)  # type: ignore[arg-type,return-value]


INTERNALS["torch._C.Generator._cdata"] = (
    "torch.Generator(device='cuda') on simulated GPUs: ops receive a new Python object for a generator, and the "
    "simulated GPU it draws for is found by the C++ generator underneath"
)


def generator_key(generator: torch.Generator) -> int:
    """The identity of `generator`'s C++ generator, the same for every Python object of it."""
    return generator._cdata  # type: ignore[attr-defined]


INTERNALS["torch.UntypedStorage._cdata"] = (
    "a tensor's storage known whichever view or Python object of it comes (functional collectives' waits, "
    "the clock's fused kernels): `untyped_storage()` gives a new Python object each time"
)


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s C++ storage, the same for all its views and Python objects."""
    return tensor.untyped_storage()._cdata


#: the C++ functions `torch.nn.parallel.comm` calls (a CPU build has none): checked by
#: tests/test_sim_cuda_internals.py, which reads comm.py for each name
PARALLEL_COPY_NAMES = (
    "_broadcast", "_broadcast_out", "_broadcast_coalesced", "_scatter", "_scatter_out", "_gather", "_gather_out",
)  # fmt: skip


def serve_parallel_copies(functions: dict[str, Any]) -> None:
    """`torch.nn.parallel.comm` (DataParallel's broadcast, scatter, gather) calls `functions` instead of torch's
    CUDA library; its own argument checks stay. Private: these C++ entry points are all comm.py calls."""
    unknown = sorted(set(functions) - set(PARALLEL_COPY_NAMES))
    if unknown:
        raise ValueError(f"not entry points of torch.nn.parallel.comm: {unknown}")
    for name, function in functions.items():
        setattr(torch._C, name, function)


#: `torch._C`'s CUDA entry points that torch's Python calls directly, not through `torch.cuda`'s functions:
#: `torch.cuda._set_stream_by_id` and the test helper `CudaNonDefaultStream` (every CUDA device-type
#: test of PyTorch's suites) set streams and devices through them, `torch.cuda._sleep` keeps a stream busy,
#: the memory-leak check clears cuBLAS workspaces, `can_device_access_peer` asks about peer access,
#: `torch.cuda.graph` empties the pinned-memory cache. A CPU build lacks them, a CUDA build's ask the driver.
#: Checked by tests/test_sim_cuda_internals.py, which reads torch's sources for each name.
CUDA_ENTRY_POINTS = {
    "_cuda_setStream": "cuda/__init__.py",
    "_cuda_setDevice": "testing/_internal/common_utils.py",
    "_cuda_getDevice": "cuda/__init__.py",
    "_cuda_sleep": "cuda/__init__.py",
    "_cuda_canDeviceAccessPeer": "cuda/__init__.py",
    "_host_emptyCache": "cuda/graphs.py",
    "_cuda_clearCublasWorkspaces": "testing/_internal/common_utils.py",
}


def serve_cuda_entry_points(functions: dict[str, Any]) -> None:
    """`torch._C`'s CUDA entry points named in `CUDA_ENTRY_POINTS` call `functions` (simulated GPU ranks only)."""
    unknown = sorted(set(functions) - set(CUDA_ENTRY_POINTS))
    if unknown:
        raise ValueError(f"not CUDA entry points torch's Python calls: {unknown}")
    for name, function in functions.items():
        setattr(torch._C, name, function)
