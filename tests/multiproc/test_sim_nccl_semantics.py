"""The simulated "nccl" group computes what ProcessGroupNCCL computes, and refuses what it refuses.

Each test runs on 2 and 4 simulated GPU ranks, written as a user of torch.distributed
writes it: `init_process_group("nccl")`, one GPU per rank, exact values checked. The
refusals are matched against NCCL's own messages (torch's ProcessGroupNCCL.cpp).
"""

import warnings

import pytest
import torch
from support import nccl_group as _nccl_group

from accel.sim.core import torch_internals
from harness import distributed_test

SIZES = [2, 4]


# -- buffers, not shapes ---------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_all_gather_into_tensor_checks_element_counts_not_shapes(rank, world_size):
    import torch.distributed as dist

    here = _nccl_group(rank)
    ranks = range(world_size)

    flat = torch.empty(world_size * 3, device="cuda")
    dist.all_gather_into_tensor(flat, torch.full((1, 3), float(rank), device="cuda"))  # (1, n) into (world*n,)
    assert flat.device == here and flat.tolist() == [float(r) for r in ranks for _ in range(3)]

    stacked = torch.empty(world_size, 2, dtype=torch.int64, device="cuda")
    dist.all_gather_into_tensor(stacked, torch.tensor([rank, 10 * rank], device="cuda"))  # (n,) into (world, n)
    assert stacked.tolist() == [[r, 10 * r] for r in ranks]

    # float8 moves as bytes (NCCL has no float8 arithmetic before 2.24, but gathers it)
    eights = torch.empty(world_size, 2, dtype=torch.float8_e4m3fn, device="cuda")
    dist.all_gather_into_tensor(eights, torch.full((2,), rank + 0.5, device="cuda").to(torch.float8_e4m3fn))
    assert eights.float().tolist() == [[r + 0.5] * 2 for r in ranks]

    # accelerate's gather: a (1, 2) tensor per rank, gathered into (world*2,) and viewed (world, 2)
    from accelerate import PartialState
    from accelerate.utils import gather

    assert PartialState().device == here
    assert gather(torch.tensor([[rank, rank + 10]], device="cuda")).tolist() == [[r, r + 10] for r in ranks]


@distributed_test(world_size=SIZES, device="cuda")
def test_all_gather_into_tensor_refusals_are_nccls(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    with pytest.raises(ValueError, match="^output tensor size must be equal to world_size times input tensor size$"):
        dist.all_gather_into_tensor(torch.empty(world_size * 3 + 1, device="cuda"), torch.ones(3, device="cuda"))
    with pytest.raises(TypeError, match="^output tensor must have the same type as input tensor$"):
        dist.all_gather_into_tensor(torch.empty(world_size * 3, device="cuda"), torch.ones(3, device="cuda").half())
    with pytest.raises(ValueError, match="^Tensors must be contiguous$"):
        dist.all_gather_into_tensor(torch.empty(world_size * 2, device="cuda"), torch.ones(2, 2, device="cuda")[:, 0])
    # nothing was sent: the group still works
    out = torch.empty(world_size, device="cuda")
    dist.all_gather_into_tensor(out, torch.full((1,), float(rank), device="cuda"))
    assert out.tolist() == [float(r) for r in range(world_size)]


@distributed_test(world_size=SIZES, device="cuda")
def test_reduce_scatter_tensor_checks_element_counts_not_shapes(rank, world_size):
    import torch.distributed as dist

    here = _nccl_group(rank)
    # rank r contributes r + 1 times [0, 1, ..., 2*world - 1]
    source = (torch.arange(2 * world_size, dtype=torch.float32, device="cuda") * (rank + 1)).view(world_size, 2)
    kept = source.clone()
    total = sum(r + 1 for r in range(world_size))

    mine = torch.empty(1, 2, device="cuda")  # input (world, 2) onto output (1, 2)
    dist.reduce_scatter_tensor(mine, source)
    assert mine.device == here and mine.tolist() == [[2.0 * rank * total, (2.0 * rank + 1) * total]]
    assert torch.equal(source, kept)  # NCCL does not write its input

    flat_mine = torch.empty(2, device="cuda")  # input (world*2,) onto output (2,)
    dist.reduce_scatter_tensor(flat_mine, source.view(-1))
    assert flat_mine.tolist() == mine.view(-1).tolist()

    with pytest.raises(ValueError, match="^input tensor must be the same size as output size times world size$"):
        dist.reduce_scatter_tensor(torch.empty(3, device="cuda"), source)
    with pytest.raises(TypeError, match=r"^input tensor must be the same type as the output tensor\.$"):
        dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.float64, device="cuda"), source)


