"""Random numbers on simulated GPUs, as code that reads a GPU's generator sees them.

A CUDA generator's state is Philox's: 16 bytes, a seed and an offset that each random op
moves on. DTensor's RNG tracker moves that offset to each shard's place, LocalTensor keeps
one per simulated rank, activation checkpointing stashes it to draw the same dropout masks
again when it recomputes. Each is checked here against torch's own reading of the state
(`_PhiloxState`, the tracker itself), on 2 and 4 ranks.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness import distributed_test

SIZES = [2, 4]


def _philox(state):
    """(seed, offset) as torch's DTensor reads a CUDA generator's state."""
    from torch.distributed.tensor._random import _PhiloxState

    read = _PhiloxState(state)
    return int(read.seed.view(torch.int64)), int(read.offset.view(torch.int64))


@distributed_test(world_size=SIZES, device="cuda")
def test_the_generator_state_is_philox_seed_and_offset_and_replays(rank, world_size):
    import pickle

    torch.manual_seed(100 + rank)
    state = torch.cuda.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    assert _philox(state) == (100 + rank, 0) and torch.cuda.initial_seed() == 100 + rank
    first = torch.rand(10, device="cuda")
    assert torch.equal(first.cpu(), torch.rand(10, generator=torch.Generator().manual_seed(100 + rank)))
    assert _philox(torch.cuda.get_rng_state()) == (100 + rank, 12)  # 10 values, counted in fours
    second = torch.randn(3, 5, device="cuda")
    assert torch.cuda.default_generators[rank].get_offset() == 28
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(10, device="cuda"), first) and torch.equal(torch.randn(3, 5, device="cuda"), second)
    # the numbers are a function of the state: set the offset, draw what was drawn there
    torch.cuda.default_generators[rank].set_offset(12)
    assert torch.equal(torch.randn(3, 5, device="cuda"), second)

    own = torch.Generator(device="cuda").manual_seed(5)
    torch.rand(2, device="cuda", generator=own)
    twin = pickle.loads(pickle.dumps(own))
    assert twin.device == torch.device("cuda", rank) and twin.get_offset() == own.get_offset() == 4
    assert torch.equal(torch.rand(4, device="cuda", generator=twin), torch.rand(4, device="cuda", generator=own))

    with pytest.raises(RuntimeError, match="RNG state is wrong size"):
        torch.cuda.set_rng_state(torch.get_rng_state())  # a CPU generator's 5056 bytes
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.cuda.set_rng_state(state.to("cuda"))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@distributed_test(world_size=SIZES, device="cuda")
def test_activation_checkpointing_recomputes_the_same_dropout_masks(rank, world_size, reentrant):
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5)).cuda()
    x = torch.randn(32, 16, device="cuda", requires_grad=True)
    assert torch.cuda.is_initialized() and torch.cuda._initialized  # what checkpointing reads

    def gradients(run):
        torch.manual_seed(rank)
        out = run(x)
        out.square().sum().backward()
        found = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
        x.grad = None
        block.zero_grad(set_to_none=True)
        return out.detach(), found

    plain_out, plain = gradients(block)
    out, checkpointed = gradients(lambda t: checkpoint(block, t, use_reentrant=reentrant))
    assert torch.equal(out, plain_out)
    for got, wanted in zip(checkpointed, plain, strict=True):
        torch.testing.assert_close(got, wanted)


@distributed_test(world_size=SIZES, device="cuda")
def test_dtensor_random_ops_follow_torchs_offset_tracker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, _random, distribute_tensor

    mesh = init_device_mesh("cuda", (world_size,))
    torch.manual_seed(0)
    sharded = distribute_tensor(torch.zeros(4 * world_size, 3, device="cuda"), mesh, [Shard(0)])
    sharded.uniform_()
    assert type(_random._rng_tracker) is _random.OffsetBasedRNGTracker  # torch's own, on the Philox state
    whole = sharded.full_tensor()
    rows = whole.view(world_size, 4, 3)
    assert all(not torch.equal(rows[i], rows[j]) for i in range(world_size) for j in range(i))
    # after the op every rank's offset is past the whole tensor (12 * world_size values), as torch counts it
    seed, offset = _philox(torch.cuda.get_rng_state())
    assert (seed, offset) == (0, 12 * world_size)

    replicated = distribute_tensor(torch.zeros(6, device="cuda"), mesh, [Replicate()])
    replicated.normal_()
    local = replicated.to_local()
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    assert all(torch.equal(g, local) for g in gathered) and local.abs().sum() > 0


@distributed_test(world_size=SIZES, device="cuda")
def test_dtensor_random_ops_given_a_gpu_generator_move_its_offset(rank, world_size):
    """An op given a generator receives torch's own object for it: DTensor still reads the GPU's state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cuda", (world_size,))
    weight = distribute_tensor(torch.zeros(4 * world_size, 8, device="cuda"), mesh, [Shard(0)])
    generator = torch.Generator(device="cuda")
    with torch.no_grad():
        weight.normal_(std=0.1, generator=generator.manual_seed(42))
    assert _philox(generator.get_state()) == (42, 32 * world_size)  # past the whole tensor, on every rank
    rows = weight.full_tensor().view(world_size, 4, 8)
    assert all(not torch.equal(rows[i], rows[j]) for i in range(world_size) for j in range(i))
    with torch.no_grad():
        again = distribute_tensor(torch.zeros(4 * world_size, 8, device="cuda"), mesh, [Shard(0)])
        again.normal_(std=0.1, generator=generator.manual_seed(42))
    assert torch.equal(again.to_local(), weight.to_local())


@distributed_test(world_size=2, device="cuda")
def test_a_fake_process_group_and_local_tensors_stand_for_a_bigger_world(rank, world_size):
    """torch's LocalTensor tests: one process, a "fake" group of any size, each rank's tensor kept apart."""
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode, maybe_disable_local_tensor_mode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("fake", rank=0, world_size=8)
    try:
        assert dist.get_world_size() == 8 and dist.get_backend() == "fake"
        with maybe_disable_local_tensor_mode():
            mesh = init_device_mesh("cuda", (8,))
        torch.manual_seed(0)
        with LocalTensorMode(frozenset(range(8))):
            x = torch.ones(16, 4, device="cuda")
            dropped = F.dropout(distribute_tensor(x, mesh, [Shard(0)]), 0.5)
            assert dropped.placements == (Shard(0),)
            whole = dropped.full_tensor()
        assert whole.shape == (16, 4) and set(whole.unique().tolist()) <= {0.0, 2.0}
    finally:
        dist.destroy_process_group()
    dist.init_process_group("nccl")  # the rank's own world again, as after a fake group on a GPU host
    assert dist.get_world_size() == world_size
    out = torch.ones(1, device="cuda")
    dist.all_reduce(out)
    assert out.item() == world_size
