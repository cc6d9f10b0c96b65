"""A large simulated world: 64 ranks, each with its process group and collectives over all of them."""

from harness import distributed_test

WORLD = 64


# Fresh ranks, thrown away after: 64 idle warm ranks would crowd out the suite's usual pools.
@distributed_test(world_size=WORLD, device="cpu", timeout=120, isolated=True)
def test_sixty_four_ranks_reduce_and_gather(rank, world_size):
    import torch
    import torch.distributed as dist

    from accel.state import PartialState

    state = PartialState()
    assert (state.num_processes, state.process_index, dist.get_world_size()) == (WORLD, rank, WORLD)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == sum(range(WORLD))
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    assert [int(value.item()) for value in gathered] == list(range(WORLD))
    token = torch.tensor([rank * 10 if rank == WORLD - 1 else -1])
    dist.broadcast(token, src=WORLD - 1)
    assert token.item() == (WORLD - 1) * 10
