"""TPU bugs in torch_xla code fail with a report on simulated TPU cores, not a hang.

On a TPU, an `xm` collective that only some cores reach hangs the job (the others never
compile the matching graph); cores calling different collectives hang or corrupt. On
simulated cores, `xm`'s collectives run through `torch.distributed` on the "xla" process
group, so the simulator's collective check and deadlock detection name them.
"""

import os

import pytest

from accel.sim import DistributedDeadlock, DistributedFailure, launch
from accel.sim.diagnoses.failures import CollectiveMismatch

HERE = os.path.abspath(__file__)


def _line(marker):
    with open(HERE) as handle:
        for number, line in enumerate(handle, 1):
            if f"# {marker}" in line and "def _line" not in line:
                return number
    raise AssertionError(marker)


def only_master_reduces():
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    loss = torch.ones(2, device=torch_xla.device())
    if xr.global_ordinal() == 0:
        xm.all_reduce(xm.REDUCE_SUM, loss)  # LINE-LONELY-XM


def only_master_meets():
    import torch_xla.core.xla_model as xm

    if xm.is_master_ordinal():
        xm.rendezvous("checkpoint saved")  # LINE-LONELY-RENDEZVOUS


def reduce_or_gather():
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    value = torch.ones(4, device=torch_xla.device())
    if xr.global_ordinal() == 0:
        xm.all_reduce(xm.REDUCE_SUM, value)  # LINE-XM-REDUCE
    else:
        xm.all_gather(value)  # LINE-XM-GATHER


