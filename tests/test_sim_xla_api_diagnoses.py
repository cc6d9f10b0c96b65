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
    others = "rank 1" if world_size == 2 else f"ranks 1–{world_size - 1}"
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
    others = "rank 1" if world_size == 2 else f"ranks 1–{world_size - 1}"
    here = os.path.basename(HERE)
    assert error.summary.startswith(
        f"collective mismatch: rank 0 all_reduce(float32[4], op=SUM) at {here}:{_line('LINE-XM-REDUCE')}; "
        f"{others} all_gather(float32[4]) at {here}:{_line('LINE-XM-GATHER')}"
    )
    assert set(error.failures) == set(range(world_size))
    assert all(isinstance(f.exception, CollectiveMismatch) for f in error.failures.values())
