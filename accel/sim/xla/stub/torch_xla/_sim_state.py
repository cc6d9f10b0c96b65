"""Per-rank state of the simulated XLA device, reset between tests by the simulator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: the seed the simulated XLA generator starts from (and returns to on reset)
DEFAULT_SEED = 101

rng_seed = DEFAULT_SEED
#: number of graph cuts (`torch_xla.sync` / `xm.mark_step`) since the last reset (tests read it)
steps = 0
#: `steps` when `torch_xla.debug.metrics.clear_counters` was last called
steps_cleared = 0
#: closures queued by `xm.add_step_closure`, run at the next graph cut
step_closures: list[Callable[[], Any]] = []
#: whether `torch_xla.compile` has said that it runs eagerly (once per process, or per task in warm ranks)
compile_warned = False
#: what `torch_xla.experimental.eager_mode` was last set to (torch_xla's default: off)
eager_mode = False
#: the persistent compilation cache path given to `torch_xla.runtime.initialize_cache`
cache_path: str | None = None
#: (default process group, replica group): the group xm's collectives use when the
#: default group is not an "xla" one (see `torch_xla.distributed.xla_backend.replica_group`)
replica_group: tuple[Any, Any] | None = None
#: tuple(map(tuple, groups)) -> this replica's sub-group, per default process group
sub_groups: dict[Any, Any] = {}


def reset() -> None:
    """Forget everything a test did to the simulated device."""
    global rng_seed, steps, steps_cleared, compile_warned, cache_path, replica_group, eager_mode
    rng_seed = DEFAULT_SEED
    steps = 0
    steps_cleared = 0
    step_closures.clear()
    compile_warned = False
    eager_mode = False
    cache_path = None
    replica_group = None
    sub_groups.clear()
