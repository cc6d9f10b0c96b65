"""Processes of one node filling one GPU's memory together (tests/test_sim_node.py).

Started by `torchrun --nproc_per_node 2` (or alone with `python`): every process takes GPU
0, forms no group, and holds 60% of the card. Rank 0 takes its share first; rank 1 then
looks at `mem_get_info` and tries to take its own, which a real card does not have, and
writes `RESULT {json}`: its free memory before and whether it ran out, with CUDA's message.
The two take turns through files in the folder given as the first argument. Alone, the
process takes its 60% and reports that it fit.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

SHARE = 0.6
folder = Path(sys.argv[1])
rank = int(os.environ.get("RANK", "0"))
alone = "RANK" not in os.environ


def wait_for(name: str) -> None:
    deadline = time.monotonic() + 120
    while not (folder / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: no {name} after 120 s")
        time.sleep(0.05)


def report(**result) -> None:
    result.update(rank=rank, pid=os.getpid(), node=os.environ.get("ACCEL_SIM_NODE"))
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: the ranks share the pipe


torch.cuda.set_device(0)
total = torch.cuda.get_device_properties(0).total_memory
size = int(total * SHARE)
free_before = torch.cuda.mem_get_info(0)[0]
if rank == 1:
    wait_for("rank0-holds")
    free_before = torch.cuda.mem_get_info(0)[0]
try:
    held = torch.empty(size, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as error:
    report(total=total, size=size, free_before=free_before, fit=False, error=type(error).__name__, message=str(error))
else:
    report(total=total, size=size, free_before=free_before, fit=True, allocated=torch.cuda.memory_allocated(0))
if rank == 0 and not alone:
    (folder / "rank0-holds").touch()
    wait_for("rank1-done")
elif rank == 1:
    (folder / "rank1-done").touch()
