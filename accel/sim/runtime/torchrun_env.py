"""The environment `torchrun` gives each worker, as a simulated rank gets it.

A script written for torchrun reads these variables (and `init_process_group` with
`env://` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT). The list follows torch's
elastic agent (`torch/distributed/elastic/agent/server/local_elastic_agent.py`) for a
single node started with `torchrun --standalone --nproc_per_node=N`: one group (node),
role "default", local rank = rank, the agent's rendezvous store shared with the workers.
`TORCHELASTIC_SIGNALS_TO_HANDLE` comes from torchrun's launcher, which its workers inherit.
`accel launch --simulate --max_restarts` overrides the two restart counters per attempt.
Measured against `torchrun --standalone --nproc_per_node 2` on torch 2.13: the same
variables and values, except MASTER_ADDR (torchrun says "localhost") and the port, run id
and error file, which differ from run to run.
"""

from __future__ import annotations

import os


def torchrun_environment(rank: int, world_size: int, run_id: str, error_dir: str) -> dict[str, str]:
    """Variables of worker `rank` of `world_size` on one node (MASTER_PORT is added once known)."""
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        # rank 0 hosts the rendezvous server, every rank (and env://) connects as a client
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # torchrun's launcher sets it for its agent (torch/distributed/launcher/api.py); workers inherit it
        "TORCHELASTIC_SIGNALS_TO_HANDLE": os.environ.get(
            "TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        ),
        # where torch's `@record` writes a failing worker's error, one file per rank
        "TORCHELASTIC_ERROR_FILE": os.path.join(error_dir, f"rank{rank}-error.json"),
    }
    if "OMP_NUM_THREADS" not in os.environ and world_size > 1:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default with several workers per node
    return env