# Uneven all_gather inputs are legal on NCCL (the collective check compares only their dtype there).
@distributed_test(world_size=SIZES, device="cuda")
def test_all_gather_and_reduce_scatter_lists_take_any_shapes(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    ranks = range(world_size)
    # outputs shaped (1, 2) for inputs shaped (2,): NCCL gathers a flat buffer
    parts = [torch.empty(1, 2, device="cuda") for _ in ranks]
    dist.all_gather(parts, torch.tensor([rank, -rank], dtype=torch.float32, device="cuda"))
    assert [p.tolist() for p in parts] == [[[float(r), float(-r)]] for r in ranks]

    # outputs that are strided views (columns of a matrix): NCCL copies its flat buffer into them
    grid = torch.zeros(2, world_size, device="cuda")
    dist.all_gather([grid[:, r] for r in ranks], torch.tensor([rank, -rank], dtype=torch.float32, device="cuda"))
    assert grid.tolist() == [[float(r) for r in ranks], [float(-r) for r in ranks]]

    # uneven all_gather: rank r holds r + 1 elements (NCCL broadcasts each rank's tensor)
    uneven = [torch.empty(r + 1, dtype=torch.int64, device="cuda") for r in ranks]
    dist.all_gather(uneven, torch.full((rank + 1,), rank, device="cuda"))
    assert [u.tolist() for u in uneven] == [[r] * (r + 1) for r in ranks]

    # uneven reduce_scatter: part j (j + 1 elements) is summed onto rank j
    pieces = [torch.full((j + 1,), float(rank + 1), device="cuda") for j in ranks]
    mine = torch.empty(rank + 1, device="cuda")
    dist.reduce_scatter(mine, pieces)
    assert mine.tolist() == [float(sum(r + 1 for r in ranks))] * (rank + 1)


# -- reductions Gloo lacks ---------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_avg(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    _nccl_group(rank)
    ranks = range(world_size)

    t = torch.full((3,), float(rank + 1), device="cuda")
    dist.all_reduce(t, op=ReduceOp.AVG)
    assert t.tolist() == [sum(r + 1 for r in ranks) / world_size] * 3

    shard = torch.empty(1, device="cuda")
    dist.reduce_scatter_tensor(
        shard, torch.arange(world_size, dtype=torch.float32, device="cuda") + 4 * rank, op=ReduceOp.AVG
    )
    assert shard.item() == sum(rank + 4 * r for r in ranks) / world_size

    # integers: sum, then divide rounding toward zero (NCCL's SumPostDiv)
    ints = torch.tensor([rank + 1, -(rank + 1)], device="cuda")
    dist.all_reduce(ints, op=ReduceOp.AVG)
    total = sum(r + 1 for r in ranks)
    assert ints.tolist() == [total // world_size, -(total // world_size)]

    # bools: a SUM is NCCL's MAX (logical or)
    flags = torch.tensor([rank == 0, False], device="cuda")
    dist.all_reduce(flags)
    assert flags.tolist() == [True, False]


# The collective check compares a PREMUL_SUM op made by _make_nccl_premul_sum by its kind.
@distributed_test(world_size=SIZES, device="cuda")
def test_premul_sum(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    ranks = range(world_size)

    # FSDP's gradient reduction: a reduce-scatter that pre-multiplies by a factor
    grads = torch.arange(world_size, dtype=torch.float32, device="cuda") + 4 * rank
    shard = torch.empty(1, device="cuda")
    dist.reduce_scatter_tensor(shard, grads, op=dist._make_nccl_premul_sum(0.5))
    assert shard.item() == 0.5 * sum(rank + 4 * r for r in ranks)

    # the factor as a tensor on the GPU (NCCL reads it there), on bf16 data
    scaled = torch.full((2,), float(rank), dtype=torch.bfloat16, device="cuda")
    dist.all_reduce(scaled, op=dist._make_nccl_premul_sum(torch.tensor(0.25, device="cuda")))
    assert scaled.dtype == torch.bfloat16 and scaled.tolist() == [0.25 * sum(ranks)] * 2

    with pytest.raises(TypeError, match="^PreMulSum Data type must be half, float, bfloat16 or double$"):
        dist.all_reduce(torch.ones(1, dtype=torch.int32, device="cuda"), op=dist._make_nccl_premul_sum(2.0))


@distributed_test(world_size=SIZES, device="cuda")
def test_half_precision_sum_and_avg(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    _nccl_group(rank)
    ranks = range(world_size)
    for dtype in (torch.bfloat16, torch.float16):
        t = torch.tensor([rank + 0.5, 2.0 * rank], dtype=dtype, device="cuda")
        dist.all_reduce(t)
        assert t.dtype == dtype and t.tolist() == [sum(r + 0.5 for r in ranks), sum(2.0 * r for r in ranks)]

        a = torch.tensor([4.0 * rank, 1.0], dtype=dtype, device="cuda")
        dist.all_reduce(a, op=ReduceOp.AVG)
        assert a.dtype == dtype and a.tolist() == [4.0 * sum(ranks) / world_size, 1.0]

        shard = torch.empty(2, dtype=dtype, device="cuda")
        dist.reduce_scatter_tensor(shard, torch.full((2 * world_size,), float(rank), dtype=dtype, device="cuda"))
        assert shard.tolist() == [float(sum(ranks))] * 2

    # NCCL's AVG multiplies each input by 1/world before summing: no fp16 overflow where a SUM overflows
    big = torch.full((1,), 40000.0, dtype=torch.float16, device="cuda")
    dist.all_reduce(big, op=ReduceOp.AVG)
    assert big.item() == 40000.0
    summed = torch.full((1,), 40000.0, dtype=torch.float16, device="cuda")
    dist.all_reduce(summed)
    assert summed.item() == float("inf")


@distributed_test(world_size=SIZES, device="cuda")
def test_reductions_nccl_refuses(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    _nccl_group(rank)
    with pytest.raises(ValueError, match="^Cannot use ReduceOp.BAND with NCCL$"):
        dist.all_reduce(torch.ones(1, dtype=torch.int64, device="cuda"), op=ReduceOp.BAND)
    with pytest.raises(ValueError, match="^Cannot use ReduceOp.BXOR with NCCL$"):
        dist.reduce_scatter_tensor(
            torch.empty(1, dtype=torch.int64, device="cuda"),
            torch.ones(world_size, dtype=torch.int64, device="cuda"),
            op=ReduceOp.BXOR,
        )
    with pytest.raises(TypeError, match="^Cannot use ReduceOp.AVG with boolean inputs$"):
        dist.all_reduce(torch.ones(1, dtype=torch.bool, device="cuda"), op=ReduceOp.AVG)
    with pytest.raises(TypeError, match="^Input tensor data type is not supported for NCCL process group: Short$"):
        dist.all_reduce(torch.ones(1, dtype=torch.int16, device="cuda"))
    with pytest.raises(RuntimeError, match="^Unsupported Float8 type for NCCL reduction$"):
        dist.all_reduce(torch.ones(1, device="cuda").to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="^Tensors must be contiguous$"):
        dist.all_reduce(torch.ones(2, 2, device="cuda").t())
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    assert t.item() == world_size


# -- coalesced collectives ---------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_coalescing_manager(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    _nccl_group(rank)
    ranks = range(world_size)

    a, b = torch.full((2,), float(rank), device="cuda"), torch.full((3,), float(rank + 1), device="cuda")
    with dist._coalescing_manager():
        dist.all_reduce(a)
        dist.all_reduce(b)
    assert a.tolist() == [float(sum(ranks))] * 2 and b.tolist() == [float(sum(r + 1 for r in ranks))] * 3

    # DeepSpeed/Megatron's form: all_gather_into_tensor and reduce_scatter_tensor blocks, async
    gathered = [torch.empty(world_size * 2, device="cuda") for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for k, out in enumerate(gathered):
            dist.all_gather_into_tensor(out, torch.full((1, 2), float(10 * k + rank), device="cuda"))
    cm.wait()
    assert [g.tolist() for g in gathered] == [[float(10 * k + r) for r in ranks for _ in range(2)] for k in range(2)]

    shards = [torch.empty(1, device="cuda") for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for k, shard in enumerate(shards):
            dist.reduce_scatter_tensor(
                shard, torch.full((world_size,), float(k + rank), device="cuda"), op=ReduceOp.AVG
            )
    cm.wait()
    assert [s.item() for s in shards] == [sum(k + r for r in ranks) / world_size for k in range(2)]

    # with a device: torch brackets the block with _start/_end_coalescing, around point-to-point ops too
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    got = torch.empty(2, device="cuda")
    with dist._coalescing_manager(device=torch.device("cuda", rank), async_ops=True) as cm:
        dist.isend(torch.full((2,), float(rank), device="cuda"), right)
        dist.irecv(got, left)
    cm.wait()
    assert got.tolist() == [float(left)] * 2


@distributed_test(world_size=SIZES, device="cuda")
def test_all_reduce_coalesced_and_all_gather_coalesced(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    _nccl_group(rank)
    ranks = range(world_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates both
        tensors = [torch.full((2,), float(rank), device="cuda"), torch.full((1, 3), float(2 * rank), device="cuda")]
        dist.all_reduce_coalesced(tensors)
        assert tensors[0].tolist() == [float(sum(ranks))] * 2 and tensors[1].tolist() == [[2.0 * sum(ranks)] * 3]

        averaged = [torch.full((2,), float(rank), device="cuda")]
        future = dist.all_reduce_coalesced(averaged, op=ReduceOp.AVG, async_op=True)  # torch returns the future
        assert future.wait()[0] is averaged[0] and averaged[0].tolist() == [sum(ranks) / world_size] * 2

        with pytest.raises(NotImplementedError, match="^ProcessGroupNCCL does not support allgather_coalesced$"):
            dist.all_gather_coalesced([[torch.empty(1, device="cuda")] for _ in ranks], [torch.ones(1, device="cuda")])


# -- all-to-all and point-to-point -------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_all_to_all_single_with_uneven_splits(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    ranks = range(world_size)
    # rank r sends j + 1 rows of two values (100*r + j, -(100*r + j)) to rank j, so it receives r + 1 rows from each
    sent = torch.cat([torch.tensor([[100 * rank + j, -(100 * rank + j)]] * (j + 1)) for j in ranks]).cuda()
    received = torch.empty((rank + 1) * world_size, 2, dtype=torch.int64, device="cuda")
    dist.all_to_all_single(
        received, sent, output_split_sizes=[rank + 1] * world_size, input_split_sizes=[j + 1 for j in ranks]
    )
    assert received.tolist() == [[100 * s + rank, -(100 * s + rank)] for s in ranks for _ in range(rank + 1)]

    # equal splits: counts, not shapes (NCCL sends numel / world elements to each rank)
    swapped = torch.empty(world_size * 2, device="cuda")
    dist.all_to_all_single(
        swapped, torch.arange(2 * world_size, dtype=torch.float32, device="cuda").view(-1, 2) + 10 * rank
    )
    assert swapped.tolist() == [10.0 * s + 2 * rank + i for s in ranks for i in range(2)]

    with pytest.raises(RuntimeError, match="^Number of tensor splits not equal to group size$"):
        dist.all_to_all_single(received, sent, [rank + 1] * (world_size + 1), [j + 1 for j in ranks])
    with pytest.raises(RuntimeError, match="^Split sizes doesn't match total dim 0 size$"):
        dist.all_to_all_single(received, sent, [rank + 1] * world_size, [1] * world_size)


@distributed_test(world_size=SIZES, device="cuda")
def test_all_to_all_lists(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    ranks = range(world_size)
    inputs = [torch.full((j + 1,), float(10 * rank + j), device="cuda") for j in ranks]  # j + 1 elements for rank j
    outputs = [torch.empty(rank + 1, device="cuda") for _ in ranks]
    dist.all_to_all(outputs, inputs)
    assert [o.tolist() for o in outputs] == [[float(10 * s + rank)] * (rank + 1) for s in ranks]


@distributed_test(world_size=SIZES, device="cuda")
def test_batch_isend_irecv_ring(rank, world_size):
    import torch.distributed as dist

    here = _nccl_group(rank)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for order in (1, -1):  # the order of sends and receives in the list does not matter
        out, got = torch.arange(3, dtype=torch.float32, device="cuda") + 10 * rank, torch.empty(3, device="cuda")
        ops = [dist.P2POp(dist.isend, out, right), dist.P2POp(dist.irecv, got, left)][::order]
        works = dist.batch_isend_irecv(ops)
        assert len(works) == 2
        for work in works:
            assert work.wait() is True and work.is_completed()
        assert got.device == here and got.tolist() == [10.0 * left + i for i in range(3)]
        received = works[1 if order == 1 else 0].get_future().value()
        assert len(received) == 1 and received[0] is got

    # plain isend / irecv: the ring posts everything before waiting
    sent, got = torch.full((1,), float(rank), device="cuda"), torch.empty(1, device="cuda")
    works = [dist.isend(sent, right), dist.irecv(got, left)]
    for work in works:
        work.wait()
    assert got.item() == left


@distributed_test(world_size=SIZES, device="cuda")
def test_batch_isend_irecv_on_one_gpu_fails_as_nccl_does(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(0)  # every rank on GPU 0
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.ones(1, device="cuda"), right),
            dist.P2POp(dist.irecv, torch.empty(1, device="cuda"), left),
        ]
    )
    for work in works:  # posting did not block; waiting sets up each pair's communicator, which NCCL refuses
        with pytest.raises(
            dist.DistBackendError, match="Duplicate GPU detected : rank [0-9] and rank [0-9] both on CUDA device 0"
        ):
            work.wait()


@distributed_test(world_size=SIZES, device="cuda")
def test_point_to_point_refusals_are_nccls(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    with pytest.raises(NotImplementedError, match="^ProcessGroupNCCL does not support recvAnysource$"):
        dist.recv(torch.empty(1, device="cuda"))
    # a non-contiguous tensor: NCCL warns and sends its memory as it lies
    if rank in (0, 1):
        if rank == 0:
            with pytest.warns(UserWarning, match="^Detected non-contiguous tensor in P2P operations"):
                dist.send(torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda").t(), 1)
        else:
            got = torch.empty(2, 2, device="cuda")
            dist.recv(got, 0)
            assert got.tolist() == [[1.0, 2.0], [3.0, 4.0]]


# -- work objects ------------------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_async_work_objects(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    ranks = range(world_size)

    def finished(work, outputs):
        assert work.wait() is True and work.is_completed()
        value = work.get_future().value()
        assert [id(t) for t in value] == [id(t) for t in outputs]  # NCCL's future holds the output tensors

    t = torch.full((2,), float(rank), device="cuda")
    finished(dist.all_reduce(t, async_op=True), [t])
    assert t.tolist() == [float(sum(ranks))] * 2

    b = torch.full((1,), float(rank), device="cuda")
    finished(dist.broadcast(b, src=1, async_op=True), [b])
    assert b.item() == 1.0

    flat = torch.empty(world_size, device="cuda")
    finished(dist.all_gather_into_tensor(flat, torch.full((1,), float(rank), device="cuda"), async_op=True), [flat])
    assert flat.tolist() == [float(r) for r in ranks]

    shard = torch.empty(1, device="cuda")
    source = torch.arange(world_size, dtype=torch.float32, device="cuda")
    finished(dist.reduce_scatter_tensor(shard, source, async_op=True), [shard])
    assert shard.item() == rank * world_size

    swapped = torch.empty(world_size, device="cuda")
    finished(dist.all_to_all_single(swapped, source + 10 * rank, async_op=True), [swapped])
    assert swapped.tolist() == [10.0 * s + rank for s in ranks]

    outputs = [torch.empty(1, device="cuda") for _ in ranks]
    finished(
        dist.all_to_all(outputs, [torch.full((1,), float(rank), device="cuda") for _ in ranks], async_op=True), outputs
    )
    assert [o.item() for o in outputs] == [float(s) for s in ranks]

    parts = [torch.empty(1, device="cuda") for _ in ranks]
    work = dist.all_gather(parts, torch.full((1,), float(rank), device="cuda"), async_op=True)
    assert work.wait() is True and work.is_completed() and [p.item() for p in parts] == [float(r) for r in ranks]

    mine = torch.empty(1, device="cuda")
    finished(
        dist.reduce_scatter(mine, [torch.full((1,), float(r), device="cuda") for r in ranks], async_op=True), [mine]
    )
    assert mine.item() == rank * world_size

    reduced = torch.full((1,), float(rank + 1), device="cuda")
    finished(dist.reduce(reduced, dst=0, async_op=True), [reduced])
    assert reduced.item() == (sum(r + 1 for r in ranks) if rank == 0 else rank + 1)  # NCCL leaves the others

    work = dist.barrier(async_op=True)
    assert work.wait() is True and work.is_completed()


# -- eager init and subgroups ------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_device_id_binds_the_group_at_init(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.group.WORLD
    assert world.bound_device_id == torch.device("cuda", rank)
    assert world.gpu == rank  # the communicator is set up already, on that GPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "barrier(): using the device under current context"
        dist.barrier()
    t = torch.ones(1, device=torch.device("cuda", rank))
    dist.all_reduce(t)
    assert t.item() == world_size


@distributed_test(world_size=SIZES, device="cuda")
def test_device_id_as_an_index(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("nccl", device_id=rank)
    assert dist.group.WORLD.bound_device_id == torch.device("cuda", rank)
    t = torch.full((1,), float(rank), device=torch.device("cuda", rank))
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size))


@distributed_test(world_size=SIZES, device="cuda")
def test_split_group(rank, world_size):
    import torch.distributed as dist

    here = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=here)
    evens, odds = list(range(0, world_size, 2)), list(range(1, world_size, 2))
    mine = evens if rank % 2 == 0 else odds
    sub = dist.split_group(split_ranks=[evens, odds])
    assert sub is not None and dist.get_backend(sub) == "nccl"
    assert dist.get_process_group_ranks(sub) == mine and sub.rank() == mine.index(rank)
    assert sub.bound_device_id == here
    t = torch.full((1,), float(rank), device=here)
    dist.all_reduce(t, group=sub)
    assert t.item() == sum(mine)
    gathered = torch.empty(len(mine), device=here)
    dist.all_gather_into_tensor(gathered, torch.full((1,), float(rank), device=here), group=sub)
    assert gathered.tolist() == [float(r) for r in mine]

    # a rank in none of the split's groups gets what torch gives it with NCCL: None, from torch 2.14 on
    # GroupMember.NON_GROUP_MEMBER (torch_internals.TORCH_CHANGES)
    alone = dist.split_group(split_ranks=[[0]])
    outside = dist.GroupMember.NON_GROUP_MEMBER if torch_internals.at_least("2.14") else None
    assert (alone is outside) == (rank != 0)
    if rank == 0:
        assert alone.size() == 1


@distributed_test(world_size=SIZES, device="cuda")
def test_split_group_of_a_group_bound_to_no_device(rank, world_size):
    import torch.distributed as dist

    _nccl_group(rank)
    if not torch_internals.at_least("2.15"):
        with pytest.raises(RuntimeError, match="^No device associated with the default pg, not safe to split"):
            dist.split_group(split_ranks=[list(range(world_size))])
        return
    # torch 2.15 splits it (torch_internals.TORCH_CHANGES): the subgroup's communicator is set up at its first use
    evens = list(range(0, world_size, 2))
    sub = dist.split_group(split_ranks=[evens, list(range(1, world_size, 2))])
    assert dist.get_backend(sub) == "nccl" and sub.bound_device_id is None
    t = torch.full((1,), float(rank), device=torch.device("cuda", rank))
    dist.all_reduce(t, group=sub)
    assert t.item() == sum(evens if rank % 2 == 0 else range(1, world_size, 2))


@distributed_test(world_size=SIZES, device="cuda")
def test_new_group_of_a_bound_group(rank, world_size):
    import torch.distributed as dist

    here = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=here)
    firsts = [0, 1]
    sub = dist.new_group(ranks=firsts, backend="nccl")
    gloo = dist.new_group(backend="gloo")
    if rank in firsts:
        assert dist.get_backend(sub) == "nccl"
        assert sub.bound_device_id == here and sub.gpu == rank  # set up at creation, as NCCL's eager init does
        t = torch.full((2,), float(rank + 1), device=here)
        dist.all_reduce(t, group=sub)
        assert t.tolist() == [3.0, 3.0]
    else:
        assert sub is dist.GroupMember.NON_GROUP_MEMBER
    c = torch.ones(1)
    dist.all_reduce(c, group=gloo)
    assert c.item() == world_size


# -- "cpu:gloo,cuda:nccl" ----------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_mixed_group_runs_cpu_tensors_on_gloo_and_cuda_tensors_as_nccl(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import ReduceOp

    here = _nccl_group(rank)
    both = dist.new_group(backend="cpu:gloo,cuda:nccl")
    ranks = range(world_size)

    on_gpu = torch.full((2,), float(rank), device=here)
    dist.all_reduce(on_gpu, op=ReduceOp.AVG, group=both)  # NCCL's AVG
    assert on_gpu.tolist() == [sum(ranks) / world_size] * 2
    with pytest.raises(ValueError, match="^Cannot use ReduceOp.BAND with NCCL$"):
        dist.all_reduce(torch.ones(1, dtype=torch.int64, device=here), op=ReduceOp.BAND, group=both)
    on_host = torch.full((1,), rank, dtype=torch.int64)
    dist.all_reduce(on_host, op=ReduceOp.BAND, group=both)  # Gloo has it
    assert on_host.item() == (0 if world_size > 1 else rank)

    gathered = torch.empty(world_size * 2, device=here)  # NCCL's shape freedom
    dist.all_gather_into_tensor(gathered, torch.full((1, 2), float(rank), device=here), group=both)
    assert gathered.tolist() == [float(r) for r in ranks for _ in range(2)]
    on_cpu = torch.empty(world_size * 2)
    dist.all_gather_into_tensor(on_cpu, torch.full((2,), float(rank)), group=both)
    assert on_cpu.tolist() == [float(r) for r in ranks for _ in range(2)]
    with pytest.raises(RuntimeError, match="^ProcessGroupGloo::allgather: invalid tensor size"):  # Gloo checks shapes
        dist.all_gather_into_tensor(torch.empty(world_size, 2), torch.ones(2), group=both)

    # a ring of CPU and of GPU tensors: Gloo's isend/irecv are under way when returned, as NCCL's
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for device in ("cpu", here):
        got = torch.empty(1, device=device)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((1,), float(rank), device=device), right, group=both),
                dist.P2POp(dist.irecv, got, left, group=both),
            ]
        )
        for work in works:
            work.wait()
        assert got.item() == left

    with pytest.raises(ValueError, match="^Tensors must be CUDA and dense$"):
        dist.all_gather([torch.empty(1) for _ in ranks], torch.ones(1, device=here), group=both)


@distributed_test(world_size=SIZES, device="cuda")
def test_device_mesh_of_a_bound_group_splits(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    here = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=here)
    shape = (2, world_size // 2)
    mesh = init_device_mesh("cuda", shape, mesh_dim_names=("dp", "tp"))  # torch splits the bound group
    for name, dim in (("dp", 0), ("tp", 1)):
        group = mesh.get_group(name)
        assert group.bound_device_id == here  # split from the default group, on its GPU
        members = dist.get_process_group_ranks(group)
        coordinate = mesh.get_coordinate()
        assert members == mesh.mesh.select(1 - dim, coordinate[1 - dim]).tolist()
        t = torch.full((1,), float(rank), device=here)
        dist.all_reduce(t, group=group)
        assert t.item() == sum(members)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_barrier_before_any_gpu_is_known_takes_the_ranks_gpu_as_nccl_guesses_it(rank, world_size):
    """ProcessGroupNCCL's barrier with no device given, bound or used: GPU (global rank % GPUs on the node), with
    its warning, whatever GPU is current (PyTorch's MultiProcContinuousTest workers never set one)."""
    import contextlib
    import io

    import torch.distributed as dist

    torch.cuda.set_device(0)  # as a process starts
    dist.init_process_group("nccl")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        dist.barrier()  # every rank on cuda:0 would be NCCL's "Duplicate GPU detected"
    assert f"using GPU {rank % torch.cuda.device_count()} as device used by this process is currently unknown" in (
        err.getvalue()
    )
    assert torch.cuda.current_device() == 0


@distributed_test(world_size=SIZES, device="cuda")
def test_nccl_debug_info_logs_each_collective_as_nccl_does(rank, world_size, tmp_path):
    """NCCL_DEBUG=INFO with the COLL subsystem: one line per collective, with NCCL's counts, data types (float32
    7, bfloat16 9) and reduction ops (sum 0, avg 4), in NCCL_DEBUG_FILE (%p: the process id)."""
    import os
    import re

    import torch.distributed as dist

    device = _nccl_group(rank)
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,COLL", NCCL_DEBUG_FILE=str(tmp_path / "nccl.%p"))
    try:
        dist.all_reduce(torch.ones(10, device=device), op=dist.ReduceOp.AVG)
        out = torch.empty(3, device=device)
        dist.reduce_scatter_tensor(out, torch.ones(3 * world_size, device=device))
        gathered = torch.empty(2 * world_size, device=device, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(gathered, torch.ones(2, device=device, dtype=torch.bfloat16))
        os.environ["NCCL_DEBUG"] = "WARN"  # below INFO: nothing more is logged
        dist.all_reduce(torch.ones(1, device=device))
    finally:
        for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
            os.environ.pop(name, None)
    lines = (tmp_path / f"nccl.{os.getpid()}").read_text().splitlines()
    line = r"\[{gpu}\] NCCL INFO {coll}: opCount {n} sendbuff 0x[0-9a-f]+ recvbuff 0x[0-9a-f]+ count {count} datatype {dt} op {op} root 0 comm 0x[0-9a-f]+ \[nranks={size}\]"  # noqa: E501
    expected = [("AllReduce", 0, 10, 7, 4), ("ReduceScatter", 1, 3, 7, 0), ("AllGather", 2, 2, 9, 0)]
    assert len(lines) == len(expected), lines
    for text, (coll, n, count, dt, op) in zip(lines, expected, strict=True):
        pattern = line.format(gpu=rank, coll=coll, n=n, count=count, dt=dt, op=op, size=world_size)
        assert re.search(pattern, text), text
