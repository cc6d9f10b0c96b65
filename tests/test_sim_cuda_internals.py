"""The private torch APIs simulated GPUs rely on (accel/sim/core/torch_internals.py): one check each.

When a torch upgrade breaks one, the failing test names it and says what it was for.
Presence is checked here, in the test process (nothing is installed); what each one
does is checked in simulated GPU ranks, where they are in use.
"""

import os

import pytest
import torch

from accel.sim.core import torch_internals
from accel.sim.cuda import fake as fake_cuda
from harness import distributed_test


@pytest.mark.parametrize("name", sorted(torch_internals.INTERNALS))
def test_each_internal_is_still_there(name):
    if not torch_internals.expected(name):
        pytest.skip(f"torch {torch.__version__} predates {name} (from {torch_internals.INTERNALS_SINCE[name]} on)")
    assert torch_internals._has_dotted(name), (
        f"torch {torch.__version__} no longer has {name}, which simulated GPUs need for: "
        f"{torch_internals.INTERNALS[name]}. Adapt accel/sim/core/torch_internals.py (supported: "
        f"{', '.join(torch_internals.SUPPORTED_TORCH)})."
    )


def test_cuda_autocast_policy_and_op_declarations_are_readable():
    assert os.path.exists(torch_internals.autocast_header()), "torch no longer ships ATen/autocast_mode.h"
    lists = torch_internals.autocast_op_lists()
    assert {"lower", "fp32", "fp32_opt", "promote"} == set(lists) and all(lists.values())
    assert ("mm", "default") in lists["lower"] and ("mse_loss", "default") in lists["fp32"]
    path = torch_internals.native_functions_yaml()
    assert path is not None, "torch's torchgen package no longer ships native_functions.yaml"
    with open(path) as declarations:
        text = declarations.read()
    assert "\n- func: addmm(" in text and "device_check: NoCheck" in text
    names = set(torch_internals.factory_op_names())
    assert {"zeros", "empty.memory_format", "arange.start", "randn"} <= names


def test_the_hooks_vtable_order_is_readable():
    order = torch_internals.hook_vtable_order()
    # the two slots serve_pinned_memory replaces, where the Itanium ABI puts them for torch 2.13's headers
    assert order.index("isPinnedPtr") == 11 and order.index("getPinnedMemoryAllocator") == 12, order
    assert order[:2] == ["~AcceleratorHooksInterface"] * 2 and len(order) == 17


def test_this_torch_is_supported():
    torch_internals.check_supported()
    assert torch_internals.release() in torch_internals.SUPPORTED_TORCH
    assert torch.__version__.startswith(tuple(f"{supported}." for supported in torch_internals.SUPPORTED_TORCH))


def test_releases_are_read_from_cpu_cuda_and_development_versions():
    assert torch_internals.release("2.14.1+cu130") == "2.14" and torch_internals.release("2.13.0+cpu") == "2.13"
    assert torch_internals.release("2.16.0.dev20261101") == "2.16" and torch_internals.release("3.0.0a0+git1") == "3.0"
    assert torch_internals.at_least("2.14", "2.14.0") and torch_internals.at_least("2.14", "2.15.0+cu128")
    assert not torch_internals.at_least("2.14", "2.13.0") and torch_internals.at_least("2.9", "2.13.0")
    with pytest.raises(torch_internals.UnsupportedTorchError, match="cannot read a torch release"):
        torch_internals.release("nightly")


@pytest.mark.parametrize("version", ["2.12.1", "2.16.0", "2.16.0.dev20261101+cu130", "3.0.0"])
def test_a_torch_outside_the_supported_range_is_refused_naming_the_supported_ones(version):
    with pytest.raises(torch_internals.UnsupportedTorchError) as info:
        torch_internals.check_supported(version)
    message = str(info.value)
    assert f"do not support torch {version};" in message
    assert "supported torch versions: 2.13, 2.14, 2.15" in message and "'torch>=2.13,<2.16'" in message


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.14.1+cu130", "2.15.0", "2.15.0+cu128"])
def test_every_supported_release_passes_the_version_check(version):
    torch_internals.check_supported(version)  # CPU and CUDA builds alike (the internals are this torch's)


def test_a_simulated_gpu_refuses_a_torch_outside_the_range_at_start(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    with pytest.raises(torch_internals.UnsupportedTorchError, match=r"torch 2\.16\.0; supported torch versions: "):
        fake_cuda.install(local_rank=0, device_count=1)
    assert not fake_cuda.is_installed()


def test_the_project_asks_for_the_supported_range_of_torch():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    from packaging.requirements import Requirement

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "pyproject.toml"), "rb") as file:
        dependencies = tomllib.load(file)["project"]["dependencies"]
    (torch_requirement,) = [Requirement(d) for d in dependencies if Requirement(d).name == "torch"]
    allowed = torch_requirement.specifier
    for supported in torch_internals.SUPPORTED_TORCH:
        assert allowed.contains(f"{supported}.0") and allowed.contains(f"{supported}.9"), (supported, str(allowed))
    first, last = torch_internals.SUPPORTED_TORCH[0], torch_internals.SUPPORTED_TORCH[-1]
    major, minor = first.split(".")
    assert not allowed.contains(f"{major}.{int(minor) - 1}.9"), str(allowed)
    major, minor = last.split(".")
    assert not allowed.contains(f"{major}.{int(minor) + 1}.0"), str(allowed)


