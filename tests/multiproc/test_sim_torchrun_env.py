"""A simulated rank sees torchrun's environment, and the script may create its own process group.

The simulator creates the default group before the test body (or script) runs; the body
then calls `init_process_group` as a torchrun script does, and gets the group it asked
for: adopted when the simulator's answers the request, replaced when it does not,
refused where the hardware could not serve it.
"""

import inspect
import re

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]
DEVICES = ["cpu", "cuda", "xla"]


def _torchrun_variables():
    """The variable names torch's elastic agent sets for each worker, read from its source."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    names = set(re.findall(r'"([A-Z][A-Z_]+)":', inspect.getsource(LocalElasticAgent._start_workers)))
    assert {"RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} <= names, names  # the parse still works
    # set by helpers the agent calls, and by torchrun's launcher for the agent (inherited)
    return names | {"LOCAL_RANK", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE"}


@distributed_test(world_size=SIZES, device=DEVICES)
def test_every_torchrun_variable_with_torchrun_values(rank, world_size):
    import os

    import torch.distributed as dist

    missing = sorted(name for name in _torchrun_variables() if name not in os.environ)
    assert not missing, f"torchrun sets {missing}, a simulated rank does not"
    env = os.environ
    assert (env["RANK"], env["LOCAL_RANK"], env["ROLE_RANK"]) == (str(rank),) * 3
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["ROLE_WORLD_SIZE"]) == (str(world_size),) * 3
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"]) == ("0", "1", "default")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("0", "0")
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert env["OMP_NUM_THREADS"]
    shared = [None] * world_size
    # torch_xla's group carries XLA tensors only: object collectives take a Gloo group there, as on a TPU
    group = dist.new_group(backend="gloo") if dist.get_backend() == "xla" else None
    dist.all_gather_object(shared, (env["TORCHELASTIC_RUN_ID"], env["MASTER_PORT"]), group=group)
    assert all(item == shared[0] for item in shared), "one run id and one rendezvous port for all ranks"


# backend request -> what dist.get_backend() says afterwards, per simulated device
REQUESTS = {
    "cpu": {None: "gloo", "gloo": "gloo", "env://": "gloo"},
    "cuda": {
        None: "nccl",
        "nccl": "nccl",
        "gloo": "gloo",
        "env://": "nccl",
        "cpu:gloo,cuda:nccl": "cpu:gloo,cuda:nccl",
    },
    "xla": {None: "gloo", "gloo": "gloo", "xla": "xla", "env://": "gloo"},
}


def _init(request):
    import torch.distributed as dist

    if request is None:
        dist.init_process_group()
    elif request == "env://":
        dist.init_process_group(init_method="env://")
    elif request == "xla":
        dist.init_process_group("xla", init_method="xla://")
    else:
        dist.init_process_group(request)


def _local_device(device, rank):
    if device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    if device == "xla" and torch.distributed.get_backend() == "xla":
        import torch_xla

        return torch_xla.device()  # torch_xla's group takes XLA tensors only
    return torch.device("cpu")


def _own_group(rank, world_size, device, request):
    import torch.distributed as dist

    _init(request)
    assert dist.is_initialized() and dist.get_backend() == REQUESTS[device][request]
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world_size)
    t = torch.ones(2, device=_local_device(device, rank)) * (rank + 1)
    dist.all_reduce(t)
    assert t.tolist() == [world_size * (world_size + 1) / 2] * 2
    # accel adopts the script's group, as it adopts any group made before it
    from accel import Accelerator

    accelerator = Accelerator()
    gathered = accelerator.gather(torch.tensor([rank], device=accelerator.device))
    assert gathered.tolist() == list(range(world_size))
    assert accelerator.gather_for_metrics([rank]) == list(range(world_size))


@pytest.mark.parametrize("request_", list(REQUESTS["cpu"]), ids=str)
@distributed_test(world_size=SIZES, device="cpu")
def test_own_group_on_simulated_cpus(rank, world_size, request_):
    _own_group(rank, world_size, "cpu", request_)


@pytest.mark.parametrize("request_", list(REQUESTS["cuda"]), ids=str)
@distributed_test(world_size=SIZES, device="cuda")
def test_own_group_on_simulated_gpus(rank, world_size, request_):
    _own_group(rank, world_size, "cuda", request_)


@pytest.mark.parametrize("request_", list(REQUESTS["xla"]), ids=str)
@distributed_test(world_size=SIZES, device="xla")
def test_own_group_on_simulated_tpus(rank, world_size, request_):
    _own_group(rank, world_size, "xla", request_)


@distributed_test(world_size=SIZES, device=["cpu", "cuda"])
def test_destroy_then_init_again(rank, world_size, device):
    import torch.distributed as dist

    here = _local_device(device, rank)
    for backend in ("gloo", "gloo"):
        dist.init_process_group(backend)
        t = torch.ones(1, device=here)
        dist.all_reduce(t)
        assert t.item() == world_size
        dist.destroy_process_group()
        assert not dist.is_initialized()
    dist.init_process_group()  # the next test gets the simulator's group back either way


@distributed_test(world_size=2, device=["cpu", "cuda"])
def test_a_second_init_by_the_script_fails_as_in_torch(rank, device):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    with pytest.raises(ValueError, match="trying to initialize the default process group twice"):
        dist.init_process_group("gloo")


@distributed_test(world_size=2, device=["cpu", "xla"])
def test_nccl_without_gpus_is_refused(rank):
    import torch.distributed as dist

    from accel.sim.runtime.adopt_group import IncompatibleProcessGroupRequest

    with pytest.raises(IncompatibleProcessGroupRequest, match="doesn't have NCCL built in.*--simulate cuda"):
        dist.init_process_group("nccl")
    assert dist.is_initialized()  # the simulator's group is untouched


@distributed_test(world_size=2, device="cpu")
def test_another_world_is_refused(rank):
    import torch.distributed as dist

    from accel.sim.runtime.adopt_group import IncompatibleProcessGroupRequest

    with pytest.raises(IncompatibleProcessGroupRequest, match=r"world_size=3.*WORLD_SIZE=2"):
        dist.init_process_group("gloo", world_size=3, rank=rank)
    dist.init_process_group("gloo", world_size=2, rank=rank)  # the same world: adopted


def _replace_with_gloo():
    import torch.distributed as dist

    before = dist.get_backend()
    dist.init_process_group("gloo")
    t = torch.ones(1)  # a CPU tensor: Gloo takes it
    dist.all_reduce(t)
    return before, dist.get_backend(), t.item()


def _simulator_group_is_back():
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    try:
        dist.all_reduce(torch.ones(1))  # the simulator's NCCL group refuses a CPU tensor
    except RuntimeError as refused:
        return dist.get_backend(), t.item(), str(refused)
    return dist.get_backend(), t.item(), None


def test_the_next_task_gets_the_simulators_group_back():
    from accel.sim import launch

    assert launch(_replace_with_gloo, world_size=2, device="cuda", timeout=120) == [("nccl", "gloo", 2.0)] * 2
    # same warm ranks: the simulator's group was restored before this task
    back = launch(_simulator_group_is_back, world_size=2, device="cuda", timeout=120)
    assert back == [("nccl", 2.0, "No backend type associated with device type cpu")] * 2
