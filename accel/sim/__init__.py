"""Simulator: N real Gloo ranks on one machine, fake CUDA and XLA.

`launch(fn, args, world_size=N, device="cpu"|"cuda"|"xla")` runs `fn` on N rank
processes, each with a real Gloo process group and `accel`'s state set up as on that
hardware, and returns what each rank returned; failures raise `DistributedFailure`.
The parent side imports no torch: ranks are forked from a server that did.

Subpackages, one concern each (a new kind of simulated device is one new subpackage):

* `runtime`: the ranks themselves: `launcher` (launch), `manager` (warm pools per
  configuration), `pool` (one pool of ranks, parent side), `worker` and `cleanslate`
  (inside a rank), `forking` and `server` (the fork server, the rank server), typed
  `messages`, `serialize`, `output`, `coverage_support`, `torchrun_env`, `adopt_group`.
* `diagnoses`: collectives are checked across ranks (`collectives`: a mismatch raises
  `CollectiveMismatch` naming each rank's call), ranks left waiting in a collective their
  peers will never join fail at once (`deadlock`: `DistributedDeadlock`), what went wrong
  where (`failures`, `stacks`), the hint for a script without a `__main__` guard (`guard`),
  injected faults (`faults`: `Fault`, `parse_fault`, and `fault_point(name)`, a no-op
  outside the simulator).
* `core`: what every simulated device shares: the wrapper tensor, device rules, the hidden
  device, autocast, the carried collectives and `torch_internals` (every private torch API).
* `cuda`: the simulated GPU, in rooms (`gpus`, `memory`, `tensors`, `kernels`, `attention`,
  `nccl`, `torch_cuda`, `timing`; its `__init__` maps them; `fake` installs it in a rank);
  `xla`: the simulated TPU (`device`, `bridge`, and the stand-in `torch_xla` in `xla/stub`).

`devices` installs the simulated device a rank asks for (`device_names` lists them).

Environment knobs: `ACCEL_SIM_START_TIMEOUT` (seconds a pool may take to start,
default 120), `ACCEL_SIM_MAX_WARM_RANKS` (idle warm ranks kept per process, default 32),
`ACCEL_SIM_CHECK_COLLECTIVES` (0 turns the collective check off), `ACCEL_SIM_CHECK_TIMEOUT`
(seconds a rank waits for its peers in the check, default 1800), `ACCEL_SIM_GPU` (the card
each simulated GPU is, `cuda.gpus.cards`), `ACCEL_SIM_GPU_MEMORY` (0 turns GPU memory counting off).
"""

from typing import TYPE_CHECKING

from accel._lazy import lazy_exports

# Lazy, so that a process on a simulated node (`accel.sim.node`, started from a .pth file at
# interpreter start) pays nothing for the launcher it does not use.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "accel.sim.diagnoses.failures": [
            "CollectiveMismatch",
            "DistributedDeadlock",
            "DistributedFailure",
            "DistributedTimeout",
            "RankFailure",
        ],
        "accel.sim.diagnoses.faults": ["Fault", "InjectedFault", "fault_point", "parse_fault"],
        "accel.sim.runtime.launcher": ["launch"],
    },
)

if TYPE_CHECKING:
    from accel.sim.cuda.memory.report import MemoryReport
    from accel.sim.cuda.torch_cuda.properties import PeakMemory
    from accel.sim.diagnoses.failures import (
        CollectiveMismatch,
        DistributedDeadlock,
        DistributedFailure,
        DistributedTimeout,
        RankFailure,
    )
    from accel.sim.diagnoses.faults import Fault, InjectedFault, fault_point, parse_fault
    from accel.sim.runtime.launcher import launch


def peak_memory(device: object = None) -> "PeakMemory":
    """In a simulated GPU rank: the peak memory of GPU `device` (default: current), a `PeakMemory`.

    `.allocated` and `.reserved` are the peaks of `torch.cuda.memory_allocated` and
    `memory_reserved` since CUDA started in the rank (or the last `reset_peak_memory_stats`),
    `.capacity` the card's memory: ``assert accel.sim.peak_memory().reserved < 40 * 2**30``.
    """
    from accel.sim.cuda.torch_cuda import properties as cuda_properties

    return cuda_properties.peak_memory(device)


def memory_report(device: object = None) -> "MemoryReport":
    """In a simulated GPU rank: what used GPU `device`'s memory (default: current), a `MemoryReport`.

    `.peak_allocated` / `.peak_reserved` are the whole run's peaks (since CUDA started in the rank,
    whatever `reset_peak_memory_stats()` came between). With ``ACCEL_SIM_MEMORY_REPORT`` set (or
    `report_memory=` given to `launch` / `distributed_test`), `.at_peak` and `.now` give the bytes
    by category (parameters, buffers, gradients, optimizer state, activations, temporaries,
    collective buffers, other), `.top_modules` the modules holding the most at the peak, and
    `.at_out_of_memory` the breakdown at the last out-of-memory: ``accel.sim.memory_report().at_peak["activations"]``.
    """
    from accel.sim.cuda.torch_cuda import properties as cuda_properties

    return cuda_properties.memory_report(device)


__all__ = [
    "launch",
    "DistributedFailure",
    "DistributedTimeout",
    "DistributedDeadlock",
    "CollectiveMismatch",
    "RankFailure",
    "Fault",
    "InjectedFault",
    "fault_point",
    "parse_fault",
    "peak_memory",
    "memory_report",
]
