"""A torch_xla script started with `torchrun --nproc_per_node 2` on a simulated XLA node (tests/test_sim_node.py).

As torch_xla asks of scripts under torchrun, it makes the "xla" process group
(`init_method="xla://"`) first; then an `xm.all_reduce` and a `torch.distributed`
all-reduce on the process's XLA device. Each rank writes `RESULT {json}`.
"""

import json
import os

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_backend  # registers the "xla" backend
import torch_xla.runtime as xr

dist.init_process_group("xla", init_method="xla://")
device = torch_xla.device()
rank = xr.global_ordinal()
reduced = xm.all_reduce(xm.REDUCE_SUM, torch.full((3,), float(rank + 1), device=device))
tensor = torch.full((2,), float(dist.get_rank() + 1), device=device)
dist.all_reduce(tensor)
torch_xla.sync()
result = {
    "rank": rank,
    "device": str(device),
    "hw": xm.xla_device_hw(device),
    "world_size": xr.world_size(),
    "ordinal": xr.global_ordinal(),
    "xm_all_reduce": reduced.cpu().tolist(),
    "dist_backend": dist.get_backend(),
    "dist_all_reduce": tensor.cpu().tolist(),
    "cuda_device_count": torch.cuda.device_count(),
}
os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: the ranks share the pipe
dist.destroy_process_group()
