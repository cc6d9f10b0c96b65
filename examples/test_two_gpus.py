"""A GPU test written as test suites write them: it needs two GPUs and skips without them.

    pytest examples/test_two_gpus.py                          # on a machine without GPUs: skipped
    ACCEL_SIMULATE=cuda:2 pytest examples/test_two_gpus.py    # the same test on 2 simulated GPUs: passes

Nothing in it knows of accel: it spawns one process per GPU, each joins an NCCL process
group, and the ranks all-reduce a tensor made on their GPU.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _all_reduce_on_gpu(rank: int, world_size: int, init_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    total = torch.full((3,), float(rank + 1), device="cuda")
    dist.all_reduce(total)
    assert total.device == torch.device("cuda", rank)
    assert total.tolist() == [3.0, 3.0, 3.0]
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_all_reduce_on_two_gpus(tmp_path):
    mp.spawn(_all_reduce_on_gpu, args=(2, str(tmp_path / "rendezvous")), nprocs=2)
