"""Fake XLA: the stand-in `torch_xla` on real simulated ranks, and the real XLA backend on it.

One probe per world size runs every `xla_model` function, the runtime, the `xla` process
group, `MpDeviceLoader` and `XLABackend`'s methods in each rank; the tests assert on what
every rank saw. `torch_xla` must stay unimportable in this (non-rank) process.
"""

import importlib.util
import sys

import pytest
import torch

from accel.sim import launch
from accel.sim.devices import FAKE_XLA_PATH


def test_torch_xla_is_not_importable_outside_simulated_ranks(probed):
    # `probed` ran xla ranks from this process: they must not have installed anything here.
    assert importlib.util.find_spec("torch_xla") is None
    assert FAKE_XLA_PATH not in sys.path and "torch_xla" not in sys.modules


def test_unknown_device_is_refused():
    from accel.sim.devices import DEVICES, prepare_rank, reset_rank

    assert DEVICES == ("cpu", "cuda", "xla")
    for call in (prepare_rank, reset_rank):
        with pytest.raises(ValueError, match="cpu, cuda, xla"):
            call("tpu")


def xla_probe(tmp_dir):
    """Runs in every rank: each torch_xla function the simulator offers, and accel's XLA backend."""
    import contextlib
    import io
    import os

    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    from accel.sim.devices import reset_rank
    from accel.state import PartialState

    state = PartialState()
    hw = state.hardware
    rank, world = xr.global_ordinal(), xr.world_size()
    seen = {
        "simulated": torch_xla.SIMULATED,
        "type": str(state.distributed_type),
        "hw": type(hw).__name__,
        "pg_backend": dist.get_backend(),
        "device": str(torch_xla.device()),
        "xm_device": str(xm.xla_device()),
        "state_device": str(state.device),
        "hw_kind": xm.xla_device_hw(torch_xla.device()),
        "removed": [hasattr(xm, name) for name in ("xrt_world_size", "get_ordinal")],
        "ordinals": (rank, xm.get_local_ordinal(), world, xm.is_master_ordinal(), xm.is_master_ordinal(local=False)),
        "runtime": (
            xr.global_ordinal(),
            xr.local_ordinal(),
            xr.world_size(),
            xr.local_process_count(),
            xr.device_type(),
        ),
    }
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        xm.master_print("hello", rank)
    seen["printed"] = printed.getvalue()

    device = torch_xla.device()
    mine = torch.tensor([[rank, rank + 0.5]], device=device)
    seen["gather0"] = xm.all_gather(mine, dim=0).tolist()
    seen["gather1"] = xm.all_gather(mine, dim=1).tolist()
    out = torch.empty(world, 2, device=device)
    seen["gather_out"] = xm.all_gather(mine, output=out) is out and out.tolist() == seen["gather0"]
    value = torch.tensor([rank + 1.0], device=device)
    seen["reduce"] = {
        kind: xm.all_reduce(kind, value).item() for kind in (xm.REDUCE_SUM, xm.REDUCE_MUL, xm.REDUCE_MIN, xm.REDUCE_MAX)
    }
    seen["reduce_bits"] = (
        xm.all_reduce(xm.REDUCE_AND, torch.tensor([3 | (1 << (rank + 2))], device=device)).item(),
        xm.all_reduce(xm.REDUCE_OR, torch.tensor([1 << rank], device=device)).item(),
    )
    seen["input_untouched"] = value.item() == rank + 1.0
    seen["scaled"] = xm.all_reduce(xm.REDUCE_SUM, value, scale=1.0 / world).item()
    pair = [torch.tensor([1.0], device=device), torch.tensor([float(rank)], device=device)]
    returned = xm.all_reduce(xm.REDUCE_SUM, pair)
    seen["in_place"] = (returned is pair, [t.item() for t in pair])
    with pytest.raises(ValueError, match="Invalid reduce type"):
        xm.all_reduce("avg", value)
    target = [torch.full((2,), float(rank), device=device)]
    xm.collective_broadcast(target, root_ordinal=world - 1)
    seen["broadcast"] = target[0].tolist()
    seen["rendezvous"] = xm.rendezvous("probe", f"r{rank}".encode())
    seen["mesh"] = xm.mesh_reduce("mesh", {"r": rank}, lambda items: sorted(item["r"] for item in items))
    # As torch_xla's: the tag names the rendezvous in logs only; replicas meet whatever its tag.
    seen["tag_mismatch"] = xm.rendezvous(f"tag-of-{rank}", b"x")

    # optimizer_step averages gradients over replicas, then steps.
    param = torch.nn.Parameter(torch.zeros(3, device=device))
    optimizer = torch.optim.SGD([param], lr=1.0)
    (param * (rank + 1)).sum().backward()
    xm.optimizer_step(optimizer)
    seen["param"] = param.detach().tolist()

    steps_before = torch_xla._sim_state.steps
    with pytest.warns(DeprecationWarning, match="Use torch_xla.sync instead"):
        xm.mark_step()
    torch_xla.sync()
    seen["steps"] = torch_xla._sim_state.steps - steps_before

    path = os.path.join(tmp_dir, "saved.pt")
    xm.save({"w": torch.tensor([float(rank)], device=device)}, path)  # master only
    xm.rendezvous("saved")  # as torch_xla's docs say: xm.save does not wait
    seen["saved"] = torch.load(path)["w"].item()

    xm.set_rng_state(77)
    seen["rng"] = xm.get_rng_state()

    loader = torch.utils.data.DataLoader(torch.arange(10.0), batch_size=4)
    device_loader = MpDeviceLoader(loader, device)
    before = torch_xla._sim_state.steps
    batches = [batch.tolist() for batch in device_loader]
    seen["loader"] = (len(device_loader), batches, torch_xla._sim_state.steps - before)

    # accel's real XLA backend on top of it.
    gathered = torch.empty(world, device=device)
    hw.all_gather_into(gathered, torch.tensor([float(rank)], device=device))
    seen["hw_gather"] = gathered.tolist()
    seen["hw_reduce"] = hw.all_reduce(torch.tensor([float(rank)], device=device), op="max").item()
    seen["hw_broadcast"] = hw.broadcast(torch.tensor([float(rank)], device=device), src=1).item()
    seen["hw_objects"] = hw.all_gather_object(rank)
    seen["hw_bcast_objects"] = hw.broadcast_object_list([rank], src=1)
    hw.barrier()
    seen["hw_loader"] = type(hw.wrap_dataloader(loader, state.device)).__name__
    model = torch.nn.Linear(2, 1)
    seen["hw_model_unwrapped"] = hw.wrap_model(model, state.device, {}) is model
    hw.manual_seed(5)
    seen["hw_rng"] = (xm.get_rng_state(), hw.get_rng_state().item())
    hw.set_rng_state(torch.tensor(9))
    seen["hw_rng_set"] = xm.get_rng_state()

    reset_rank("xla")
    seen["after_reset"] = (xm.get_rng_state(), torch_xla._sim_state.steps, os.environ["ACCEL_BACKEND"])

    import torch_xla.distributed.xla_multiprocessing as xmp

    calls = []
    xmp.spawn(lambda index, tag: calls.append((index, tag)), args=("go",))
    seen["spawn"] = calls
    dist.barrier()
    return seen


