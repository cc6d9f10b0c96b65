"""Simulator: N real Gloo ranks on one machine, fake CUDA and XLA.

`launch(fn, args, world_size=N, device="cpu"|"cuda"|"xla")` runs `fn` on N rank
processes, each with a real Gloo process group and `accel`'s state set up as on that
hardware, and returns what each rank returned; failures raise `DistributedFailure`.
The parent side imports no torch: ranks are forked from a server that did.

Modules: `launcher` (launch), `manager` (warm pools per configuration), `pool` (one
pool of ranks, parent side), `worker` and `cleanslate` (inside a rank), `forking` (the
fork server), `failures` (what went wrong where), `stacks`, `serialize`,
`coverage_support`; `devices`, `fake_cuda`, `fake_xla` (the simulated hardware).

Environment knobs: `ACCEL_SIM_START_TIMEOUT` (seconds a pool may take to start,
default 120), `ACCEL_SIM_MAX_WARM_RANKS` (idle warm ranks kept per process, default 32).
"""

from accel.sim.failures import DistributedFailure, DistributedTimeout, RankFailure
from accel.sim.launcher import launch

__all__ = ["launch", "DistributedFailure", "DistributedTimeout", "RankFailure"]