@pytest.mark.parametrize("change", torch_internals.TORCH_CHANGES, ids=lambda change: change.test.rsplit("::")[-1])
def test_each_difference_between_torch_versions_names_a_test_that_checks_it(change):
    assert change.since in torch_internals.SUPPORTED_TORCH[1:], change.since  # a change after the oldest supported
    path, name = change.test.split("::")
    with open(os.path.join(os.path.dirname(__file__), os.pardir, path)) as file:
        assert f"\ndef {name}(" in file.read(), change.test


def test_an_unsupported_torch_fails_at_start_naming_the_supported_versions(monkeypatch):
    monkeypatch.setattr(torch_internals, "missing_internals", lambda: ["torch._C._acc.DeviceGuard"])
    with pytest.raises(torch_internals.UnsupportedTorchError) as info:
        fake_cuda.install(local_rank=0, device_count=1)
    message = str(info.value)
    assert "torch._C._acc.DeviceGuard" in message and torch.__version__ in message
    assert f"supported torch versions: {', '.join(torch_internals.SUPPORTED_TORCH)}" in message
    assert not fake_cuda.is_installed()


@distributed_test(world_size=2, device="cuda")
def test_each_internal_does_its_job_in_a_rank(rank, tmp_path):
    import io

    from accel.sim.cuda.gpus import state as cuda_state
    from accel.sim.cuda.tensors import cuda_tensor

    checks = {}
    checks["register_python_backend"] = torch_internals.privateuse1_name() == cuda_state.HIDDEN_DEVICE
    x = cuda_tensor.wrap(torch.arange(4.0), rank)  # make_wrapper
    checks["make_wrapper"] = x.device == torch.device("cuda", rank) and x.shape == (4,)
    checks["tensor_text"] = repr(x) == f"tensor([0., 1., 2., 3.], device='cuda:{rank}')"
    y = torch.zeros(2, device="cuda")
    y.resize_(5)  # sync_metadata: the wrapper follows its resized inner tensor
    checks["sync_metadata"] = y.shape == (5,) and cuda_tensor.unwrap(y).shape == (5,)
    checks["parse_to"] = torch_internals.parse_to("cuda:0", torch.float16)[:2] == (
        torch.device("cuda", 0),
        torch.float16,
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):  # autocast_key_guard
        checks["autocast_key_guard"] = (x[None] @ x[:, None]).dtype == torch.bfloat16
    buffer = io.BytesIO()
    torch.save(x, buffer)  # reduce_as_tensor_on
    buffer.seek(0)
    loaded = torch.load(buffer)  # patch_rebuild_tensor
    checks["reduce_as_tensor_on + patch_rebuild_tensor"] = loaded.device == x.device and loaded.tolist() == x.tolist()
    import torch.optim.optimizer as optimizer_module

    checks["allow_foreach"] = type(x) in optimizer_module._foreach_supported_types
    work = torch_internals.completed_work([x])
    checks["completed_work"] = work.is_completed() and work.get_future().value()[0] is x
    checks["patch_accelerator"] = torch._C._get_accelerator() == torch.device("cuda") and (
        torch.accelerator.current_device_index() == torch.cuda.current_device()
    )
    checks["show_storage_on"] = x.untyped_storage().device == x.device and x.untyped_storage().nbytes() == 16
    p = torch.nn.Parameter(torch.zeros(2))
    p.data = x[:2]  # patch_data_setter
    checks["patch_data_setter"] = p.device == x.device and isinstance(p, torch.nn.Parameter)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    d = DTensor.from_local(x, init_device_mesh("cuda", (2,)), [Replicate()])  # show_hidden_as
    checks["show_hidden_as"] = d.device == x.device and d.is_cuda
    import torch.distributed as dist

    checks["resolve_group"] = torch_internals.resolve_group(dist.group.WORLD.group_name) is dist.group.WORLD
    pinned = torch.empty(2, pin_memory=True)  # serve_pinned_memory: C++ gets an allocator, and is told it is pinned
    checks["serve_pinned_memory"] = torch._C.TensorBase.is_pinned(pinned) and pinned.device.type == "cpu"
    checks["is_composite"] = torch_internals.is_composite(torch.ops.aten.to.device) and not (
        torch_internals.is_composite(torch.ops.aten.add.Tensor)
    )
    checks["group_device_types"] = {d.type for d in torch_internals.group_device_types(None)} == {"cuda"}
    checks["object_collective_device"] = torch_internals.object_collective_device(None) == "cuda"  # NCCL: the GPU
    checks["silence_ddp_time_stats"] = dist.Logger.set_runtime_stats_and_log(None) is None
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    sharded = distribute_tensor(torch.zeros(4, 2, device="cuda"), init_device_mesh("cuda", (2,)), [Shard(0)])
    sharded.uniform_()  # its fake kernel calls Tensor.copy_, which opens a device guard; each shard draws its own
    whole = sharded.full_tensor()
    drawn = not torch.equal(whole[:2], whole[2:])
    checks["propagate_dtensor_meta_on"] = drawn  # and torch's own RNG tracker, on the generators' Philox state
    import torch.distributed.fsdp._init_utils as fsdp_init

    checks["show_fsdp1_devices_as"] = fsdp_init._get_device_from_device_id(rank, rank, torch.cuda) == torch.device(
        "cuda", rank
    )
    inside: list[bool] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            inside.append(torch_internals.in_backward())
            return grad

    Probe.apply(torch.ones(2, device="cuda", requires_grad=True)).sum().backward()
    checks["in_backward"] = inside == [True] and not torch_internals.in_backward()
    broken = [name for name, ok in checks.items() if not ok]
    assert not broken, f"torch {torch.__version__}: these internals no longer do their job: {broken}"


