"""Issue 16's drop-in behaviours on several real ranks (simulated CPU, CUDA and XLA hardware): what
running Accelerate's own scripts against accel turned up."""

import warnings

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device=["cpu", "cuda", "xla"])
def test_copy_tensor_to_devices_from_any_one_process(rank, world_size):
    from accel.state import PartialState
    from accel.utils.operations import copy_tensor_to_devices

    state = PartialState()
    holder = world_size - 1
    tensor = torch.tensor([[1, 2, 3]], dtype=torch.int32, device=state.device) if rank == holder else None
    copied = copy_tensor_to_devices(tensor)
    assert copied.device == state.device and copied.dtype == torch.int32 and copied.cpu().tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="exactly one process"):
        copy_tensor_to_devices(torch.ones(1, device=state.device))


@distributed_test(world_size=SIZES, device=["cpu", "cuda"])
def test_gather_of_parameters_that_require_grad(rank, world_size):
    # Accelerate's training script compares weights across ranks by gathering a parameter: on CPU
    # ranks this failed with "a view was created in no_grad mode and is being modified inplace"
    from accel.state import PartialState
    from accel.utils import gather

    device = PartialState().device
    weight = torch.nn.Parameter(torch.full((2, 3), float(rank), device=device))
    gathered = gather(weight[None].clone())
    assert gathered.shape == (world_size, 2, 3) and not gathered.requires_grad
    assert gathered[:, 0, 0].cpu().tolist() == [float(r) for r in range(world_size)]
    both = gather({"w": weight[None].clone(), "b": weight.sum()[None].clone()})
    assert both["b"].cpu().tolist() == [6.0 * r for r in range(world_size)]


@distributed_test(world_size=SIZES, device=["cpu", "cuda"])
def test_pad_across_processes_checks_dimensions_in_debug_mode(rank):
    from accel.state import PartialState
    from accel.utils import DistributedOperationException, pad_across_processes

    state = PartialState()
    state.debug = True
    try:
        shape = (1, 5) if rank == 0 else (1, 1, 6)
        with pytest.raises(DistributedOperationException, match="same number of dimensions"):
            pad_across_processes({"tensor": torch.zeros(shape, device=state.device)})
        padded = pad_across_processes(torch.zeros(1, 2 + rank, device=state.device), dim=1)
        assert padded.shape[1] == 2 + state.num_processes - 1
    finally:
        state.debug = False


@distributed_test(world_size=SIZES, device=["cpu", "cuda"])
def test_dispatcher_passes_non_tensor_values_along(rank, world_size):
    from torch.utils.data import DataLoader

    from accel.data_loader import DataLoaderDispatcher, prepare_data_loader
    from accel.state import PartialState

    def collate(items):
        return {"x": torch.tensor(items), "ids": [f"s{i}" for i in items], "epoch": 7}

    loader = prepare_data_loader(
        DataLoader(list(range(4 * world_size)), batch_size=2 * world_size, collate_fn=collate),
        num_processes=world_size,
        process_index=rank,
        split_batches=True,
        dispatch_batches=True,
        put_on_device=True,
        device=PartialState().device,
    )
    assert isinstance(loader, DataLoaderDispatcher)
    batches = list(loader)
    assert len(batches) == 2
    for number, batch in enumerate(batches):
        start = number * 2 * world_size
        assert batch["x"].cpu().tolist() == [start + 2 * rank, start + 2 * rank + 1]
        # as in Accelerate: the main process's non-tensor values, whole, on every process
        assert batch["ids"] == [f"s{i}" for i in range(start, start + 2 * world_size)] and batch["epoch"] == 7


@distributed_test(world_size=2, device="xla")
def test_join_uneven_inputs_on_xla_without_an_optimizer_proceeds(rank):
    from accel import Accelerator

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model]):
            out = model(torch.ones(1, 2, device=accelerator.device))
    assert out.shape == (1, 2)
    assert any("no optimizer was prepared" in str(w.message) for w in caught)


@distributed_test(world_size=2, device="cpu")
def test_join_uneven_inputs_warns_as_accelerate_for_non_ddp_models(rank):
    from unittest.mock import Mock

    from accel import Accelerator

    accelerator = Accelerator()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([Mock()]):
            pass
    assert "only supported for multi-GPU" in str(caught[-1].message)