@pytest.fixture(scope="module", params=[2, 4])
def probed(request, tmp_path_factory):
    world = request.param
    return world, launch(xla_probe, args=(str(tmp_path_factory.mktemp("xla")),), world_size=world, device="xla")


def test_state_and_topology(probed):
    world, seen = probed
    for rank, s in enumerate(seen):
        assert s["simulated"] and s["type"] == "XLA" and s["hw"] == "XLABackend"
        assert s["pg_backend"] == "xla" and s["device"] == s["state_device"] == s["xm_device"]
        assert s["removed"] == [False, False]  # gone from today's torch_xla
        assert s["hw_kind"] == "TPU"
        assert s["ordinals"] == (rank, rank, world, rank == 0, rank == 0)
        assert s["runtime"] == (rank, rank, world, world, "TPU")
        assert s["printed"] == ("hello 0\n" if rank == 0 else "")


def test_xla_model_collectives(probed):
    world, seen = probed
    factorial = 1
    for n in range(2, world + 1):
        factorial *= n
    bits_and = 3 & min((1 << (r + 2)) | 3 for r in range(world))
    for s in seen:
        assert s["gather0"] == [[r, r + 0.5] for r in range(world)]
        assert s["gather1"] == [[v for r in range(world) for v in (r, r + 0.5)]]
        assert s["gather_out"]
        assert s["reduce"] == {"sum": world * (world + 1) / 2, "mul": factorial, "min": 1, "max": world}
        assert s["reduce_bits"] == (bits_and, (1 << world) - 1)
        assert s["input_untouched"] and s["scaled"] == pytest.approx((world + 1) / 2)
        assert s["in_place"] == (True, [world, world * (world - 1) / 2])
        assert s["broadcast"] == [world - 1.0] * 2
        assert s["rendezvous"] == [f"r{r}".encode() for r in range(world)]
        assert s["mesh"] == list(range(world))
        assert s["tag_mismatch"] == [b"x"] * world