@distributed_test(world_size=2, device="cuda")
def test_the_simulators_python_groups_get_no_flight_recorder(rank):
    # torch 2.15 attaches a C++ flight recorder to each new group, which reads its C++ name: a Python
    # group has none ("ProcessGroup name not set" at init_process_group) (torch_internals.TORCH_CHANGES)
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from accel.sim.core.carried import PythonGroup

    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    groups = [dist.group.WORLD, dist.new_group(backend="nccl"), dist.new_group(backend="cpu:gloo,cuda:nccl")]
    assert all(isinstance(group, PythonGroup) for group in groups)
    recorded = getattr(distributed_c10d._world, "pg_flight_recorder_hooks", {})
    assert not [group for group in recorded if isinstance(group, PythonGroup)]
    attach = getattr(distributed_c10d, "_maybe_attach_flight_recorder", None)
    assert (attach is not None) == torch_internals.at_least("2.15")
    assert attach is None or attach._accel_sim
    gloo = dist.new_group(backend="gloo")  # torch's own groups are recorded as torch records them
    for group in (*groups, gloo):
        t = torch.ones(1, device="cuda" if group is not gloo else "cpu")
        dist.all_reduce(t, group=group)
        assert t.item() == 2


def test_data_parallel_copies_still_go_through_the_c_entry_points_simulated_gpus_serve():
    import inspect

    import torch.nn.parallel.comm

    source = inspect.getsource(torch.nn.parallel.comm)
    for name in torch_internals.PARALLEL_COPY_NAMES:
        assert f"torch._C.{name}(" in source, (
            f"torch {torch.__version__}'s torch.nn.parallel.comm no longer calls torch._C.{name}, which simulated "
            "GPUs serve for nn.DataParallel (accel/sim/cuda/nccl/parallel_copies.py): adapt torch_internals"
        )
    assert "nccl.is_available(" in source  # replaced by False in simulated ranks: copies, not NCCL


def test_torchs_python_still_calls_the_cuda_entry_points_simulated_gpus_serve():
    import pathlib

    root = pathlib.Path(torch.__file__).parent
    for name, where in torch_internals.CUDA_ENTRY_POINTS.items():
        assert f"torch._C.{name}(" in (root / where).read_text(), (
            f"torch {torch.__version__}'s {where} no longer calls torch._C.{name}, which simulated GPUs serve "
            "(accel/sim/cuda/torch_cuda/entry_points.py): adapt torch_internals.CUDA_ENTRY_POINTS"
        )
    with pytest.raises(ValueError, match="_cuda_unknown"):
        torch_internals.serve_cuda_entry_points({"_cuda_unknown": print})


def test_a_python_custom_ops_functions_are_found_by_device():
    name = "accel_internals_test::twice"
    if torch_internals.python_custom_op_kernel(torch.ops.aten.add.Tensor, "cuda") is not None:
        raise AssertionError("an aten op was taken for an op written in Python")

    @torch.library.custom_op(name, mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_kernel("cuda")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    op = torch.ops.accel_internals_test.twice.default
    assert torch_internals.python_custom_op_kernel(op, "cuda")(torch.ones(1)).item() == 3.0, (
        "torch no longer keeps custom ops' kernels in torch._library.custom_ops.OPDEFS[...]._backend_fns: adapt "
        "torch_internals.python_custom_op_kernel"
    )
    assert torch_internals.python_custom_op_kernel(op, "xla")(torch.ones(1)).item() == 2.0
