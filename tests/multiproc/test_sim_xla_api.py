"""Today's torch_xla API on 2 and 4 simulated TPU cores, written as torch_xla's docs write it.

Each body runs in every simulated TPU rank (`device="xla"`): one process per core, as
torch_xla runs under PJRT. Values are compared through `.cpu()` and devices against
`torch_xla.device()`, so the tests hold whatever tensor the simulated device gives.
"""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="xla")
def test_devices_and_topology(rank, world_size):
    import contextlib
    import io

    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device = torch_xla.device()
    assert torch_xla.devices() == [device] and torch_xla.device_count() == 1
    assert torch_xla.device(0) == device
    assert torch_xla.real_devices() == [f"TPU:{rank}"]
    with pytest.raises(IndexError):
        torch_xla.device(1)
    with pytest.warns(DeprecationWarning, match="Use torch_xla.device instead"):
        assert xm.xla_device() == device
    assert xm.get_xla_supported_devices() == [str(device)]
    assert xm.xla_device_hw(device) == "TPU" and xr.device_type() == "TPU"
    assert (xr.world_size(), xr.global_ordinal(), xr.local_ordinal()) == (world_size, rank, rank)
    assert (xr.process_count(), xr.process_index(), xr.local_process_count()) == (world_size, rank, world_size)
    assert (xr.global_device_count(), xr.local_device_count(), xr.addressable_device_count()) == (
        world_size,
        world_size,
        1,
    )
    assert xr.host_index() == 0 and xr.using_pjrt() and not xr.is_spmd()
    assert xm.get_local_ordinal() == rank
    assert xm.is_master_ordinal() == xm.is_master_ordinal(local=False) == (rank == 0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        xm.master_print("loss", 1.5)
    assert printed.getvalue() == ("loss 1.5\n" if rank == 0 else "")
    # Removed from today's torch_xla (2.7): an AttributeError that names the replacement.
    with pytest.raises(AttributeError, match=r"get_ordinal.*torch_xla.runtime.global_ordinal\(\)"):
        xm.get_ordinal()
    with pytest.raises(AttributeError, match=r"xrt_world_size.*torch_xla.runtime.world_size\(\)"):
        xm.xrt_world_size()
    from torch_xla._internal.utils import parse_xla_device

    assert parse_xla_device(torch_xla.real_devices()[0]) == ("TPU", rank)
    # Tensors made on the device stay there; .cpu() brings them to the host.
    t = torch.arange(3.0, device=device)
    assert t.device == device and xm.is_xla_tensor(t) and t.cpu().tolist() == [0.0, 1.0, 2.0]


@distributed_test(world_size=SIZES, device="xla")
def test_launch_and_spawn_run_the_function_once_in_each_core(rank, world_size):
    import torch_xla
    import torch_xla.distributed.xla_multiprocessing as xmp

    calls = []

    def _mp_fn(index, tag):
        calls.append((index, tag))

    torch_xla.launch(_mp_fn, args=("launch",))
    xmp.spawn(_mp_fn, args=("spawn",))
    assert calls == [(rank, "launch"), (rank, "spawn")]
    with pytest.raises(ValueError, match=r"Unsupported nprocs \(3\)"):
        xmp.spawn(_mp_fn, args=("x",), nprocs=3)
    with pytest.raises(RuntimeError, match=f"started {world_size} processes already"):
        torch_xla.launch(_mp_fn, args=("x",), debug_single_process=True)
    assert len(calls) == 2


@distributed_test(world_size=SIZES, device="xla")
def test_sync_step_compile_and_step_closures(rank, world_size):
    import warnings

    import torch_xla
    import torch_xla._sim_state as sim_state
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    device = torch_xla.device()
    ran = []
    xm.add_step_closure(lambda value: ran.append(value.cpu().item()), args=(torch.tensor(2.0, device=device),))
    xm.add_step_closure(lambda: ran.append("async"), run_async=True)
    assert ran == []  # closures wait for the end of the step
    before = sim_state.steps
    torch_xla.sync()
    assert ran == [2.0, "async"] and sim_state.steps == before + 1
    torch_xla.sync()
    assert ran == [2.0, "async"]  # each closure runs once
    assert met.counter_value("MarkStep") == sim_state.steps and "MarkStep" in met.metrics_report()

    with pytest.warns(UserWarning, match="runs the function eagerly"):

        @torch_xla.compile()
        def double(x):
            return x * 2

    with torch_xla.step():  # torch_xla.compile() as a context manager: it starts and ends with a sync
        before = sim_state.steps
        y = torch.ones(2, device=device) * 3
    assert y.cpu().tolist() == [3.0, 3.0] and sim_state.steps == before + 1

    assert double(torch.ones(1, device=device)).cpu().item() == 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        compiled = torch_xla.compile(lambda x: x + 1, full_graph=True, name="plus_one")
        with torch_xla.compile():
            assert compiled(torch.zeros(1, device=device)).cpu().item() == 1.0


@distributed_test(world_size=SIZES, device="xla")
def test_eager_mode_as_torch_xlas_eager_examples_set_it(rank, world_size):
    import torch_xla  # its experimental package comes with it, as on a TPU host

    assert torch_xla.experimental.is_eager_mode() is False  # torch_xla's default (and each test's)
    torch_xla.experimental.eager_mode(True)
    assert torch_xla.experimental.is_eager_mode() is True
    with torch_xla.experimental.eager_mode_context(False) as before:
        assert before is True and not torch_xla.experimental.is_eager_mode()
    assert torch_xla.experimental.is_eager_mode() is True
    # ops run as they come either way: a step in eager mode gives what it gives without it
    device = torch_xla.device()
    weight = torch.ones(3, device=device, requires_grad=True)
    (weight * float(rank + 1)).sum().backward()
    assert weight.grad.tolist() == [rank + 1.0] * 3


@distributed_test(world_size=SIZES, device="xla")
def test_runtime_cache_and_spmd_refusal(rank, world_size, tmp_path):
    import torch_xla
    import torch_xla.runtime as xr

    xr.initialize_cache(str(tmp_path / f"cache{rank}"), readonly=rank != 0)
    with pytest.raises(AssertionError, match="Computation cache has already been initialized"):
        xr.initialize_cache(str(tmp_path / "again"))
    assert xr.get_num_cached_compilation_graph() == 0
    with pytest.raises(NotImplementedError, match=r"use_spmd .*SPMD is not simulated"):
        xr.use_spmd()

    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel as FSDPv2

    with pytest.raises(NotImplementedError, match=r"spmd.Mesh .*SPMD is not simulated"):
        xs.Mesh(list(range(world_size)), (world_size, 1), ("data", "model"))
    with pytest.raises(NotImplementedError, match="spmd.mark_sharding"):
        xs.mark_sharding(torch.zeros(2, device=torch_xla.device()), None, ("data",))
    with pytest.raises(NotImplementedError, match=r"SpmdFullyShardedDataParallel \(FSDPv2\)"):
        FSDPv2(torch.nn.Linear(2, 2))
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    with pytest.raises(NotImplementedError, match="XlaFullyShardedDataParallel"):
        XlaFullyShardedDataParallel(torch.nn.Linear(2, 2))


@distributed_test(world_size=SIZES, device="xla")
def test_xm_all_reduce_and_all_gather(rank, world_size):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    value = torch.tensor([rank + 1.0, 2.0], device=device)
    total = xm.all_reduce(xm.REDUCE_SUM, value)
    assert total.device == device and total.cpu().tolist() == [world_size * (world_size + 1) / 2, 2.0 * world_size]
    assert value.cpu().tolist() == [rank + 1.0, 2.0]  # a tensor: a new result, the input untouched
    mean = xm.all_reduce(xm.REDUCE_SUM, value, scale=1.0 / world_size)
    assert mean.cpu().tolist() == pytest.approx([(world_size + 1) / 2, 2.0])
    assert xm.all_reduce(xm.REDUCE_MAX, value).cpu().tolist() == [float(world_size), 2.0]
    assert xm.all_reduce(xm.REDUCE_MIN, value).cpu().tolist() == [1.0, 2.0]
    # A list is reduced in place (one fused reduction per dtype) and returned.
    grads = [torch.full((2, 2), float(rank), device=device), torch.tensor([1], device=device)]
    assert xm.all_reduce(xm.REDUCE_SUM, grads, scale=0.5) is grads
    assert grads[0].cpu().tolist() == [[sum(range(world_size)) / 2] * 2] * 2
    assert grads[1].cpu().tolist() == [0]  # XLA takes the scale in the tensor's type: int(0.5) == 0
    with pytest.raises(ValueError, match="Invalid reduce type 'avg'"):
        xm.all_reduce("avg", value)
    if device.type == "xla":  # a batch left on the host: torch_xla's words, on every core (nothing hangs)
        with pytest.raises(RuntimeError, match="^Expected XLA tensor. Got: CPUFloatType$"):
            xm.all_reduce(xm.REDUCE_SUM, torch.ones(2))
        with pytest.raises(RuntimeError, match="Element at index 1 is not an XLA tensor. Got: CPULongType"):
            xm.all_reduce(xm.REDUCE_SUM, [value, torch.ones(2, dtype=torch.long)])

    mine = torch.tensor([[rank, 10 + rank]], device=device)
    assert xm.all_gather(mine).cpu().tolist() == [[r, 10 + r] for r in range(world_size)]
    assert xm.all_gather(mine, dim=1).cpu().tolist() == [[v for r in range(world_size) for v in (r, 10 + r)]]
    out = torch.zeros(world_size, 2, dtype=mine.dtype, device=device)
    assert xm.all_gather(mine, output=out) is out and out.cpu()[:, 0].tolist() == list(range(world_size))
    with pytest.raises(RuntimeError, match="pin_layout=True is not yet supported"):
        xm.all_gather([mine, mine])
    pair = xm.all_gather([mine, mine * 2], pin_layout=False)
    assert [p.cpu()[:, 0].tolist() for p in pair] == [list(range(world_size)), [2 * r for r in range(world_size)]]
    with pytest.raises(TypeError, match="needs to be a Tensor or a list of Tensors"):
        xm.all_gather("not a tensor")


@distributed_test(world_size=SIZES, device="xla")
def test_xm_reduce_scatter_all_to_all_permute_broadcast(rank, world_size):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    n = world_size
    # reduce_scatter: the sum over replicas, then this replica's shard of scatter_dim, scaled
    full = torch.arange(2.0 * n, device=device).reshape(n, 2) + rank
    shard = xm.reduce_scatter(xm.REDUCE_SUM, full, scale=1.0 / n, scatter_dim=0, shard_count=n)
    expected = [(2.0 * rank + j) * n / n + sum(range(n)) / n for j in range(2)]
    assert shard.shape == (1, 2) and shard.cpu().tolist() == [pytest.approx(expected)]
    columns = torch.ones(3, 2 * n, device=device)
    part = xm.reduce_scatter(xm.REDUCE_SUM, columns, scale=1.0, scatter_dim=1, shard_count=n)
    assert part.shape == (3, 2) and part.cpu().unique().tolist() == [float(n)]
    out = torch.zeros(1, 2, device=device)
    assert xm.reduce_scatter(xm.REDUCE_MAX, full, 1.0, 0, n, output=out) is out
    with pytest.raises(RuntimeError, match=f"shard_count=3, but the replica group has {n} replicas"):
        xm.reduce_scatter(xm.REDUCE_SUM, full, 1.0, 0, 3)

    # all_to_all: piece i of each replica goes to replica i
    sent = torch.tensor([[100 * rank + i] for i in range(n)], device=device)
    got = xm.all_to_all(sent, split_dimension=0, concat_dimension=0, split_count=n)
    assert got.cpu().flatten().tolist() == [100 * r + rank for r in range(n)]
    side = xm.all_to_all(sent, split_dimension=0, concat_dimension=1, split_count=n)
    assert side.shape == (1, n) and side.cpu().flatten().tolist() == [100 * r + rank for r in range(n)]

    # collective_permute: a ring; a replica no pair targets gets zeros
    value = torch.full((2,), float(rank + 1), device=device)
    ring = xm.collective_permute(value, [[r, (r + 1) % n] for r in range(n)])
    assert ring.cpu().tolist() == [float((rank - 1) % n + 1)] * 2
    one_way = xm.collective_permute(value, [[0, 1]])
    assert one_way.cpu().tolist() == ([1.0, 1.0] if rank == 1 else [0.0, 0.0])
    with pytest.raises(RuntimeError, match="each target replica must appear at most once"):
        xm.collective_permute(value, [[0, 1], [1, 1]])

    # collective_broadcast: in place, from the root ordinal
    tensors = [torch.full((3,), float(rank), device=device), torch.tensor([rank], device=device)]
    xm.collective_broadcast(tensors, root_ordinal=n - 1)
    assert tensors[0].cpu().tolist() == [n - 1.0] * 3 and tensors[1].cpu().tolist() == [n - 1]
    # a receiving buffer from torch.empty may hold anything (NaN): the root's values arrive all the same
    received = [torch.full((2,), 5.0 if rank == 0 else float("nan"), device=device)]
    xm.collective_broadcast(received)
    assert received[0].cpu().tolist() == [5.0, 5.0]

    with pytest.raises(NotImplementedError, match="xm.send .*collective_permute"):
        xm.send(value, channel_id=1)
    with pytest.raises(NotImplementedError, match="get_memory_info"):
        xm.get_memory_info(device)


@distributed_test(world_size=SIZES, device="xla")
def test_xm_replica_groups(rank, world_size):
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()
    half = world_size // 2
    groups = [list(range(half)), list(range(half, world_size))]
    mine = groups[rank // half]
    value = torch.tensor([float(rank)], device=device)
    assert xm.all_reduce(xm.REDUCE_SUM, value, groups=groups).cpu().item() == sum(mine)
    assert xm.all_gather(value, groups=groups).cpu().tolist() == [float(r) for r in mine]
    shard = xm.reduce_scatter(xm.REDUCE_SUM, torch.ones(half, device=device), 1.0, 0, half, groups=groups)
    assert shard.cpu().tolist() == [float(half)]
    grads = [torch.full((2,), float(rank), device=device)]
    xm.all_reduce(xm.REDUCE_SUM, grads, groups=groups)  # the same groups again: the same sub-group
    assert grads[0].cpu().tolist() == [float(sum(mine))] * 2
    with pytest.raises(ValueError, match="must name each of the"):
        xm.all_reduce(xm.REDUCE_SUM, value, groups=[[0]])


@distributed_test(world_size=SIZES, device="xla")
def test_rendezvous_mesh_reduce_and_save(rank, world_size, tmp_path):
    import numpy as np
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_multiprocessing as xmp

    assert xm.rendezvous("init", f"from {rank}".encode()) == [f"from {r}".encode() for r in range(world_size)]
    assert xm.rendezvous("empty") == [b""] * world_size
    # As torch_xla's, the tag names the rendezvous in logs only.
    assert xm.rendezvous(f"tag {rank}", b"!") == [b"!"] * world_size
    with pytest.raises(TypeError, match="`payload` must be bytes"):
        xm.rendezvous("bad", "text")
    with pytest.raises(ValueError, match="Only global rendezvous is supported"):
        xm.rendezvous("some", b"", replicas=[0])

    accuracy = xm.mesh_reduce("test_accuracy", 0.5 + rank, np.mean)
    assert accuracy == pytest.approx(0.5 + (world_size - 1) / 2)
    device = torch_xla.device()
    total = xm.mesh_reduce("sum", torch.tensor([rank], device=device), lambda items: sum(t.item() for t in items))
    assert total == sum(range(world_size))

    path = tmp_path / "model.pt"
    state = {"w": torch.full((2,), float(rank), device=device), "step": (rank, 7)}
    xm.wait_device_ops()
    xm.save(state, path)  # written by the master, its tensors on the CPU
    xm.rendezvous("torch_xla.core.xla_model.save")
    loaded = torch.load(path)
    assert loaded["w"].device == torch.device("cpu") and loaded["w"].tolist() == [0.0, 0.0]
    assert loaded["step"] == [0, 7]  # torch_xla's walker gives lists for tuples
    xm.save({"mine": rank}, tmp_path / f"r{rank}.pt", master_only=False)
    import torch_xla.utils.serialization as xser

    xser.save(state, str(tmp_path / "xser.pt"))
    xm.rendezvous("xser saved")
    back = xser.load(str(tmp_path / "xser.pt"))
    assert back["w"].device == torch.device("cpu") and back["w"].tolist() == [0.0, 0.0]
    assert (tmp_path / "xser.pt.tensors" / "tensor_0.pt").is_file()
    assert torch.load(tmp_path / f"r{rank}.pt") == {"mine": rank}

    done = xm.do_on_ordinals(lambda t: t.device.type, (torch.ones(1, device=device),), ordinals=(world_size - 1,))
    assert done == ("cpu" if rank == world_size - 1 else None)
    order = []
    xmp.MpSerialExecutor().run(lambda: order.append(rank))
    assert order == [rank]


def _reference_weights(world_size, steps, seed=0):
    """The weights of one process training on the whole batch (mean over the replicas' samples)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = _data(world_size, steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.cat([data[r][step][0] for r in range(world_size)])
        y = torch.cat([data[r][step][1] for r in range(world_size)])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model, data


def _data(world_size, steps, batch=3):
    g = torch.Generator().manual_seed(123)
    return [[(torch.randn(batch, 4, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(steps)]
            for _ in range(world_size)]  # fmt: skip


@distributed_test(world_size=SIZES, device="xla")
def test_training_loop_as_torch_xla_docs_write_it(rank, world_size):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl

    steps = 4
    reference, data = _reference_weights(world_size, steps)
    results = {}

    def _mp_fn(index):
        device = torch_xla.device()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(
                torch.cat([x for x, _ in data[index]]), torch.cat([y for _, y in data[index]])
            ),
            batch_size=3,
        )
        train_loader = pl.MpDeviceLoader(loader, device)
        tracker = xm.RateTracker()
        losses = []
        model.train()
        for x, y in train_loader:
            assert x.device == device and y.device == device
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            xm.optimizer_step(optimizer)
            tracker.add(x.shape[0])
            xm.add_step_closure(lambda loss: losses.append(loss.cpu().item()), args=(loss,))
        torch_xla.sync()
        results["losses"] = losses
        results["model"] = model
        results["rate"] = tracker.global_rate()

    torch_xla.launch(_mp_fn, args=())
    assert len(results["losses"]) == steps and results["rate"] > 0
    for mine, theirs in zip(results["model"].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6)


@distributed_test(world_size=SIZES, device="xla")
def test_parallel_loader_and_sample_generator(rank, world_size):
    import torch_xla
    import torch_xla._sim_state as sim_state
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.utils.utils as xu

    device = torch_xla.device()
    synthetic = xu.SampleGenerator(
        data=(torch.zeros(8, 3), torch.zeros(8, dtype=torch.int64)),
        sample_count=5,
    )
    assert len(synthetic) == 5
    batches = list(pl.MpDeviceLoader(synthetic, device))
    assert len(batches) == 5
    x, y = batches[0]  # a tuple comes back as a list, as torch_xla's loader gives it
    assert isinstance(batches[0], list) and x.device == y.device == device and x.shape == (8, 3)

    loader = torch.utils.data.DataLoader(torch.arange(10.0), batch_size=2)
    para = pl.ParallelLoader(loader, [device])
    per_device = para.per_device_loader(device)
    assert len(per_device) == 5
    before = sim_state.steps
    got = [batch.cpu().tolist() for batch in per_device]
    assert got == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    assert sim_state.steps - before == 7  # before each of the 6 next() calls, and once more at the end
    # batches already on the device pass through as they are, and collectives take them
    on_device = [{"x": torch.full((2,), float(rank + i), device=device)} for i in range(2)]
    passed = list(pl.MpDeviceLoader(on_device, device))
    assert [b["x"].device for b in passed] == [device, device]
    assert xm.all_gather(passed[1]["x"]).cpu().tolist() == [float(r + 1) for r in range(world_size) for _ in range(2)]
    mp = pl.MpDeviceLoader(loader, device, batches_per_execution=5)
    before = sim_state.steps
    assert len(list(mp)) == 5 and sim_state.steps - before == 2  # one cut per 5 batches, one at the end


@distributed_test(world_size=SIZES, device="xla")
def test_xla_process_group_carries_torch_distributed(rank, world_size):
    import torch.distributed as dist
    import torch_xla
    import torch_xla.distributed.xla_backend

    dist.init_process_group("xla", init_method="xla://")
    assert dist.get_backend() == "xla" and dist.get_world_size() == world_size and dist.get_rank() == rank
    device = torch_xla.device()
    t = torch.full((2,), float(rank + 1), device=device)
    dist.all_reduce(t)
    assert t.device == device and t.cpu().tolist() == [world_size * (world_size + 1) / 2] * 2
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    parts = [torch.empty(2, device=device) for _ in range(world_size)]
    dist.all_gather(parts, torch.full((2,), float(rank), device=device))
    assert [p.cpu().tolist() for p in parts] == [[float(r)] * 2 for r in range(world_size)]
    flat = torch.empty(2 * world_size, device=device)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank), device=device))
    assert flat.cpu().tolist() == [float(r) for r in range(world_size) for _ in range(2)]
    mine = torch.empty(1, device=device)
    dist.reduce_scatter_tensor(mine, torch.arange(float(world_size), device=device))
    assert mine.cpu().item() == rank * world_size
    b = torch.full((3,), float(rank), device=device)
    dist.broadcast(b, src=world_size - 1)
    assert b.cpu().tolist() == [world_size - 1.0] * 3
    swapped = torch.empty(world_size, device=device)
    dist.all_to_all_single(swapped, torch.arange(float(world_size), device=device) + 10 * rank)
    assert swapped.cpu().tolist() == [10.0 * r + rank for r in range(world_size)]
    dist.barrier()
    # a sub-group of the "xla" group
    half = world_size // 2
    first, second = dist.new_group(list(range(half))), dist.new_group(list(range(half, world_size)))
    members = list(range(half)) if rank < half else list(range(half, world_size))
    s = torch.tensor([float(rank)], device=device)
    dist.all_reduce(s, group=first if rank < half else second)
    assert s.cpu().item() == sum(members)
    # torch_xla's refusals
    with pytest.raises(ValueError, match="Invalid reduce op"):
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
    with pytest.raises(AssertionError, match="XLA doesn't support specifying non-empty"):
        dist.all_to_all_single(swapped, swapped.clone(), [1] * world_size, [1] * world_size)
    if device.type == "xla":  # a host tensor in an XLA collective: torch_xla's words
        with pytest.raises(RuntimeError, match="^Expected XLA tensor. Got: CPUFloatType$"):
            dist.all_reduce(torch.ones(2))


@distributed_test(world_size=SIZES, device="xla")
def test_ddp_on_the_xla_process_group_trains_as_optimizer_step(rank, world_size):
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("xla", init_method="xla://")
    device = torch_xla.device()
    steps = 3
    reference, data = _reference_weights(world_size, steps)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
    ddp = DDP(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        x, y = (t.to(device) for t in data[rank][step])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        torch_xla.sync()
    xm.wait_device_ops()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.detach().cpu(), theirs.detach(), rtol=1e-5, atol=1e-6)


@distributed_test(world_size=SIZES, device="xla")
def test_amp_autocast_and_syncfree_optimizers(rank, world_size):
    import torch_xla
    import torch_xla.amp as xamp
    from torch_xla.amp import syncfree

    device = torch_xla.device()
    a, b = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    with xamp.autocast(device):
        assert torch.is_autocast_enabled("xla") and torch.get_autocast_dtype("xla") == torch.bfloat16
        product = a @ b
    if device.type == "xla":  # XLA's TPU policy: matmuls in bfloat16
        assert product.dtype == torch.bfloat16 and product.device == device
    assert not torch.is_autocast_enabled("xla")
    with pytest.warns(UserWarning, match="TPU Autocast only supports dtype of torch.bfloat16"):
        fp16 = xamp.autocast(device, dtype=torch.float16)
    with fp16:
        assert not torch.is_autocast_enabled("xla")
    with pytest.raises(AssertionError, match="torch_xla.autocast is available for XLA:TPU"):
        xamp.autocast("cuda")

    param = torch.nn.Parameter(torch.ones(2, device=device))
    optimizer = syncfree.AdamW([param], lr=0.5)
    param.grad = torch.ones(2, device=device)
    optimizer.step(found_inf=torch.tensor(1.0, device=device))
    assert param.detach().cpu().tolist() == [1.0, 1.0]  # skipped
    optimizer.step(found_inf=torch.tensor(0.0, device=device))
    assert param.detach().cpu().tolist() != [1.0, 1.0]
    with pytest.raises(ValueError, match="found_inf tensor has to be scalar"):
        optimizer.step(found_inf=torch.zeros(2, device=device))
    sgd = syncfree.SGD([param], lr=1.0)
    before = param.detach().cpu().clone()
    sgd.step()
    torch.testing.assert_close(param.detach().cpu(), before - 1.0)


@distributed_test(world_size=SIZES, device="xla")
def test_rng_state(rank, world_size):
    import torch_xla
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(1234)
    assert xm.get_rng_state() == 1234
    with xm.fork_rng():
        xm.set_rng_state(5)
    assert xm.get_rng_state() == 1234
    torch_xla.manual_seed(77)
    assert xm.get_rng_state() == 77


@distributed_test(world_size=SIZES, device="xla")
def test_object_collectives_want_a_gloo_group_and_xm_survives_a_gloo_default_group(rank, world_size):
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    dist.init_process_group("xla", init_method="xla://")
    objects = [None] * world_size
    if torch_xla.device().type == "xla":
        # torch pickles objects into CPU tensors, which torch_xla's process group does not take
        with pytest.raises(RuntimeError, match="is not an XLA tensor. Got: CPUByteType|Got: CPULongType"):
            dist.all_gather_object(objects, {"rank": rank})
    cpu_group = dist.new_group(backend="gloo")
    dist.all_gather_object(objects, {"rank": rank}, group=cpu_group)
    assert objects == [{"rank": r} for r in range(world_size)]

    # A script whose default group is Gloo: xm's collectives still span every core.
    dist.destroy_process_group()
    dist.init_process_group("gloo")
    assert dist.get_backend() == "gloo"
    value = torch.full((2,), float(rank), device=torch_xla.device())
    assert xm.all_reduce(xm.REDUCE_SUM, value).cpu().tolist() == [float(sum(range(world_size)))] * 2
    assert xm.all_gather(value).cpu().tolist() == [float(r) for r in range(world_size) for _ in range(2)]


@distributed_test(world_size=SIZES, device="xla")
def test_broadcast_master_param_reduce_gradients_and_model_wrapper(rank, world_size):
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_multiprocessing as xmp

    device = torch_xla.device()
    torch.manual_seed(rank)  # every core starts from other weights
    wrapped = xmp.MpModelWrapper(torch.nn.Linear(3, 2))
    model = wrapped.to(device)
    assert next(model.parameters()).device == device
    xm.broadcast_master_param(model)
    torch.manual_seed(0)
    master = torch.nn.Linear(3, 2)
    for mine, theirs in zip(model.parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(mine.detach().cpu(), theirs.detach())

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank))
    xm.reduce_gradients(optimizer)
    for p in model.parameters():
        assert p.grad.cpu().unique().tolist() == [pytest.approx(sum(range(world_size)) / world_size)]
    assert [g.data_ptr() for g in xm._fetch_gradients(optimizer)] == [p.grad.data_ptr() for p in model.parameters()]
