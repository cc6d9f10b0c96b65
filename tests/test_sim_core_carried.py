"""The carried collectives' shared part (`accel.sim.core.carried`): one home for both simulated devices' groups."""

import datetime

import torch
import torch.distributed as dist

from accel.sim.core import carried
from accel.sim.cuda import group as cuda_group
from accel.sim.cuda import nccl_group


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
