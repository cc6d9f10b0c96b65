"""Per-rank state of the simulated XLA device, reset between tests by the simulator."""

from __future__ import annotations

#: the seed the simulated XLA generator starts from (and returns to on reset)
DEFAULT_SEED = 101

rng_seed = DEFAULT_SEED
#: number of `mark_step` calls since the last reset (tests read it)
steps = 0


def reset() -> None:
    """Forget everything a test did to the simulated device."""
    global rng_seed, steps
    rng_seed = DEFAULT_SEED
    steps = 0