@pytest.mark.parametrize("world_size", [2, 4])
def test_an_xm_collective_only_some_cores_reach_is_a_deadlock(world_size):
    with pytest.raises(DistributedDeadlock) as info:
        launch(only_master_reduces, world_size=world_size, device="xla", timeout=120)
    others = _others(world_size)
    assert info.value.summary.startswith(
        f"deadlock: rank 0 waits in all_reduce (its collective #1) at {HERE}:{_line('LINE-LONELY-XM')}; "
        f"{others} already returned"
    )
    assert list(info.value.failures) == [0]
    assert f"line {_line('LINE-LONELY-XM')} in only_master_reduces" in info.value.failures[0].stack


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rendezvous_only_the_master_reaches_is_a_deadlock(world_size):
    with pytest.raises(DistributedDeadlock) as info:
        launch(only_master_meets, world_size=world_size, device="xla", timeout=120)
    assert info.value.summary.startswith(
        f"deadlock: rank 0 waits in all_gather (its collective #1) at {HERE}:{_line('LINE-LONELY-RENDEZVOUS')}; "
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_cores_calling_different_xm_collectives_fail_at_once_naming_each(world_size):
    with pytest.raises(DistributedFailure) as info:
        launch(reduce_or_gather, world_size=world_size, device="xla", timeout=120)
    error = info.value
    others = _others(world_size)
    here = os.path.basename(HERE)
    assert error.summary.startswith(
        f"collective mismatch: rank 0 all_reduce(float32[4], op=SUM) at {here}:{_line('LINE-XM-REDUCE')}; "
        f"{others} all_gather(float32[4]) at {here}:{_line('LINE-XM-GATHER')}"
    )
    _every_rank_saw_the_mismatch(error, world_size)


def _others(world_size):
    return "rank 1" if world_size == 2 else f"ranks 1–{world_size - 1}"


def _every_rank_saw_the_mismatch(error, world_size):
    assert set(error.failures) == set(range(world_size))
    assert all(isinstance(f.exception, CollectiveMismatch) for f in error.failures.values())


def _pairs(world_size):
    return [[r, r + 1] for r in range(0, world_size, 2)]  # [[0, 1]] on 2 cores, [[0, 1], [2, 3]] on 4


def first_grouped_reduce_on_some_cores():
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    world = xr.world_size()
    value = torch.ones(2, device=torch_xla.device())
    if xr.global_ordinal() < max(1, world // 2):
        xm.all_reduce(xm.REDUCE_SUM, value, groups=_pairs(world))  # LINE-LONELY-GROUPS


def first_xm_reduce_on_a_gloo_default_group_on_one_core():
    import torch
    import torch.distributed as dist
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    dist.destroy_process_group()
    dist.init_process_group("gloo")
    value = torch.ones(2, device=torch_xla.device())
    if xr.global_ordinal() == 0:
        xm.all_gather(value)  # LINE-LONELY-XLA-GROUP


def grouped_reduce_or_plain_reduce():
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    value = torch.ones(4, device=torch_xla.device())
    if xr.global_ordinal() == 0:
        xm.all_reduce(xm.REDUCE_SUM, value, groups=_pairs(xr.world_size()))  # LINE-GROUPED-REDUCE
    else:
        xm.all_reduce(xm.REDUCE_SUM, value)  # LINE-PLAIN-REDUCE


def grouped_collectives():
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    rank, world = xr.global_ordinal(), xr.world_size()
    value = torch.full((2,), float(rank + 1), device=torch_xla.device())
    alone = [[r] for r in range(world)]
    results = {
        "pairs": xm.all_reduce(xm.REDUCE_SUM, value, groups=_pairs(world)).cpu().tolist(),
        "alone": xm.all_reduce(xm.REDUCE_SUM, value, groups=alone).cpu().tolist(),
        "gathered": xm.all_gather(value, groups=_pairs(world)).cpu().tolist(),
        "again": xm.all_reduce(xm.REDUCE_MAX, value, groups=_pairs(world)).cpu().tolist(),
    }
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_new_replica_groups_only_some_cores_reach_are_a_deadlock(world_size):
    # The first xm call with these groups creates their process groups, which every core must
    # take part in (on a TPU, every replica runs the collective): reported at once, not a hang.
    with pytest.raises(DistributedDeadlock) as info:
        launch(first_grouped_reduce_on_some_cores, world_size=world_size, device="xla", timeout=120)
    where = f"at {HERE}:{_line('LINE-LONELY-GROUPS')}"
    waiting = "; ".join(
        f"rank {rank} waits in all_reduce with new replica groups (its collective #1) {where}"
        for rank in range(max(1, world_size // 2))
    )
    returned = "rank 1" if world_size == 2 else "ranks 2–3"
    assert info.value.summary.startswith(f"deadlock: {waiting}; {returned} already returned")
    assert list(info.value.failures) == list(range(max(1, world_size // 2)))
    assert f"line {_line('LINE-LONELY-GROUPS')} in first_grouped_reduce_on_some_cores" in info.value.failures[0].stack


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_xla_group_of_a_gloo_script_only_one_core_reaches_is_a_deadlock(world_size):
    with pytest.raises(DistributedDeadlock) as info:
        launch(first_xm_reduce_on_a_gloo_default_group_on_one_core, world_size=world_size, device="xla", timeout=120)
    others = _others(world_size)
    assert info.value.summary.startswith(
        f"deadlock: rank 0 waits in all_gather with a new group of all replicas (its collective #1) "
        f"at {HERE}:{_line('LINE-LONELY-XLA-GROUP')}; {others} already returned"
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_new_replica_groups_on_one_core_and_no_groups_on_the_others_fail_naming_each(world_size):
    with pytest.raises(DistributedFailure) as info:
        launch(grouped_reduce_or_plain_reduce, world_size=world_size, device="xla", timeout=120)
    error = info.value
    others = _others(world_size)
    here = os.path.basename(HERE)
    assert error.summary.startswith(
        f"collective mismatch: rank 0 all_reduce with new replica groups {_pairs(world_size)} at "
        f"{here}:{_line('LINE-GROUPED-REDUCE')}; {others} all_reduce(float32[4], op=SUM) at "
        f"{here}:{_line('LINE-PLAIN-REDUCE')}"
    )
    _every_rank_saw_the_mismatch(error, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_new_replica_groups_every_core_reaches_give_each_group_its_values(world_size):
    results = launch(grouped_collectives, world_size=world_size, device="xla", timeout=120)
    for rank, result in enumerate(results):
        pair = [rank - rank % 2 + 1, rank - rank % 2 + 2]  # the values of this core's pair
        assert result == {
            "pairs": [float(sum(pair))] * 2,
            "alone": [float(rank + 1)] * 2,
            "gathered": [float(v) for v in pair for _ in range(2)],
            "again": [float(max(pair))] * 2,
        }
