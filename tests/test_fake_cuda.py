"""Fake CUDA: `torch.cuda` answers as on a GPU host, and the real CUDA backend runs on CPU and Gloo.

The first group patches `torch.cuda` in this test process for a block and checks the
simulated answers; the second runs one probe per world size on real simulated ranks
(many checks each) and asserts on what every rank saw.
"""

import pytest
import torch

from accel.sim import fake_cuda, launch
from accel.sim.fake_cuda import DEFAULT_CUDA_SEED, SimulatedDeviceError

# -- torch.cuda patched in this process -------------------------------------------------------


def test_torch_cuda_answers_and_is_restored():
    real_is_available = torch.cuda.is_available
    with fake_cuda.installed(local_rank=1, device_count=3):
        assert torch.cuda.is_available() and torch.cuda.is_initialized()
        assert torch.cuda.device_count() == 3 and torch.cuda.current_device() == 1
        torch.cuda.set_device(2)
        torch.cuda.set_device(torch.device("cuda", 0))
        assert torch.cuda.current_device() == 0 and fake_cuda.set_device_calls() == [2, 0]
        with torch.cuda.device(2):
            assert torch.cuda.current_device() == 2
        assert torch.cuda.current_device() == 0
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.is_bf16_supported()
        assert "Simulated" in torch.cuda.get_device_name(1)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    assert torch.cuda.is_available is real_is_available
    assert not torch.cuda.is_available()
    with pytest.raises(RuntimeError, match="not installed"):
        fake_cuda.set_device_calls()


def test_rng_functions_are_per_simulated_device_and_consistent():
    with fake_cuda.installed(local_rank=0, device_count=2):
        assert torch.cuda.initial_seed() == DEFAULT_CUDA_SEED
        torch.cuda.manual_seed(5)  # current device only
        assert torch.cuda.initial_seed() == 5
        assert torch.cuda.random.get_rng_state(1).equal(torch.Generator().manual_seed(DEFAULT_CUDA_SEED).get_state())
        torch.cuda.manual_seed_all(7)
        states = torch.cuda.get_rng_state_all()
        assert len(states) == 2 and states[0].equal(states[1])
        assert states[0].equal(torch.Generator().manual_seed(7).get_state())
        snapshot = torch.cuda.get_rng_state()
        torch.cuda.seed()
        assert torch.cuda.initial_seed() != 7
        torch.cuda.set_rng_state(snapshot)
        assert torch.cuda.get_rng_state().equal(snapshot) and torch.cuda.initial_seed() == 7
        torch.cuda.seed_all()
        torch.cuda.set_rng_state_all(states)
        assert all(a.equal(b) for a, b in zip(torch.cuda.get_rng_state_all(), states))
        torch.manual_seed(11)  # torch seeds every CUDA generator too, as on a GPU host
        assert torch.cuda.get_rng_state("cuda:1").equal(torch.Generator().manual_seed(11).get_state())
        with torch.random.fork_rng(devices=[0, 1], device_type="cuda"):
            torch.cuda.manual_seed_all(99)
        assert torch.cuda.initial_seed() == 11
        fake_cuda.reset(local_rank=1)
        assert torch.cuda.current_device() == 1 and torch.cuda.initial_seed() == DEFAULT_CUDA_SEED


def test_what_cannot_be_simulated_fails_clearly():
    with fake_cuda.installed(local_rank=0, device_count=2):
        attempts = {
            "factory": lambda: torch.zeros(2, device="cuda"),
            "tensor.cuda": lambda: torch.zeros(2).cuda(),
            "tensor.to": lambda: torch.zeros(2).to("cuda:1"),
            "module.cuda": lambda: torch.nn.Linear(2, 2).cuda(),
            "stream": torch.cuda.current_stream,
        }
        for what, attempt in attempts.items():
            with pytest.raises(SimulatedDeviceError, match="accelerator.device") as info:
                attempt()
            assert "simulator" in str(info.value), what
        with pytest.raises(SimulatedDeviceError, match="device 5 does not exist"):
            torch.cuda.set_device(5)


def test_backend_is_the_real_cuda_backend_with_cpu_touch_points():
    from accel.backends import CUDABackend

    assert not fake_cuda.SimCUDABackend.is_available()
    with fake_cuda.installed(local_rank=1, device_count=2):
        backend = fake_cuda.SimCUDABackend()
        assert isinstance(backend, CUDABackend) and backend.is_available()
        assert backend.comm_backend == "gloo" and backend.distributed_type(2) == "MULTI_GPU"
        device = backend.device(3)  # local rank 3 on 2 GPUs -> GPU 1, like the real backend
        backend.set_device(device)
        assert device == torch.device("cpu") and fake_cuda.set_device_calls() == [1]
        assert backend.ddp_device_ids(device) is None
        with backend.autocast(torch.float16):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16
        with backend.autocast(torch.bfloat16):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
        backend.manual_seed(3)
        assert backend.get_rng_state().equal(torch.Generator().manual_seed(3).get_state())


