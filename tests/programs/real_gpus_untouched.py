"""A process with a CUDA build of torch, on a simulated node: nothing may reach the CUDA driver.

Every entry point of torch's C extension that talks to the CUDA runtime or driver (and NVML's
device count) is replaced by a tripwire before the node boots, so that on a host with real GPUs
this run would have touched none of them. Prints one JSON line of what the process saw.
"""

import json
import os
import sys

import torch

# the C entry points that reach the CUDA runtime or driver (present in CUDA builds only)
DEVICE_CALLS = [
    "_cuda_init",
    "_cuda_getDeviceCount",
    "_cuda_getDevice",
    "_cuda_setDevice",
    "_cuda_exchangeDevice",
    "_cuda_maybeExchangeDevice",
    "_cuda_synchronize",
    "_cuda_getCurrentStream",
    "_cuda_getDefaultStream",
    "_cuda_setStream",
    "_cuda_getCurrentRawStream",
    "_cuda_emptyCache",
    "_cuda_memoryStats",
    "_cuda_memorySnapshot",
    "_cuda_getCurrentBlasHandle",
    "_cuda_hasPrimaryContext",
    "_cuda_canDeviceAccessPeer",
    "_cuda_resetPeakMemoryStats",
    "_cudart",
]
touched: list[str] = []


def tripwire(name):
    def called(*args, **kwargs):
        touched.append(name)
        raise RuntimeError(f"the simulated node reached the real CUDA driver: torch._C.{name}")

    return called


wired = [name for name in DEVICE_CALLS if hasattr(torch._C, name)]
for name in wired:
    setattr(torch._C, name, tripwire(name))
for name in ("_raw_device_count_nvml", "_raw_device_uuid_nvml"):
    if hasattr(torch.cuda, name):
        setattr(torch.cuda, name, tripwire(name))

os.environ["ACCEL_SIMULATE"] = sys.argv[1]
from accel.sim.node import start  # noqa: E402  (after the tripwires: the node boots now)

start.start()
torch.cuda.set_device(3)
model = torch.nn.Linear(64, 64).cuda()
optimizer = torch.optim.AdamW(model.parameters())
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = model(torch.randn(8, 64, device="cuda")).float().pow(2).mean()
loss.backward()
optimizer.step()
torch.cuda.synchronize()
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    torch.ones(4, device="cuda").sum().item()
free, total = torch.cuda.mem_get_info()
torch.cuda.empty_cache()
print(
    json.dumps(
        {
            "cuda_build": torch.version.cuda if torch.backends.cuda.is_built() else None,
            "wired": wired,
            "touched": touched,
            "count": torch.cuda.device_count(),
            "current": torch.cuda.current_device(),
            "name": torch.cuda.get_device_name(),
            "param_device": str(next(model.parameters()).device),
            "peak": torch.cuda.max_memory_allocated(),
            "total": total,
        }
    )
)
