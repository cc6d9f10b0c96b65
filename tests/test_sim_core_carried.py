"""The carried collectives' shared part (`accel.sim.core.carried`): one home for both simulated devices' groups."""

import datetime

import pytest
import torch
import torch.distributed as dist

from accel.sim.core import carried
from accel.sim.cuda.nccl import mixed_group as cuda_group
from accel.sim.cuda.nccl import process_group as nccl_group
from harness import distributed_test


def test_given_passes_options_only_when_there_are_some():
    opts = dist.AllreduceOptions()
    assert carried.given(None) == ()
    assert carried.given(opts) == (opts,)


def test_a_carried_group_runs_gloo_of_its_own_and_keeps_its_name():
    group = carried.CarriedGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30))
    assert isinstance(group._gloo, dist.ProcessGroupGloo)
    assert (group.group_name, group.group_desc) == ("", "")
    group._set_group_name("g")
    group._set_group_desc("d")
    assert (group.group_name, group.group_desc) == ("g", "d")
    x = torch.ones(2)
    group._gloo.allreduce([x]).wait()
    work = carried.completed_work([x])
    assert work.is_completed() and work.get_future().value()[0] is x


def test_the_simulated_gpu_groups_are_carried_groups():
    assert issubclass(nccl_group.SimNcclGroup, carried.CarriedGroup)
    assert issubclass(cuda_group.SimCudaGroup, carried.CarriedGroup)
    assert nccl_group.PythonGroup is cuda_group.PythonGroup is carried.PythonGroup


def test_contiguous_writes_a_copy_back_and_passes_a_contiguous_tensor_itself():
    base = torch.zeros(3, 4)
    view = base.t()
    with carried.contiguous(view) as buffer:
        assert buffer.is_contiguous() and buffer is not view
        buffer.copy_(torch.arange(12.0).reshape(4, 3))
    assert torch.equal(base, torch.arange(12.0).reshape(4, 3).t())
    with carried.contiguous(base) as buffer:
        assert buffer is base


class _Recorder(carried.CarriedGroup):
    """A carried group whose new-name collectives say what they were called with."""

    def all_gather_single(self, output, input, opts=None):
        output.copy_(torch.cat(self._gathered(input)))
        return carried.completed_work([output])

    def reduce_scatter_single(self, output, input, opts=None):
        output.fill_(input.numel() + (opts or 0))
        return carried.completed_work([output])

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        output.fill_(len(output_splits) + len(input_splits))
        return carried.completed_work([output])


@distributed_test(world_size=[2, 3])
def test_the_carrier_gathers_broadcasts_and_keeps_torchs_older_names_on_every_rank(rank, world_size):
    import uuid

    token = [uuid.uuid4().hex]
    dist.broadcast_object_list(token)  # a store prefix of this test's own on every rank
    store = dist.PrefixStore(f"carried-test/{token[0]}/", dist.distributed_c10d._get_default_store())
    group = _Recorder(store, rank, world_size, datetime.timedelta(seconds=60))

    # every member's tensor, in rank order, from a non-contiguous host tensor
    mine = (torch.arange(6.0).reshape(2, 3) + 10 * rank).t()
    parts = group._gathered(mine)
    assert [part.tolist() for part in parts] == [
        (torch.arange(6.0).reshape(2, 3) + 10 * r).t().tolist() for r in range(world_size)
    ]
    with pytest.raises(RuntimeError):  # Gloo refuses a count other than the group's size
        group._gathered(mine, world_size + 1)

    # the root's values into every member's non-contiguous view, the rest of its base untouched
    root = world_size - 1
    base = torch.full((3, 4), float(rank))
    view = base[:, 1:3]
    group._broadcast(view, root)
    assert torch.equal(view, torch.full((3, 2), float(root)))
    assert torch.equal(base[:, 0], torch.full((3,), float(rank))) and torch.equal(base[:, 3], base[:, 0])

    # torch's older names and the coalesced calls reach the group's own collectives
    out = torch.zeros(2 * world_size)
    group._allgather_base(out, torch.full((2,), float(rank)))
    assert out.tolist() == [float(r) for r in range(world_size) for _ in range(2)]
    outs = [torch.zeros(world_size), torch.zeros(2 * world_size)]
    work = group.allgather_into_tensor_coalesced(outs, [torch.full((1,), 1.0 + rank), torch.full((2,), 2.0)])
    assert work.is_completed()
    assert outs[0].tolist() == [1.0 + r for r in range(world_size)] and outs[1].tolist() == [2.0] * 2 * world_size
    single = torch.zeros(1)
    group._reduce_scatter_base(single, torch.zeros(5), 1)
    assert single.item() == 6
    pair = [torch.zeros(1), torch.zeros(1)]
    group.reduce_scatter_tensor_coalesced(pair, [torch.zeros(3), torch.zeros(4)])
    assert [t.item() for t in pair] == [3, 4]
    group.alltoall_base(single, single, [1] * world_size, [1] * world_size)
    assert single.item() == 2 * world_size
