"""Parameters keep their identity when they move between the host and simulated GPUs, as on a GPU.

`Module.to` / `cuda` / `cpu` / `half` and `param.data = x` change what a parameter holds,
not which object it is: weak references (DeepSpeed's), an optimizer's state keyed by it,
its gradient hooks, views and FSDP1's flat parameters (held by C++) all still hold it. A
no-op move changes nothing. Where a GPU refuses, the simulated GPU refuses with torch's
words. Each test runs on 2 and 4 simulated GPU ranks; rank k's current GPU is cuda:k.
"""

import copy
import io
import weakref

import pytest
import torch
from torch import nn

from harness import distributed_test

SIZES = [2, 4]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batches(steps: int, rank: int = 0) -> list:
    """`steps` (inputs, targets) CPU batches, the same on every rank unless `rank` differs."""
    generator = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)) for _ in range(steps)]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list, device) -> list[float]:
    """One step per batch, each batch moved to `device`; the losses."""
    losses = []
    for inputs, targets in data:
        loss = nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def same_objects(refs: list, model: nn.Module) -> bool:
    return all(ref() is param for ref, param in zip(refs, model.parameters(), strict=True))


@distributed_test(world_size=SIZES, device="cuda")
def test_weakly_referenced_parameters_stay_the_same_objects_through_every_move(rank):
    from torch.utils.weak import WeakIdKeyDictionary

    gpu = torch.device("cuda", rank)
    torch.cuda.set_device(rank)
    model = make_model()
    params = list(model.parameters())
    refs = [weakref.ref(p) for p in params]
    names = WeakIdKeyDictionary({p: name for name, p in model.named_parameters()})  # keyed by identity
    params[0].tag = "mine"
    del params
    for move, device, dtype in [
        (lambda m: m.to("cuda"), gpu, torch.float32),
        (lambda m: m.half(), gpu, torch.float16),
        (lambda m: m.float(), gpu, torch.float32),
        (lambda m: m.to("cpu"), torch.device("cpu"), torch.float32),
        (lambda m: m.cuda(), gpu, torch.float32),
        (lambda m: m.to(torch.float64).cpu(), torch.device("cpu"), torch.float64),
        (lambda m: m.to(gpu, torch.float32), gpu, torch.float32),
    ]:
        assert move(model) is model
        assert same_objects(refs, model)
        assert all(p.device == device and p.dtype == dtype and p.requires_grad for p in model.parameters())
        assert all(isinstance(p, nn.Parameter) for p in model.parameters())
        assert [names[p] for p in model.parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert model[0].weight.tag == "mine"
    del model
    assert all(ref() is None for ref in refs)  # nothing leaked: the weak references die with the model


@distributed_test(world_size=SIZES, device="cuda")
def test_a_no_op_move_changes_nothing(rank):
    torch.cuda.set_device(rank)
    model = make_model().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, optimizer, batches(1), "cuda")
    out = model(torch.ones(3, 4, device="cuda")).sum()  # a live autograd graph holds the parameters
    for p in model.parameters():
        p.grad = torch.ones_like(p)

    def snapshot():  # each parameter, its data, gradient and version: all must stay as they are
        return [(p, p.data_ptr(), p.grad, p.grad.data_ptr(), p._version, p.dtype) for p in model.parameters()]

    before = snapshot()
    refs = [weakref.ref(p) for p in model.parameters()]
    state = {p: dict(s) for p, s in optimizer.state.items()}
    for move in (
        lambda m: m.to("cuda"),
        lambda m: m.cuda(),
        lambda m: m.cuda(rank),
        lambda m: m.to(f"cuda:{rank}"),
        lambda m: m.to(torch.float32),
        lambda m: m.float(),
        lambda m: m.to(torch.device("cuda", rank), torch.float32),
    ):
        move(model)
        after = snapshot()
        for now, then in zip(after, before, strict=True):
            assert now[0] is then[0] and now[2] is then[2] and now[1:2] + now[3:] == then[1:2] + then[3:]
        assert same_objects(refs, model)
    assert optimizer.state.keys() == state.keys()
    out.backward()  # the graph was not poisoned: gradients accumulate onto the ones set
    for p, then in zip(model.parameters(), before, strict=True):
        assert p.grad is then[2] and p.grad.device.type == "cuda"
    assert torch.equal(model[2].bias.grad.cpu(), torch.full((2,), 1.0 + 3))


