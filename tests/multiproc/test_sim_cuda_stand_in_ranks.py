"""Ranks that stand in for others: a shapes-only world of which only some ranks are run.

`accel.sim.launch(..., shapes_only=True, only_ranks=...)` and `accel launch --simulate cuda
--shapes_only --only_ranks ...` run only the ranks named, each as that rank of the full world,
with collectives that complete without the others (`accel.sim.cuda.nccl.stand_in`). What a planner
reads from such a run must be what the full run gives: each rank's GPU memory, counted by the
caching allocator, to the byte and in every counter of `torch.cuda.memory_stats()`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import accel.sim
from accel.commands import cli
from accel.sim.runtime.output import parse_ranks

#: starts whole processes as a user would: `make test-frameworks` (CI's second step) runs these
pytestmark = pytest.mark.processes

WORLD = 4
TIMEOUT = 300


# -- a step of FSDP2 x tensor parallelism on a 2 x 2 mesh ---------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """An embedding whose rows do not split evenly (the ranks' shards differ), blocks, an output layer."""

    def __init__(self, vocab: int = 1003, dim: int = 256, hidden: int = 1024, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def fsdp_tp_step() -> dict:
    """One bf16 AdamW step of `Net`, tensor-parallel over "tp" and sharded by FSDP2 over "dp"; this rank's
    memory counters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    model.to_empty(device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(1003, (4, 64), device="cuda")
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    # free memory: the card's less what PyTorch reserved and what it does not count (NCCL's communicators, ...)
    free, _ = torch.cuda.mem_get_info()
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "stats": torch.cuda.memory_stats(), "free": free}


@functools.cache
def full_run() -> list[dict]:
    """The step on every rank of the world, one process each (the reference)."""
    return accel.sim.launch(fsdp_tp_step, world_size=WORLD, device="cuda", shapes_only=True, timeout=TIMEOUT)


@pytest.mark.parametrize("only_ranks", [[0, 3], "1", "0-3"], ids=["first-and-last", "one", "each-alone"])
def test_ranks_run_alone_count_memory_as_the_full_run_does(only_ranks):
    ran = accel.sim.launch(
        fsdp_tp_step, world_size=WORLD, device="cuda", shapes_only=True, only_ranks=only_ranks, timeout=TIMEOUT
    )
    full = full_run()
    expected = sorted(parse_ranks(only_ranks) if isinstance(only_ranks, str) else only_ranks)
    assert [record["rank"] for record in ran] == expected
    assert all(record["world"] == WORLD for record in ran)
    for record in ran:
        # every counter of the caching allocator: peaks, current, allocation counts, segments
        assert record["stats"] == full[record["rank"]]["stats"], record["rank"]
        assert record["free"] == full[record["rank"]]["free"], record["rank"]  # the same communicators
    # the ranks' shards differ (1003 rows), so each rank was compared with its own
    assert full[0]["stats"]["allocated_bytes.all.peak"] != full[3]["stats"]["allocated_bytes.all.peak"]


# -- what is refused ------------------------------------------------------------------------------------


def test_only_ranks_is_refused_without_shapes_only():
    with pytest.raises(ValueError, match="needs shapes only .* with values every result would be wrong"):
        accel.sim.launch(print, world_size=WORLD, device="cuda", only_ranks=[0])
    with pytest.raises(ValueError, match=r"rank\(s\) \[4\] outside the world of 4"):
        accel.sim.launch(print, world_size=WORLD, device="cuda", shapes_only=True, only_ranks=[0, 4])
    with pytest.raises(ValueError, match="injected faults"):
        accel.sim.launch(
            print, world_size=WORLD, device="cuda", shapes_only=True, only_ranks=[0], faults=["kill:rank=0"]
        )


def test_the_launcher_refuses_only_ranks_without_shapes_only(tmp_path, capsys):
    script = tmp_path / "nothing.py"
    script.write_text("pass\n")
    assert cli.main(["launch", "--simulate", "cuda", "--num_processes", "4", "--only_ranks", "0", str(script)]) == 2
    assert "--only_ranks 0: only_ranks runs some ranks without the others" in capsys.readouterr().err
    assert cli.main(["launch", "--only_ranks", "0", str(script)]) == 2
    assert "--only_ranks applies to simulated runs only" in capsys.readouterr().err


# -- subgroups and collectives without the absent ranks ----------------------------------------------


def subgroups() -> dict:
    """A 2 x 2 DeviceMesh, `new_group` and `split_group`: their ranks, and collectives on each."""
    from torch.distributed.device_mesh import init_device_mesh

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))  # adopts the simulator's, bound
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = next(group for group in pairs if group != dist.GroupMember.NON_GROUP_MEMBER)
    split = dist.split_group(split_ranks=[[0, 2], [1, 3]])
    found = {}
    for name, group in (
        ("dp", mesh["dp"].get_group()),
        ("tp", mesh["tp"].get_group()),
        ("new", mine),
        ("split", split),
    ):
        shard = torch.empty(1 << 16, dtype=torch.bfloat16, device="cuda")  # 128 KiB: no data
        gathered = torch.empty(2 << 16, dtype=torch.bfloat16, device="cuda")
        dist.all_gather_into_tensor(gathered, shard, group=group)
        count = torch.ones(1, device="cuda")
        dist.all_reduce(count, group=group)
        found[name] = (dist.get_process_group_ranks(group), dist.get_backend(group), count.item(), gathered.shape)
    dist.barrier()
    return {"rank": dist.get_rank(), "groups": found, "peak": torch.cuda.max_memory_allocated()}


def test_subgroups_of_a_2x2_mesh_are_made_without_the_absent_ranks():
    ran = accel.sim.launch(subgroups, world_size=WORLD, device="cuda", shapes_only=True, only_ranks=[1, 2])
    full = accel.sim.launch(subgroups, world_size=WORLD, device="cuda", shapes_only=True, timeout=TIMEOUT)
    assert ran == [full[1], full[2]]
    one, two = ran
    assert one["groups"]["dp"][0] == [1, 3] and one["groups"]["tp"][0] == [0, 1] and one["groups"]["split"][0] == [1, 3]
    assert two["groups"]["new"] == ([2, 3], "nccl", 2.0, torch.Size([2 << 16]))


def values() -> dict:
    """Small tensors (they keep their data) through each collective: as if every rank held this rank's."""
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    total, top, mean = (torch.full((2,), float(rank + 1), device="cuda") for _ in range(3))
    dist.all_reduce(total)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    gathered = torch.zeros(world * 2, device="cuda")
    dist.all_gather_into_tensor(gathered, torch.tensor([rank, -rank], dtype=torch.float32, device="cuda"))
    scattered = torch.zeros(2, device="cuda")
    dist.reduce_scatter_tensor(scattered, torch.arange(world * 2, dtype=torch.float32, device="cuda"))
    exchanged = torch.zeros(world, device="cuda")
    dist.all_to_all_single(exchanged, torch.arange(world, dtype=torch.float32, device="cuda") + 10 * rank)
    sent = torch.full((1,), float(rank), device="cuda")
    dist.broadcast(sent, src=0)
    objects: list = [None] * world
    dist.all_gather_object(objects, {"rank": rank})
    dist.barrier()
    rows = [t.tolist() for t in (total, top, mean, gathered, scattered, exchanged, sent)]
    return {"rows": rows, "objects": objects}


def test_collectives_give_what_ranks_holding_the_same_would():
    (one,) = accel.sim.launch(values, world_size=WORLD, device="cuda", shapes_only=True, only_ranks=[1])
    assert one["rows"] == [
        [8.0, 8.0],  # 4 ranks holding 2
        [2.0, 2.0],
        [2.0, 2.0],
        [1.0, -1.0] * 4,
        [8.0, 12.0],  # this rank's part (2, 3) of 4 equal inputs
        [11.0] * 4,  # each rank sends this one its part for rank 1
        [1.0],  # the root's tensor is taken to be this rank's
    ]
    assert one["objects"] == [{"rank": 1}] * 4


def waits_for_others() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.new_group([0, 1, 2, 3], backend="gloo")  # Gloo connects to each member through the store


def test_what_waits_for_an_absent_rank_fails_at_once_saying_so():
    with pytest.raises(accel.sim.DistributedFailure) as failure:
        accel.sim.launch(
            waits_for_others, world_size=WORLD, device="cuda", shapes_only=True, only_ranks=[2], timeout=TIMEOUT
        )
    (report,) = failure.value.failures.values()
    assert failure.value.failures.keys() == {2}
    assert "which only ranks this run does not run would set (rank 2 of 4 run (only_ranks))" in report.message
    assert "a Gloo group the script creates" in report.message


def receives_from_the_previous_stage() -> str:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    activations = torch.zeros(4, device="cuda")
    dist.recv(activations, src=1)  # values mean nothing in shapes only: the tensor is left as it was
    shape = torch.zeros(2, dtype=torch.int64, device="cuda")
    dist.recv(shape, src=1)  # the next stage's shape: nobody here can say it
    return "received"


def test_a_stand_in_that_receives_sizes_point_to_point_fails_saying_so():
    with pytest.raises(accel.sim.DistributedFailure) as failure:
        accel.sim.launch(
            receives_from_the_previous_stage, world_size=WORLD, device="cuda", shapes_only=True, only_ranks=[2]
        )
    (report,) = failure.value.failures.values()
    assert "receives torch.int64 values ((2,)) from rank 1 of the group point to point" in report.message
    assert "Run every rank of a pipeline-parallel layout (no --only_ranks)" in report.message


# -- the launcher ----------------------------------------------------------------------------------------

SCRIPT = """
import os, torch, torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
x = torch.empty(1 << 20, device="cuda")
dist.all_reduce(x)
where = torch.cuda.current_device()
print(f"rank {dist.get_rank()} of {dist.get_world_size()} (RANK={os.environ['RANK']}) on cuda:{where}")
"""


def test_the_end_of_run_output_names_the_ranks_stood_for(tmp_path, capfd):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    argv = ["launch", "--simulate", "cuda", "--num_processes", "8", "--shapes_only", "--only_ranks", "0,4,7"]
    assert cli.main([*argv, str(script)]) == 0
    out, err = capfd.readouterr()
    for rank in (0, 4, 7):
        assert f"[rank {rank}] rank {rank} of 8 (RANK={rank}) on cuda:{rank}" in out
        assert (
            f"[rank {rank}] accel.sim: cuda:{rank} (NVIDIA H100 80GB HBM3, 79.19 GiB): peak allocated 4.00 MiB" in out
        )
    assert "[rank 1]" not in out + err
    assert (
        "accel.sim: 3 of 8 ranks were run, each standing in for others: rank 0 for ranks 0–3, rank 4 for ranks 4–6, "
        "rank 7 for rank 7." in err
    )
    assert "assumed: a rank not run does what the rank standing for it does (a symmetric layout" in err


@pytest.mark.frameworks
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_torchtitans_llama_under_fsdp_x_tp_counts_as_the_full_run(tmp_path, capfd):
    """tests/programs/plan_llama.py (torchtitan's Llama 3, parallelised by torchtitan) at small shapes."""
    program = str(Path(__file__).resolve().parents[1] / "programs" / "plan_llama.py")
    shapes = ["--dim", "256", "--layers", "2", "--heads", "4", "--kv_heads", "2", "--multiple_of", "64"]
    shapes += ["--vocab", "1000", "--seq_len", "256", "--tp_degree", "2"]
    base = ["launch", "--simulate", "cuda", "--num_processes", "4", "--shapes_only"]
    assert cli.main([*base, program, *shapes, "--out", str(tmp_path / "full")]) == 0
    assert cli.main([*base, "--only_ranks", "0,3", program, *shapes, "--out", str(tmp_path / "part")]) == 0
    capfd.readouterr()
    for rank in (0, 3):
        full = json.loads((tmp_path / "full" / f"rank{rank}.json").read_text())
        part = json.loads((tmp_path / "part" / f"rank{rank}.json").read_text())
        assert (part["peak_allocated"], part["peak_reserved"]) == (full["peak_allocated"], full["peak_reserved"])
    assert not (tmp_path / "part" / "rank1.json").exists()