# -- real simulated ranks ------------------------------------------------------------------------


def cuda_probe():
    """Runs in every rank: what the user's code and accel see on the fake CUDA."""
    import torch.distributed as dist

    from accel.state import PartialState

    state = PartialState()
    hw = state.hardware
    rank, world = state.process_index, state.num_processes
    seen = {
        "type": str(state.distributed_type),
        "backend_name": hw.name,
        "comm": state.backend,
        "device": str(state.device),
        "cuda": (torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.current_device()),
        "set_device_calls": fake_cuda.set_device_calls(),
    }
    gathered = torch.empty(world, 2)
    hw.all_gather_into(gathered, torch.tensor([[rank, rank * 10.0]]))
    seen["gather"] = gathered.tolist()
    seen["sum"] = hw.all_reduce(torch.tensor([rank + 1.0])).item()
    seen["max"] = hw.all_reduce(torch.tensor([float(rank)]), op="max").item()
    seen["bcast"] = hw.broadcast(torch.tensor([rank + 100.0]), src=world - 1).item()
    seen["objects"] = hw.all_gather_object({"rank": rank})
    seen["bcast_objects"] = hw.broadcast_object_list([rank, "x"], src=1)
    hw.barrier()

    # DDP through the real backend code, fp16 autocast and the GradScaler.
    torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
    model = hw.wrap_model(torch.nn.Linear(4, 1), state.device, {})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = hw.grad_scaler()
    with hw.autocast(torch.float16):
        out = model(torch.full((2, 4), float(rank + 1)))
    seen["autocast_dtype"] = str(out.dtype)
    scaler.scale(out.float().pow(2).mean()).backward()
    scaler.step(optimizer)
    scaler.update()
    seen["weights"] = hw.all_gather_object(model.module.weight.detach().tolist())
    seen["ddp"] = type(model).__name__

    # RNG: seeding through the backend is seen by torch.cuda, and the states agree.
    hw.manual_seed(1234 + rank)
    seen["rng_equal"] = hw.get_rng_state().equal(torch.cuda.get_rng_state())
    seen["initial_seed"] = torch.cuda.initial_seed()
    import os

    from accel.backends import select_backend

    del os.environ["ACCEL_BACKEND"]  # chosen by availability, or by the name "cuda": still simulated
    seen["selected"] = type(select_backend()).__name__
    os.environ["ACCEL_BACKEND"] = "cuda"
    seen["selected_by_name"] = type(select_backend()).__name__
    try:
        torch.ones(1).cuda()
    except SimulatedDeviceError as error:
        seen["error"] = str(error)
    dist.barrier()
    return seen


@pytest.fixture(scope="module", params=[2, 4])
def probed(request):
    world = request.param
    return world, launch(cuda_probe, world_size=world, device="cuda")


def test_ranks_see_simulated_gpus(probed):
    world, seen = probed
    for rank, s in enumerate(seen):
        assert s["type"] == "MULTI_GPU" and s["backend_name"] == "sim_cuda"
        assert s["comm"] == "gloo" and s["device"] == "cpu"
        assert s["cuda"] == (True, world, rank)
        assert s["set_device_calls"] == [rank]
        assert s["initial_seed"] == 1234 + rank and s["rng_equal"]
        assert "simulator" in s["error"]
        assert s["selected"] == s["selected_by_name"] == "SimCUDABackend"


def test_cuda_backend_collectives_run_on_gloo(probed):
    world, seen = probed
    for s in seen:
        assert s["gather"] == [[r, r * 10.0] for r in range(world)]
        assert s["sum"] == world * (world + 1) / 2 and s["max"] == world - 1
        assert s["bcast"] == world - 1 + 100.0
        assert s["objects"] == [{"rank": r} for r in range(world)]
        assert s["bcast_objects"] == [1, "x"]


def test_ddp_with_fp16_autocast_and_grad_scaler(probed):
    world, seen = probed
    for s in seen:
        assert s["ddp"] == "DistributedDataParallel" and s["autocast_dtype"] == "torch.float16"
        # Same initial weights (broadcast) and averaged gradients: every replica agrees.
        assert all(w == s["weights"][0] for w in s["weights"])
    assert seen[0]["weights"] == seen[-1]["weights"]
