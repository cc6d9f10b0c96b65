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
    assert torch.__version__.startswith(torch_internals.SUPPORTED_TORCH)


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

    from accel.sim.cuda import state as cuda_state
    from accel.sim.cuda import tensor as cuda_tensor

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
    checks["propagate_dtensor_meta_on + seed_dtensor_shards_from_cpu_generators"] = drawn
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
