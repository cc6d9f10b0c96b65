"""Simulator: N real Gloo ranks on one machine, fake CUDA and XLA.

`launch(fn, args, world_size=N, device="cpu"|"cuda"|"xla")` runs `fn` on N rank
processes, each with a real Gloo process group and `accel`'s state set up as on that
hardware, and returns what each rank returned; failures raise `DistributedFailure`.
The parent side imports no torch: ranks are forked from a server that did.

Modules: `launcher` (launch), `manager` (warm pools per configuration), `pool` (one
pool of ranks, parent side), `worker` and `cleanslate` (inside a rank), `forking` (the
fork server), `failures` (what went wrong where), `stacks`, `serialize`,
`coverage_support`; `device_names`, `devices`, `fake_cuda`, `xla` (the simulated
hardware). Simulated GPUs (`fake_cuda`) are made of `cuda_tensor` (CUDA tensors held in
host memory), `device_rules` (CUDA's device checks and messages), `cuda_kernels`,
`cuda_autocast`, `cuda_checkpoint`, `cuda_state`, and `torch_internals` (every private
torch API they rely on).

Diagnoses: collectives are checked across ranks (`collectives`: a mismatch raises
`CollectiveMismatch` naming each rank's call), ranks left waiting in a collective their
peers will never join fail at once (`deadlock`: `DistributedDeadlock`), a dead rank's
last stderr lines are in the report (`guard`: the hint for a script without a
`__main__` guard). Faults can be injected (`faults`: `Fault`,
`parse_fault`, and `fault_point(name)`, a no-op outside the simulator). The messages
between the pool and its ranks are typed (`messages`).

Environment knobs: `ACCEL_SIM_START_TIMEOUT` (seconds a pool may take to start,
default 120), `ACCEL_SIM_MAX_WARM_RANKS` (idle warm ranks kept per process, default 32),
`ACCEL_SIM_CHECK_COLLECTIVES` (0 turns the collective check off), `ACCEL_SIM_CHECK_TIMEOUT`
(seconds a rank waits for its peers in the check, default 1800), `ACCEL_SIM_GPU` (the card
each simulated GPU is, `gpu_models`), `ACCEL_SIM_GPU_MEMORY` (0 turns GPU memory counting off).
"""

from typing import TYPE_CHECKING

from accel.sim.failures import (
    CollectiveMismatch,
    DistributedDeadlock,
    DistributedFailure,
    DistributedTimeout,
    RankFailure,
)
from accel.sim.faults import Fault, InjectedFault, fault_point, parse_fault
from accel.sim.launcher import launch

if TYPE_CHECKING:
    from accel.sim.cuda_properties import PeakMemory


def peak_memory(device: object = None) -> "PeakMemory":
    """In a simulated GPU rank: the peak memory of GPU `device` (default: current), a `PeakMemory`.

    `.allocated` and `.reserved` are the peaks of `torch.cuda.memory_allocated` and
    `memory_reserved` since CUDA started in the rank (or the last `reset_peak_memory_stats`),
    `.capacity` the card's memory: ``assert accel.sim.peak_memory().reserved < 40 * 2**30``.
    """
    from accel.sim import cuda_properties

    return cuda_properties.peak_memory(device)


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
]
