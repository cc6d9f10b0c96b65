"""A script a user starts with `torchrun --nproc_per_node 2` on a GPU node (tests/test_sim_node.py).

Each rank writes one line `RESULT {json}`: what it sees (device count, its device, the card's
name, the current GPU's UUID, CUDA_VISIBLE_DEVICES) and the result of an all-reduce over its
own "nccl" group. Modes (the first argument):

- `plain`: the usual script: `torch.cuda.set_device(LOCAL_RANK)`, then the group;
- `forgot`: no `set_device`: both ranks on cuda:0 of one group (NCCL refuses it);
- `visible`: the script makes each rank see only its own GPU, as launchers do
  (`CUDA_VISIBLE_DEVICES=<local rank>` before torch is imported), and uses cuda:0;
- `mismatch`: rank 0 all-reduces 3 elements while rank 1 broadcasts 4.
"""

import json
import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "plain"
LOCAL_RANK = int(os.environ["LOCAL_RANK"])
if MODE == "visible":
    os.environ["CUDA_VISIBLE_DEVICES"] = str(LOCAL_RANK)

import torch  # noqa: E402  (after CUDA_VISIBLE_DEVICES, as CUDA reads it when it starts)
import torch.distributed as dist  # noqa: E402

if MODE == "plain":
    torch.cuda.set_device(LOCAL_RANK)
dist.init_process_group("nccl")
rank = dist.get_rank()
if MODE == "mismatch":
    tensor = torch.ones(3 + rank, device="cuda")
    if rank == 0:
        dist.all_reduce(tensor)
    else:
        dist.broadcast(tensor, 0)
    print("NOT REPORTED", rank, flush=True)
    sys.exit(0)
tensor = torch.full((3,), float(rank + 1), device="cuda")
dist.all_reduce(tensor)
result = {
    "rank": rank,
    "local_rank": LOCAL_RANK,
    "device_count": torch.cuda.device_count(),
    "current_device": torch.cuda.current_device(),
    "tensor_device": str(tensor.device),
    "name": torch.cuda.get_device_name(),
    "uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "all_reduce": tensor.tolist(),
    "backend": dist.get_backend(),
    "node": os.environ.get("ACCEL_SIM_NODE"),
}
os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: the ranks share the pipe
dist.destroy_process_group()
