"""`torch._C`'s CUDA entry points that torch's own Python calls directly, answered for simulated GPUs.

Most of `torch.cuda` is patched at its Python functions (`fake`), but some callers go one level
lower: `torch.cuda._set_stream_by_id` and PyTorch's test helper `CudaNonDefaultStream` (which wraps
every CUDA device-type test) call `_cuda_setStream` and `_cuda_setDevice`; `torch.cuda._sleep` calls
`_cuda_sleep` to keep a stream busy; the tests' memory-leak check clears cuBLAS workspaces;
`torch.cuda.can_device_access_peer` (PyTorch's `requires_cuda_p2p_access`, Inductor's estimate of
NVLink) asks `_cuda_canDeviceAccessPeer`; `torch.cuda.graph` empties the pinned-memory cache
(`_host_emptyCache`) before it captures. A CPU
build of torch has none of them and a CUDA build's would ask the real driver.

Work on a simulated GPU is finished when it is issued, so a stream kept busy by `_sleep` is free
again at once: code that checks overlap by querying a busy stream sees it done, as it would on a
GPU fast enough to finish before the query.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.kernels import blas
from accel.sim.cuda.torch_cuda import streams

#: torch's DeviceType number of CUDA (c10/core/DeviceType.h)
_CUDA_TYPE = 1


def set_stream(stream_id: int = 0, device_index: int = 0, device_type: int = _CUDA_TYPE) -> None:
    """`torch._C._cuda_setStream`: make the stream of that id current on GPU `device_index`, and that GPU current
    (as THCPModule_setStream_wrap does). Every simulated stream reports the default stream's id (`Stream.stream_id`),
    so the id names the default stream: work on any stream is finished when issued, so results are the same."""
    if device_type != _CUDA_TYPE:
        raise RuntimeError(f"Expected a CUDA stream, got a stream of device type {device_type}")
    if cuda_state.gpus().current != device_index:
        torch.cuda.set_device(device_index)
    streams.set_stream(streams.Stream(device_index, _sim_id=0))


def sleep(cycles: int) -> None:
    """`torch._C._cuda_sleep`: a kernel that spins for `cycles` on the current stream, done when issued here."""
    if int(cycles) < 0:
        raise RuntimeError(f"cycles must be non-negative, got {cycles}")


def can_access_peer(device: int, peer: int) -> bool:
    """`torch._C._cuda_canDeviceAccessPeer`: GPUs of one node reach each other's memory (NVLink or PCIe peer
    access, as on the data-centre nodes simulated); a GPU is not its own peer, as cudaDeviceCanAccessPeer says."""
    return int(device) != int(peer)


def answers() -> dict[str, Any]:
    """Each entry point of `torch_internals.CUDA_ENTRY_POINTS` -> its simulated-GPU answer."""
    return {
        "_cuda_setStream": set_stream,
        "_cuda_setDevice": lambda device: torch.cuda.set_device(device),
        "_cuda_getDevice": lambda: torch.cuda.current_device(),
        "_cuda_sleep": sleep,
        "_cuda_canDeviceAccessPeer": can_access_peer,
        "_host_emptyCache": lambda: None,  # pinned memory here is host memory marked pinned: no cache to empty
        "_cuda_clearCublasWorkspaces": blas.clear,
    }


def install() -> None:
    """Serve the entry points (once per simulated GPU rank)."""
    torch_internals.serve_cuda_entry_points(answers())
