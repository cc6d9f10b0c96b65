"""Small helpers shared by several test modules (imported as `support`: tests/ is on sys.path)."""

from __future__ import annotations

import os
import time


class Counter:
    """A user object with a state dict, as registered for checkpointing."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def process_gone(pid: int, within: float = 15.0) -> bool:
    """Whether process `pid` has ended, waiting up to `within` seconds for it to."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def nccl_group(rank: int):
    """In a simulated GPU rank: the script's own "nccl" group, then its GPU made current (that GPU)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


#: a test module of two ranks that writes down each rank's pid and its parent's (the rank server's)
RECORDING = """
import os, pathlib
from harness import distributed_test

@distributed_test(world_size=2)
def test_{name}(rank):
    folder = pathlib.Path(__file__).parent / "pids"
    folder.mkdir(exist_ok=True)
    (folder / str(os.getpid())).write_text(str(os.getppid()))
"""
