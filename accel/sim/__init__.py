"""Simulator: N real Gloo ranks on one machine, fake CUDA and XLA.

`launch(fn, args, world_size=N, device="cpu"|"cuda"|"xla")` runs `fn` on N rank
processes, each with a real Gloo process group and `accel`'s state set up as on that
hardware, and returns what each rank returned; failures raise `DistributedFailure`.
The parent side imports no torch: ranks are forked from a server that did.
"""

from accel.sim.failures import DistributedFailure, DistributedTimeout, RankFailure
from accel.sim.launcher import launch

__all__ = ["launch", "DistributedFailure", "DistributedTimeout", "RankFailure"]
