"""NCCL's debug log for the simulated "nccl" group: `NCCL_DEBUG=INFO` with `NCCL_DEBUG_SUBSYS` naming COLL (or
ALL) writes one line per collective, as NCCL does, to `NCCL_DEBUG_FILE` (`%h` the host, `%p` the process id) or
to stdout. People read these lines to see which collectives ran, with what counts, data types and reduction
ops (PyTorch's FSDP2 tests check FSDP's reductions so); the numbers are NCCL's own (nccl.h).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

#: the group's collective methods -> NCCL's names (all-to-all is NCCL's sends and receives, not logged)
NAMES = {
    "allreduce": "AllReduce",
    "allreduce_coalesced": "AllReduce",
    "broadcast": "Broadcast",
    "reduce": "Reduce",
    "allgather": "AllGather",
    "all_gather_single": "AllGather",
    "all_gather_single_coalesced": "AllGather",
    "reduce_scatter": "ReduceScatter",
    "reduce_scatter_single": "ReduceScatter",
    "reduce_scatter_single_coalesced": "ReduceScatter",
    "send": "Send",
    "recv": "Recv",
}
#: ncclDataType_t (bool travels as uint8, as ProcessGroupNCCL sends it)
DATATYPES = {
    torch.int8: 0, torch.uint8: 1, torch.bool: 1, torch.int32: 2, torch.uint32: 3, torch.int64: 4,
    torch.uint64: 5, torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
    torch.float8_e4m3fn: 10, torch.float8_e5m2: 11,
}  # fmt: skip
#: ncclRedOp_t (PREMUL_SUM: the first op NCCL creates at run time)
OPS = {
    dist.ReduceOp.SUM: 0, dist.ReduceOp.PRODUCT: 1, dist.ReduceOp.MAX: 2, dist.ReduceOp.MIN: 3,
    dist.ReduceOp.AVG: 4, dist.ReduceOp.PREMUL_SUM: 5,
}  # fmt: skip
#: collectives whose count is the output's per rank (NCCL counts a reduce-scatter by what each rank receives)
_COUNT_OUTPUT = ("ReduceScatter",)

_lock = threading.Lock()


def enabled() -> bool:
    """Whether NCCL would log collectives: INFO (or TRACE) level and the COLL subsystem."""
    if os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        return False
    subsystems = os.environ.get("NCCL_DEBUG_SUBSYS", "INIT,BOOTSTRAP,ENV").upper().split(",")
    chosen = {s.strip().lstrip("^") for s in subsystems if not s.strip().startswith("^")}
    return "COLL" in chosen or "ALL" in chosen


def collective(group: Any, method: str, args: tuple, gpu: int) -> None:
    """Log one collective of `group` (its method and arguments), issued from GPU `gpu`."""
    name = NAMES.get(method)
    if name is None:
        return
    tensors = [t for t in _flat(args) if isinstance(t, torch.Tensor)]
    if not tensors:
        return
    send, recv = tensors[-1] if name in _COUNT_OUTPUT or name == "AllGather" else tensors[0], tensors[0]
    counted = tensors[0] if name in _COUNT_OUTPUT else send
    opts = next((a for a in args if hasattr(a, "reduceOp")), None)
    op = OPS.get(getattr(opts.reduceOp, "op", opts.reduceOp), 0) if opts is not None else 0
    root = getattr(next((a for a in args if hasattr(a, "rootRank")), None), "rootRank", 0)
    with _lock:  # NCCL numbers a communicator's operations
        counter = getattr(group, "_sim_nccl_op_count", None)
        if counter is None:
            counter = group._sim_nccl_op_count = itertools.count()
        number = next(counter)
    line = (
        f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()} [{gpu}] NCCL INFO {name}: "
        f"opCount {number:x} sendbuff 0x{_address(send):x} recvbuff 0x{_address(recv):x} count {counted.numel()} "
        f"datatype {DATATYPES.get(counted.dtype, 7)} op {op} root {root} comm 0x{id(group):x} "
        f"[nranks={group.size()}] stream 0x{id(group) + 1:x}\n"
    )
    _write(line)


def _flat(values: Any) -> list[Any]:
    out: list[Any] = []
    for value in values:
        out.extend(_flat(value) if isinstance(value, (list, tuple)) else [value])
    return out


def _address(tensor: torch.Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # shapes only: no data
        return id(tensor)


def _write(line: str) -> None:
    path = os.environ.get("NCCL_DEBUG_FILE")
    if not path:
        sys.stdout.write(line)
        sys.stdout.flush()
        return
    path = path.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    with open(path, "a") as handle:  # ranks sharing one file each add their lines
        handle.write(line)
