"""accel (and Accelerate's own PartialState) on simulated TPU cores, and the same losses on TPU, GPU and CPU ranks."""

import pytest
import torch

from accel.sim import launch
from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="xla")
def test_accel_on_simulated_tpu_cores(rank, world_size, tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Accelerator
    from accel.state import PartialState
    from accel.utils import DistributedType, broadcast

    accelerator = Accelerator()
    here = torch.device("xla", 0)
    assert accelerator.device == PartialState().device == here
    assert accelerator.distributed_type == DistributedType.XLA

    x = torch.full((2, 3), float(rank), device=here)
    gathered = accelerator.gather(x)
    assert gathered.device == here and gathered[::2, 0].tolist() == [float(r) for r in range(world_size)]
    padded = accelerator.pad_across_processes(torch.ones(rank + 1, device=here), dim=0)
    assert padded.device == here and padded.shape == (world_size,)
    total = accelerator.reduce(torch.tensor([rank + 1.0], device=here), reduction="sum")
    assert total.device == here and total.item() == world_size * (world_size + 1) / 2
    assert broadcast(torch.tensor([rank], device=here), from_process=world_size - 1).item() == world_size - 1

    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(10, 3), torch.randn(10, 1))  # 10 samples: uneven over the ranks
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=2))
    assert accelerator.unwrap_model(model).weight.device == here
    seen = []
    for inputs, targets in loader:
        assert inputs.device == targets.device == here  # MpDeviceLoader put the batch on the core
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(accelerator.gather_for_metrics(targets))
    assert torch.cat(seen).shape == (10, 1) and torch.cat(seen).device == here
    weights = [p.detach().cpu() for p in model.parameters()]
    everyone = accelerator.gather(torch.cat([w.flatten() for w in weights]).to(here)[None])
    assert all(torch.equal(everyone[0], row) for row in everyone)  # the replicas stay in step

    accelerator.save_state(tmp_path / "state")
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.zero_()
    accelerator.load_state(tmp_path / "state")
    restored = accelerator.unwrap_model(model).weight
    assert restored.device == here and torch.equal(restored.detach().cpu(), weights[0])
    assert all(s.device == here for state in optimizer.state.values() for k, s in state.items() if k != "step")


@distributed_test(world_size=SIZES, device="xla")
def test_join_uneven_inputs_on_simulated_tpu_cores(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Accelerator
    from accel.utils import DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(2 * world_size + 1, 2), torch.randn(2 * world_size + 1, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=2))
    steps = 0
    with accelerator.join_uneven_inputs([model]):
        for inputs, targets in loader:
            assert inputs.device == torch.device("xla", 0)
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    assert steps == (2 if rank == 0 else 1)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = accelerator.gather(flat[None])
    assert all(torch.equal(everyone[0].cpu(), row.cpu()) for row in everyone)


@distributed_test(world_size=SIZES, device="xla")
def test_accelerates_own_partial_state_on_simulated_tpu_cores(rank, world_size):
    accelerate = pytest.importorskip("accelerate")

    state = accelerate.PartialState()
    assert state.distributed_type == accelerate.utils.DistributedType.XLA
    assert (state.process_index, state.num_processes) == (rank, world_size)
    assert state.device == torch.device("xla", 0)
    value = torch.tensor([float(rank)], device=state.device)
    gathered = accelerate.utils.gather(value)
    assert gathered.device == state.device and gathered.tolist() == [float(r) for r in range(world_size)]


def small_training(seed):
    """The same small fp32 training on whatever device the rank has, written once with accel."""
    from torch.utils.data import DataLoader, TensorDataset

    from accel import Accelerator
    from accel.utils import set_seed

    accelerator = Accelerator()
    set_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    dataset = TensorDataset(torch.randn(32, 6, generator=generator), torch.randn(32, 1, generator=generator))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=4))
    losses = []
    for _ in range(2):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    return str(accelerator.device), losses


@pytest.mark.parametrize("world_size", SIZES)
def test_the_same_training_gives_the_same_fp32_losses_on_tpu_gpu_and_cpu(world_size):
    runs = {
        device: launch(small_training, args=(7,), world_size=world_size, device=device)
        for device in ("cpu", "cuda", "xla")
    }
    assert [device for device, _ in runs["xla"]] == ["xla:0"] * world_size
    assert [device for device, _ in runs["cuda"]] == [f"cuda:{r}" for r in range(world_size)]
    cpu = runs["cpu"][0][1]
    assert len(cpu) == 2 * 32 // (4 * world_size)
    for _, losses in runs["cuda"]:
        assert losses == cpu  # DDP on both: the very same arithmetic
    for _, losses in runs["xla"]:
        # XLA replicas sum their gradients and then scale them (xm.optimizer_step), where DDP
        # divides before summing: over 4 replicas the last bit of a sum may differ
        assert losses == pytest.approx(cpu, rel=1e-6, abs=0)


@distributed_test(world_size=SIZES, device="xla")
def test_accel_speaks_todays_torch_xla_without_its_deprecation_warnings():
    import warnings

    from accel import Accelerator

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # xm.xla_device() and xm.mark_step() warn so
        accelerator = Accelerator()
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.backward(model(torch.ones(1, 2, device=accelerator.device)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert accelerator.device == torch.device("xla", 0)
