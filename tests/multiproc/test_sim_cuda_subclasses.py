"""Other libraries' tensor subclasses around simulated CUDA tensors work as around GPU tensors.

A library's wrapper subclass (torchao's float8 weights, DTensor) meets plain tensors on a
GPU, which have no `__torch_dispatch__`: the library builds its wrapper with
`_make_wrapper_subclass(..., device=inner.device)` and its own dispatch runs first, sees only
its own types and unwraps itself. Simulated tensors are a subclass too: the wrapper must
still be built on a device that runs (not a real CUDA device of a CPU build of torch), and
the library's dispatch must still run first, whichever side of an op it is on.
"""

import pytest
import torch
import torch.utils._pytree as pytree

from harness import distributed_test


class Cast(torch.Tensor):
    """A weight wrapper as torchao's `WeightWithDynamicFloat8CastTensor` is: it unwraps itself for every op
    and keeps its type through the ops in `KEEP`; it counts the ops it saw."""

    KEEP = {torch.ops.aten.empty_like.default, torch.ops.aten.normal_.default, torch.ops.aten.copy_.default}
    seen: list = []

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), dtype=inner.dtype, device=inner.device
        )

    def __init__(self, inner):
        self._inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        cls.seen.append((func, tuple(t.__name__ for t in types)))
        args, kwargs = pytree.tree_map_only(Cast, lambda t: t._inner, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, Cast, out) if func in cls.KEEP else out

    __torch_function__ = torch._C._disabled_torch_function_impl


class Strict(Cast):
    """One that declines any op with a subclass it does not know among the arguments (torchao's
    `Float8TrainingTensor` does): a GPU's plain tensors never show in `types`."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if not all(issubclass(cls, t) for t in types):
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


@distributed_test(world_size=2, device="cuda")
def test_a_library_wrapper_around_a_simulated_tensor_is_a_cuda_tensor_that_runs(rank):
    weight = Cast(torch.zeros(64, 32, device="cuda"))
    assert weight.device == torch.device("cuda", rank) and weight.is_cuda
    assert weight.new_tensor(2.0, device="cpu").item() == 2.0  # C++ opens a device guard for it
    torch.nn.init.trunc_normal_(weight, std=0.02, a=-0.04, b=0.04)  # as torchtitan initialises its weights
    inner = weight._inner
    assert type(inner).__name__ == "SimCudaTensor" and inner.device == torch.device("cuda", rank)
    assert 0 < inner.abs().max().item() <= 0.04 and inner.std().item() == pytest.approx(0.02, rel=0.5)
    assert "simcuda" not in repr(weight.device) + str(inner)


@distributed_test(world_size=2, device="cuda")
def test_the_library_dispatch_runs_first_whichever_side_the_simulated_tensor_is_on(rank):
    Cast.seen.clear()
    weight = Cast(torch.arange(6.0, device="cuda"))
    mask = torch.tensor([True, False, True, False, True, False], device="cuda")
    chosen = torch.where(mask, weight, torch.zeros(6, device="cuda"))  # the simulated tensor first
    assert type(chosen).__name__ == "SimCudaTensor" and chosen.device == torch.device("cuda", rank)
    assert chosen.tolist() == [0.0, 0.0, 2.0, 0.0, 4.0, 0.0]
    assert (torch.ones(6, device="cuda") + weight).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert (weight * torch.tensor(2.0, device="cuda")).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    ops = [torch.ops.aten.where.self, torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor]
    assert [func for func, _ in Cast.seen] == ops
    # where torch tries the simulated tensor first, the library's dispatch runs before it, seeing its own type
    # only, as on a GPU (where torch tries the library's first, it sees both: torch's order, not the simulator's)
    assert [types for _, types in Cast.seen[:2]] == [("Cast",)] * 2

    # one that declines unknown types gets the op again, shown its own type only, whichever side it is on
    Cast.seen.clear()
    strict = Strict(torch.arange(3.0, device="cuda"))
    for out in (torch.ones(3, device="cuda") + strict, strict + torch.ones(3, device="cuda")):
        assert type(out).__name__ == "SimCudaTensor" and out.tolist() == [1.0, 2.0, 3.0]
    assert Cast.seen == [(torch.ops.aten.add.Tensor, ("Strict",))] * 2


@distributed_test(world_size=2, device="cuda")
def test_dtensor_with_simulated_tensors_on_either_side(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    whole = torch.arange(8.0, device="cuda")
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    two = torch.tensor(2.0, device="cuda")
    shard = whole.chunk(world_size)[rank]
    # a 0-dim tensor is replicated implicitly, on either side of the op (torch.where's condition too)
    for out, expected in (
        (sharded * two, shard * 2),
        (two * sharded, shard * 2),
        (torch.where(two > 1, sharded, sharded), shard),
    ):
        assert isinstance(out, DTensor) and out.placements == (Shard(0),)
        assert out.to_local().device == torch.device("cuda", rank)
        assert out.to_local().tolist() == expected.tolist()
    # any other plain tensor is DTensor's error, on either side
    for mixed in (lambda: sharded + torch.ones(8, device="cuda"), lambda: torch.ones(8, device="cuda") + sharded):
        with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
            mixed()


# -- under torch.compile --------------------------------------------------------------------------------
# (found by torchtitan's loss parallelism under `--compile.enable`)


@distributed_test(world_size=1, device="cuda")
def test_a_compiled_masked_assignment_takes_the_value_cpp_makes_on_the_tensors_device():
    """`y[mask] = 0`: C++ makes the value on `y`'s own device, under Dynamo's fake mode a fake of the hidden one."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def f(x):
        y = x.clone()
        y[y > 0] = 0
        return y * 2

    x = torch.tensor([-1.0, 2.0, -3.0, 4.0], device="cuda")
    out = torch.compile(f, fullgraph=True)(x)
    assert out.device == torch.device("cuda", 0) and out.tolist() == [-2.0, 0.0, -6.0, 0.0] == f(x).tolist()
    assert counters["stats"]["unique_graphs"] == 1


@distributed_test(world_size=2, device="cuda")
def test_dtensor_loss_parallel_cross_entropy_under_compile(rank, world_size):
    """Cross-entropy over class-sharded logits (`loss_parallel`), compiled, gives the eager loss."""
    import torch._dynamo
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    torch._dynamo.reset()
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world_size,))
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(8, 16, generator=generator).cuda()
    labels = torch.randint(0, 16, (8,), generator=generator).cuda()
    logits = distribute_tensor(whole, mesh, [Shard(1)])

    def loss(p, target):
        return F.cross_entropy(p, target, reduction="sum")

    with loss_parallel():
        eager = loss(logits, labels)
        compiled = torch.compile(loss, fullgraph=True)(logits, labels)
    assert compiled.placements == eager.placements == (Replicate(),)
    expected = F.cross_entropy(whole, labels, reduction="sum")
    assert compiled.to_local().item() == pytest.approx(expected.item(), rel=1e-6)
    assert eager.to_local().item() == pytest.approx(expected.item(), rel=1e-6)