@distributed_test(world_size=SIZES, device="cuda")
def test_optimizer_state_and_training_go_on_across_moves(rank):
    torch.cuda.set_device(rank)
    data = batches(6, rank)
    reference = make_model()
    expected = train(reference, torch.optim.Adam(reference.parameters(), lr=0.05), data, "cpu")
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)  # made on the host, before the move
    losses = train(model, optimizer, data[:2], "cpu")
    model.cuda()
    assert set(optimizer.state) == set(model.parameters())  # keyed by the very parameter objects
    optimizer.load_state_dict(optimizer.state_dict())  # torch's way of moving the state along
    assert all(s["exp_avg"].device == torch.device("cuda", rank) for s in optimizer.state.values())
    losses += train(model, optimizer, data[2:4], "cuda")
    model.cpu()
    optimizer.load_state_dict(optimizer.state_dict())
    losses += train(model, optimizer, data[4:], "cpu")
    assert set(optimizer.state) == set(model.parameters())
    assert losses == pytest.approx(expected, rel=1e-5)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach(), theirs.detach())


@distributed_test(world_size=SIZES, device="cuda")
def test_gradients_and_hooks_move_with_the_parameters(rank):
    torch.cuda.set_device(rank)
    model = make_model()
    weight = model[0].weight
    seen = []
    weight.register_hook(lambda grad: seen.append(("grad", grad.device.type)))
    weight.register_post_accumulate_grad_hook(lambda p: seen.append(("accumulated", p.grad.device.type)))
    model(torch.ones(1, 4)).sum().backward()
    grad = weight.grad.clone()
    model.cuda()
    assert weight.grad.device == torch.device("cuda", rank) and torch.equal(weight.grad.cpu(), grad)
    model(torch.ones(1, 4, device="cuda")).sum().backward()
    assert seen == [("grad", "cpu"), ("accumulated", "cpu"), ("grad", "cuda"), ("accumulated", "cuda")]
    model.half()
    assert weight.grad.dtype == torch.float16 and weight.dtype == torch.float16
    model.float().cpu()
    assert weight.grad.device.type == "cpu" and weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, 2 * grad, rtol=1e-3, atol=1e-3)  # it went through float16


@distributed_test(world_size=SIZES, device="cuda")
def test_deepspeeds_pattern_weak_references_then_module_to(rank):
    """DeepSpeed's engine keeps a weak reference to every parameter, then calls `module.to(device)`."""
    from torch.utils.weak import WeakIdKeyDictionary

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    model = make_model()
    ids = WeakIdKeyDictionary({p: i for i, p in enumerate(model.parameters())})
    refs = [weakref.ref(p) for p in model.parameters()]
    model.to(device)
    model.to(device)  # again: a no-op
    assert same_objects(refs, model) and [ids[p] for p in model.parameters()] == [0, 1, 2, 3]
    assert all(p.device == device for p in model.parameters())
    for p in model.parameters():  # and DeepSpeed's `param.data = ...` ways of moving and sharding
        p.data = p.data.to("cpu")
        p.data = p.data.to(device)
    assert same_objects(refs, model) and all(p.device == device for p in model.parameters())


