"""Accelerate's utilities on several real ranks, on simulated CPU, CUDA and XLA hardware."""

import torch

from harness import distributed_test

SIZES = [2, 4]
DEVICES = ["cpu", "cuda", "xla"]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_reduce_max_and_min(rank, world_size):
    from accel.state import PartialState
    from accel.utils import reduce

    device = PartialState().device
    data = {
        "f": torch.tensor([float(rank), -float(rank)], device=device),
        "i": [torch.tensor([rank * 3], device=device)],
    }
    high, low = reduce(data, "max"), reduce(data, "min")
    assert high["f"].tolist() == [world_size - 1.0, 0.0] and high["i"][0].tolist() == [3 * (world_size - 1)]
    assert low["f"].tolist() == [0.0, -(world_size - 1.0)] and low["i"][0].tolist() == [0]
    assert data["f"].tolist() == [float(rank), -float(rank)]  # inputs untouched


@distributed_test(world_size=SIZES, device=["cpu"])
def test_reduce_max_matches_accelerate(rank, world_size):
    """The peer on the same process group gives the same numbers for "max", "sum" and "mean"."""
    from accelerate.state import PartialState as PeerState
    from accelerate.utils import reduce as peer_reduce

    from accel.utils import reduce

    PeerState(cpu=True)  # adopts the process group the rank already has
    try:
        data = torch.tensor([float(rank), 10.0 - rank])
        for reduction in ("max", "sum", "mean"):
            assert torch.equal(reduce(data, reduction), peer_reduce(data, reduction)), reduction
    finally:
        PeerState._reset_state()


@distributed_test(world_size=SIZES, device=DEVICES)
def test_tqdm_shows_on_the_local_main_process_only(rank, world_size):
    from accel.state import PartialState
    from accel.utils import tqdm

    state = PartialState()
    bar = tqdm(range(3))
    assert bar.disable == (state.local_process_index != 0)  # read before iterating: closing disables a bar
    assert list(bar) == [0, 1, 2]
    everywhere = tqdm(range(3), main_process_only=False)
    assert not everywhere.disable
    everywhere.close()


@distributed_test(world_size=SIZES, device=DEVICES)
def test_save_writes_once_with_tensors_on_the_cpu(rank, world_size, tmp_path):
    from accel.state import PartialState
    from accel.utils import save

    state = PartialState()
    path = tmp_path / f"weights-{world_size}.safetensors"
    save({"w": torch.full((2,), float(rank), device=state.device)}, path, safe_serialization=True)
    state.wait_for_everyone()
    from safetensors.torch import load_file

    loaded = load_file(path)
    assert loaded["w"].device.type == "cpu" and loaded["w"].tolist() == [0.0, 0.0]  # the main process wrote it


@distributed_test(world_size=SIZES, device=DEVICES)
def test_is_available_answers_for_the_simulated_hardware(rank, world_size, device):
    from accel.state import PartialState
    from accel.utils import DistributedType, is_cuda_available, is_torch_xla_available

    state = PartialState()
    assert is_cuda_available() == (device == "cuda")
    assert is_torch_xla_available() == (device == "xla")
    expected = {"cpu": DistributedType.MULTI_CPU, "cuda": DistributedType.MULTI_GPU, "xla": DistributedType.XLA}
    assert state.distributed_type == expected[device]


@distributed_test(world_size=SIZES, device=["xla"])
def test_notebook_launcher_on_a_tpu_host_uses_xmp_spawn(rank, world_size):
    """On a TPU (here the simulator's), notebook_launcher goes through torch_xla's xmp.spawn, as Accelerate does."""
    from accel.launchers import notebook_launcher

    ran = []

    def training(value):
        import os

        from accel.state import PartialState

        ran.append((value, PartialState().num_processes, os.environ["ACCEL_MIXED_PRECISION"]))

    notebook_launcher(training, args=(5,), mixed_precision="bf16")
    assert ran == [(5, world_size, "bf16")]


@distributed_test(world_size=SIZES, device=DEVICES)
def test_logger_speaks_once_per_run_with_the_rank(rank, world_size):
    import logging

    from accel.logging import get_logger
    from accel.state import PartialState

    PartialState()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = get_logger(f"accel.test.ranks{world_size}", log_level="INFO")
    logger.logger.addHandler(handler)
    try:
        logger.info("main only")
        logger.info("everyone", main_process_only=False)
        for _ in range(3):
            logger.warning_once("once")
        logger.info("in turn", in_order=True)
    finally:
        logger.logger.removeHandler(handler)
    expected = [f"[RANK {rank}] everyone"]
    if rank == 0:
        expected = ["[RANK 0] main only", *expected, "[RANK 0] once"]
    expected.append(f"[RANK {rank}] in turn")
    assert [r.getMessage() for r in records] == expected


@distributed_test(world_size=SIZES, device=["cpu"])
def test_pad_across_processes_leaves_nested_tensors_with_a_warning(rank, world_size):
    import pytest

    from accel.utils import CannotPadNestedTensorWarning, pad_across_processes

    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3 + rank)])
    plain = torch.ones(1 + rank)
    with pytest.warns(CannotPadNestedTensorWarning, match="nested"):
        out = pad_across_processes({"n": nested, "p": plain})
    assert out["n"] is nested
    assert out["p"].shape == (world_size,) and out["p"][: 1 + rank].eq(1).all() and out["p"][1 + rank :].eq(0).all()
