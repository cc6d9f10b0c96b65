"""The backend registry and the seam that the simulator plugs into."""

import pytest
import torch
import torch.distributed as dist

from accel import backends
from accel.backends import Backend, CPUBackend, CUDABackend, XLABackend, register_backend, select_backend
from accel.state import PartialState, active_backend, reset_state
from accel.utils.dataclasses import DistributedType


class RecordingBackend(CPUBackend):
    """A test-only backend: reports MULTI_GPU-like types and records the devices it was asked for."""

    name = "test-recording"
    multi_process_type = DistributedType.MULTI_GPU
    single_process_type = DistributedType.MULTI_GPU
    set_devices: list = []

    def device(self, local_rank):
        return torch.device("meta")

    def set_device(self, device):
        RecordingBackend.set_devices.append(device)


@pytest.fixture
def recording_backend(monkeypatch):
    register_backend(RecordingBackend)
    monkeypatch.setenv(backends.ENV_VAR, RecordingBackend.name)
    RecordingBackend.set_devices = []
    reset_state()
    yield RecordingBackend
    backends.unregister_backend(RecordingBackend.name)
    reset_state()


def test_builtin_backends_are_registered():
    registry = backends.registered_backends()
    assert registry["cpu"] is CPUBackend and registry["cuda"] is CUDABackend and registry["xla"] is XLABackend


def test_default_selection_on_this_machine(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    chosen = select_backend()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert chosen.name == (expected if not XLABackend.is_available() else "xla")
    assert select_backend(cpu=True).name == "cpu"


def test_highest_priority_available_backend_wins(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)

    class Always(CPUBackend):
        name = "test-always"
        priority = 1000

    register_backend(Always)
    try:
        assert isinstance(select_backend(), Always)
        assert isinstance(select_backend(cpu=True), CPUBackend) and not isinstance(select_backend(cpu=True), Always)
    finally:
        backends.unregister_backend("test-always")


def test_state_asks_the_registered_backend(recording_backend):
    state = PartialState()
    assert isinstance(state.hardware, recording_backend)
    assert active_backend() is state.hardware
    assert state.device == torch.device("meta")
    assert recording_backend.set_devices == [torch.device("meta")]
    assert state.distributed_type == DistributedType.MULTI_GPU


def test_duplicate_name_needs_replace():
    class Other(CPUBackend):
        name = "cpu"

    with pytest.raises(ValueError, match="already registered"):
        register_backend(Other)


def test_unknown_backend_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "tpu-v9")
    with pytest.raises(ValueError, match=r"ACCEL_BACKEND='tpu-v9' names no registered backend; registered: \["):
        select_backend()


def test_unavailable_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(XLABackend, "is_available", classmethod(lambda cls: False))
    monkeypatch.setenv(backends.ENV_VAR, "xla")
    with pytest.raises(RuntimeError, match="'xla' was asked for but that hardware is not available"):
        select_backend()


def test_distributed_type_per_backend():
    assert CPUBackend().distributed_type(1) == DistributedType.NO
    assert CPUBackend().distributed_type(2) == DistributedType.MULTI_CPU
    assert CUDABackend().distributed_type(1) == DistributedType.NO
    assert CUDABackend().distributed_type(4) == DistributedType.MULTI_GPU
    assert XLABackend().distributed_type(1) == DistributedType.XLA
    assert XLABackend().distributed_type(8) == DistributedType.XLA


def test_launch_env_reads_torchrun_variables(monkeypatch):
    for name, value in {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    assert CPUBackend().launch_env() == (5, 8, 1, 4)
    monkeypatch.setenv("RANK", "five")
    with pytest.raises(ValueError, match="RANK='five' must be an integer"):
        CPUBackend().launch_env()


def test_cuda_backend_without_gpus_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        CUDABackend().device(0)


def test_cpu_backend_collectives_on_one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        hw: Backend = CPUBackend()
        out = torch.empty(3)
        assert hw.all_gather_into(out, torch.tensor([1.0, 2.0, 3.0])).tolist() == [1.0, 2.0, 3.0]
        assert hw.all_reduce(torch.tensor([2.0]), "max").tolist() == [2.0]
        assert hw.broadcast(torch.tensor([7]), 0).tolist() == [7]
        assert hw.all_gather_object({"a": 1}) == [{"a": 1}]
        assert hw.broadcast_object_list(["x"], 0) == ["x"]
        hw.barrier()
    finally:
        dist.destroy_process_group()


def test_training_touch_points_of_the_cpu_backend():
    hw = CPUBackend()
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    hw.optimizer_step(optimizer)
    assert not torch.equal(before, model.weight)
    with hw.autocast(torch.bfloat16):
        assert model(torch.ones(1, 2)).dtype == torch.bfloat16
    assert hw.grad_scaler(enabled=False).is_enabled() is False
    loader = [1, 2]
    assert hw.wrap_dataloader(loader, torch.device("cpu")) is loader
    assert hw.get_rng_state() is None