@pytest.mark.frameworks
@distributed_test(world_size=SIZES, device="cuda", timeout=240)
def test_deepspeed_zero1_initializes_and_trains_as_on_the_host(rank, world_size):
    deepspeed = pytest.importorskip("deepspeed")
    torch.cuda.set_device(rank)
    data = batches(3)  # the same batch on every rank: the averaged gradient is that batch's
    reference = make_model()
    expected = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data, "cpu")
    model = make_model()
    refs = [weakref.ref(p) for p in model.parameters()]
    config = {
        "train_batch_size": 6 * world_size,
        "train_micro_batch_size_per_gpu": 6,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # this DeepSpeed clips to 1.0 by default; the reference does not clip
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    assert same_objects(refs, model) and all(p.device == torch.device("cuda", rank) for p in model.parameters())
    losses = []
    for inputs, targets in data:
        loss = nn.functional.mse_loss(engine(inputs.to(engine.device)), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)


@distributed_test(world_size=SIZES, device="cuda")
def test_parameters_held_by_cpp_move_to_the_host_and_back(rank):
    """Views keep a parameter's TensorImpl in C++: it moves anyway, as on a GPU, and computes as a CPU tensor."""
    torch.cuda.set_device(rank)
    data = batches(4, rank)
    reference = make_model()
    expected = train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), data, "cpu")
    model = make_model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    views = [p.view(-1) for p in model.parameters()]  # C++ holders
    losses = train(model, optimizer, data[:2], "cuda")
    refs = [weakref.ref(p) for p in model.parameters()]
    model.cpu()
    optimizer.load_state_dict(optimizer.state_dict())
    weight = model[0].weight
    assert same_objects(refs, model) and weight.device.type == "cpu" and weight.is_cpu and not weight.is_cuda
    assert weight.get_device() == -1 and weight.type() == "torch.FloatTensor" and weight.cpu() is weight
    assert views[0].device.type == "cuda"  # a view keeps the storage it had, as on a GPU
    assert repr(model[2].bias).startswith("Parameter containing:\ntensor([") and "device" not in repr(weight)
    assert type(copy.deepcopy(weight)) is nn.Parameter and type(weight.detach() + 1) is torch.Tensor
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in torch.load(buffer).values())
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        weight + torch.ones(8, 4, device="cuda")
    losses += train(model, optimizer, data[2:3], "cpu")
    model.cuda()
    optimizer.load_state_dict(optimizer.state_dict())
    assert same_objects(refs, model) and all(p.device == torch.device("cuda", rank) for p in model.parameters())
    losses += train(model, optimizer, data[3:], "cuda")
    assert losses == pytest.approx(expected, rel=1e-5)


def fsdp1(model: nn.Module, rank: int, **kwargs) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, device_id=rank, **kwargs)


def fsdp1_train(model: nn.Module, optimizer, data: list) -> list[float]:
    return train(model, optimizer, data, "cuda")