def test_training_helpers(probed):
    world, seen = probed
    mean_grad = (world + 1) / 2
    for s in seen:
        assert s["param"] == [-mean_grad] * 3
        assert s["steps"] == 2
        assert s["saved"] == 0.0  # written by the master replica only
        assert s["rng"] == 77
        # 3 batches of a 10-item loader; as torch_xla's, each next() cuts the step before (4 calls), and the
        # one that finds the loader exhausted cuts one more
        assert s["loader"] == (3, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], 5)


def test_accel_xla_backend_runs_unchanged(probed):
    world, seen = probed
    for rank, s in enumerate(seen):
        assert s["hw_gather"] == list(map(float, range(world)))
        assert s["hw_reduce"] == world - 1 and s["hw_broadcast"] == 1.0
        assert s["hw_objects"] == list(range(world)) and s["hw_bcast_objects"] == [1]
        assert s["hw_loader"] == "MpDeviceLoader" and s["hw_model_unwrapped"]
        assert s["hw_rng"] == (5, 5) and s["hw_rng_set"] == 9
        assert s["after_reset"] == (101, 0, "xla")
        assert s["spawn"] == [(rank, "go")]


def lone_replica_probe(tmp_dir):
    """One rank, no process group: torch_xla's collectives are the identity, as on one core."""
    import os

    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm

    from accel.state import PartialState

    state = PartialState()
    value = torch.tensor([2.0, 3.0], device=torch_xla.device())
    path = os.path.join(tmp_dir, "one.pt")
    xm.save({"v": value}, path)
    import torch_xla.distributed.xla_multiprocessing as xmp

    calls = []
    torch_xla.launch(lambda index: calls.append(("debug", index)), debug_single_process=True)
    result = xmp.spawn(lambda index, x: calls.append(("one", index, x)) or "fn's result", args=(5,), nprocs=1)
    param = torch.nn.Parameter(torch.ones(2, device=torch_xla.device()))
    param.grad = torch.full((2,), 0.5, device=torch_xla.device())
    xm.optimizer_step(torch.optim.SGD([param], lr=1.0))
    return {
        "type": str(state.distributed_type),
        "group_size": dist.get_world_size() if dist.is_initialized() else None,
        "reduce": xm.all_reduce(xm.REDUCE_SUM, value, scale=0.5).tolist(),
        "gather": xm.all_gather(value).tolist(),
        "rendezvous": xm.rendezvous("alone", b"p"),
        "mesh": xm.mesh_reduce("alone", 4, sum),
        "saved": torch.load(path)["v"].tolist(),
        "param": param.detach().cpu().tolist(),
        "single_process": (calls, result),
    }


def test_a_lone_replica_works_in_its_group_of_one(tmp_path):
    # As every distributed test base does, the simulator gives one rank a process group of size 1.
    (seen,) = launch(lone_replica_probe, args=(str(tmp_path),), world_size=1, device="xla")
    assert seen == {
        "type": "XLA",
        "group_size": 1,
        "reduce": [2.0, 3.0],  # as torch_xla's: one replica, no reduction and no scale
        "gather": [2.0, 3.0],
        "rendezvous": [b"p"],
        "mesh": 4,
        "saved": [2.0, 3.0],
        "param": [0.5, 0.5],
        # nprocs=1 runs fn in this process and returns its result, as torch_xla's
        "single_process": ([("debug", 0), ("one", 0, 5)], "fn's result"),
    }


def accelerate_probe():
    import accelerate

    state = accelerate.PartialState()
    value = torch.tensor([float(state.process_index)], device=state.device)
    return str(state.distributed_type), state.num_processes, accelerate.utils.gather(value).tolist()


def test_accelerate_itself_runs_on_simulated_tpu_cores():
    # The peer's own state set-up (set_replication, supported devices, ordinals) takes its TPU branch.
    pytest.importorskip("accelerate")
    seen = launch(accelerate_probe, world_size=2, device="xla", timeout=120)
    assert seen == [("DistributedType.XLA", 2, [0.0, 1.0])] * 2