@distributed_test(world_size=SIZES, device="cuda")
def test_fsdp1_full_state_dict_offloaded_to_the_host_then_training_goes_on(rank):
    """Lightning's FSDP checkpoints: `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`.

    FSDP1 moves its unsharded flat parameter, which its views and hooks hold, to the host
    (`flat_param.data = flat_param.to("cpu")`) and back; training then goes on as without the save.
    """
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.cuda.set_device(rank)
    data = batches(4, rank)
    plain = fsdp1(make_model(), rank)
    expected = fsdp1_train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), data)
    model = fsdp1(make_model(), rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = fsdp1_train(model, optimizer, data[:2])
    flat = model._handle.flat_param
    with FSDP.summon_full_params(model):
        weights = {name: p.detach().cpu() for name, p in model.module.named_parameters()}
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    assert model._handle.flat_param is flat and flat.device == torch.device("cuda", rank)
    if rank == 0:
        assert state.keys() == weights.keys()
        assert all(t.device.type == "cpu" and torch.equal(t, weights[name]) for name, t in state.items())
    else:
        assert state == {}
    losses += fsdp1_train(model, optimizer, data[2:])
    assert losses == expected


@distributed_test(world_size=SIZES, device="cuda")
def test_fsdp1_offloading_parameters_to_the_host_trains_as_without(rank):
    from torch.distributed.fsdp import CPUOffload

    torch.cuda.set_device(rank)
    data = batches(3, rank)
    plain = fsdp1(make_model(), rank)
    expected = fsdp1_train(plain, torch.optim.SGD(plain.parameters(), lr=0.1), data)
    model = fsdp1(make_model(), rank, cpu_offload=CPUOffload(offload_params=True))
    assert all(p.device.type == "cpu" for p in model.parameters())
    losses = fsdp1_train(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    assert losses == pytest.approx(expected, rel=1e-5)
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())


@distributed_test(world_size=SIZES, device="cuda")
def test_what_a_gpu_refuses_is_refused_in_its_words(rank):
    torch.cuda.set_device(rank)
    not_float = "data set to a tensor that requires gradients must be floating point or complex dtype"
    for param, new in [
        (nn.Parameter(torch.zeros(2)), torch.ones(2, dtype=torch.int64, device="cuda")),
        (nn.Parameter(torch.zeros(2, device="cuda")), torch.ones(2, dtype=torch.int64)),
        (nn.Parameter(torch.zeros(2, device="cuda")), torch.ones(2, dtype=torch.int64, device="cuda")),
    ]:
        with pytest.raises(RuntimeError, match=not_float):
            param.data = new
    with pytest.raises(RuntimeError, match="`variable` and `tensor` have incompatible tensor type"):
        nn.Parameter(torch.zeros(2, device="cuda")).data = torch.zeros(2, device="meta")
    # user code calling torch's swap itself: a GPU refuses weakly referenced tensors too
    held, other = torch.zeros(2, device="cuda"), torch.ones(2, device="cuda")
    keep = weakref.ref(held)
    with pytest.raises(RuntimeError, match="Cannot swap t1 because it has weakref associated with it"):
        torch.utils.swap_tensors(held, other)
    # with torch's future flag, Module.to swaps on a GPU as well, and refuses weak references
    model = make_model()
    keep = weakref.ref(model[0].weight)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="Couldn't swap Linear.weight"):
            model.cuda()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert keep() is model[0].weight


@distributed_test(world_size=SIZES, device="cuda")
def test_a_host_tensor_held_in_cpp_cannot_become_a_simulated_gpus(rank):
    """The simulator's one limit: a CPU TensorImpl cannot become a simulated GPU's in place (the message says so)."""
    torch.cuda.set_device(rank)
    model = make_model()
    view = model[0].weight[0]  # holds the CPU TensorImpl
    with pytest.raises(RuntimeError, match="Couldn't swap Linear.weight") as info:
        model.cuda()
    assert "cannot move a tensor between cpu and cuda" in str(info.value.__cause__)
    assert "while something else holds it" in str(info.value.__cause__)
    del view
    model.cuda()
    assert model[0].weight.device == torch.device("cuda", rank)


@distributed_test(world_size=[2], device="cuda")
def test_a_parameter_whose_gradient_accumulator_exists_moves_as_torch_swaps_it(rank):
    """FSDP2's `_move_states_to_device` (`p.data = p.to(device)`) on a parameter used on the host before.

    torch's own swap allows a leaf whose only other holder is its gradient accumulator, and
    refuses backward through a graph made before the move; so does the move onto the GPU.
    """
    layer = nn.Linear(3, 2)
    layer(torch.ones(1, 3)).sum().backward()  # the weight now has an AccumulateGrad node
    layer.weight.grad = None
    stale = layer(torch.ones(1, 3)).sum()  # a graph that reaches the old accumulator
    weight = layer.weight
    keep = weakref.ref(weight)
    del stale
    stale = (weight * 2).sum()
    for p in layer.parameters():
        p.data = p.to(torch.device("cuda", rank))
    assert keep() is weight and weight.device == torch.device("cuda", rank)
    with pytest.raises(RuntimeError, match="has since moved onto a simulated GPU"):
        stale.backward()
    layer(torch.ones(1, 3, device="cuda")).sum().backward()
    assert weight.grad.device == torch.device("cuda", rank) and weight.grad.tolist() == [[1.0] * 3] * 2
