"""Run only some ranks of a shapes-only world, each standing in for the ranks its layout makes identical.

A shapes-only step of a 70B model on 64 simulated GPUs costs, run as one process per rank, 64
times one rank's Python work and host memory (`benchmarks/bench_plan_scale.py` measures it). In
the layouts people plan (FSDP x tensor parallelism, data parallelism), most ranks do exactly what
others do: same shapes, same collectives, same memory. `only_ranks` runs just the ranks asked
for, each as that rank of the full world (its torchrun environment, its place in the DeviceMesh,
its shards), with collectives that complete without the others (`accel.sim.cuda.nccl.stand_in`).

Which rank stands for which: the ranks run split the world into consecutive blocks, each run
rank standing for itself and the ranks after it up to the next run rank (the first also for
those before it). `--only_ranks 0,63` of 64: rank 0 for ranks 0-62, rank 63 for rank 63 (the
last rank is where uneven shards differ). Meshes lay out their outer dimension in consecutive
blocks of ranks (torchtitan's pipeline stages, torch's `init_device_mesh`), so one rank per
block, e.g. `0,16,32,48` for 4 pipeline stages of 16 ranks, stands for each stage.

What it assumes (printed at the end of a run, `StandIn.summary`): the ranks not run do what the
rank standing for them does (a symmetric layout), so they hold the same memory; the values
collectives would bring from the others are not computed (as in any shapes-only run; data
kept by small tensors come back as if every rank held this rank's), so control flow that depends
on other ranks' data is not modelled; what waits for absent ranks outside the simulated NCCL
groups (a Gloo group of the script's own, a store barrier) fails, saying so. Refused without
shapes only: with values, the results would be wrong.

This module runs in the parent and is free of torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from accel.sim.diagnoses.deadlock import ranges
from accel.sim.diagnoses.failures import DistributedFailure
from accel.sim.runtime import output
from accel.sim.runtime.pool import RankOutcome, RankPool

__all__ = ["StandIn", "plan", "run"]


@dataclasses.dataclass(frozen=True)
class StandIn:
    """The ranks a run runs (`ranks`, sorted) of a world of `world_size`."""

    world_size: int
    ranks: tuple[int, ...]

    def stands_for(self, rank: int) -> list[int]:
        """The ranks run rank `rank` stands for: itself up to the next run rank (the first: also those before)."""
        index = self.ranks.index(rank)
        first = 0 if index == 0 else rank
        last = self.ranks[index + 1] if index + 1 < len(self.ranks) else self.world_size
        return list(range(first, last))

    def describe(self) -> str:
        """Which ranks run, in a few words ("ranks 0, 63 of 64 run (only_ranks)")."""
        which = "rank" if len(self.ranks) == 1 else "ranks"
        return f"{which} {ranges(list(self.ranks))} of {self.world_size} run (only_ranks)"

    def rank_config(self, index: int) -> dict[str, Any]:
        """What process `index` of the pool is told at its start: which rank of which world it is."""
        return {"stand_in": {"rank": self.ranks[index], "world_size": self.world_size, "description": self.describe()}}

    def summary(self) -> str:
        """The end-of-run lines: which ranks stood for which, and what that assumes."""
        each = ", ".join(f"rank {rank} for {_ranks_text(self.stands_for(rank))}" for rank in self.ranks)
        return (
            f"accel.sim: {len(self.ranks)} of {self.world_size} ranks were run, each standing in for others: {each}.\n"
            "accel.sim: assumed: a rank not run does what the rank standing for it does (a symmetric layout: the "
            "same shapes, collectives and memory); collectives completed without the ranks not run and computed no "
            "values (shapes only; small tensors came back as if every rank held this rank's), so control flow that "
            "depends on other ranks' data is not modelled."
        )


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"


def plan(world_size: int, only_ranks: str | Iterable[int], shapes_only: bool, faults: Any = None) -> StandIn:
    """The `StandIn` of running `only_ranks` ("0,63", "0-3", or ints) of `world_size`; ValueError if it cannot be."""
    if not shapes_only:
        raise ValueError(
            "only_ranks runs some ranks without the others, whose data never arrive: it needs shapes only "
            "(--shapes_only, shapes_only=True), where no values are computed; with values every result would be "
            "wrong. Run every rank, or add --shapes_only."
        )
    ranks = output.parse_ranks(only_ranks) if isinstance(only_ranks, str) else frozenset(int(r) for r in only_ranks)
    outside = sorted(rank for rank in ranks if not 0 <= rank < world_size)
    if not ranks or outside:
        raise ValueError(
            f"only_ranks names {'no rank' if not ranks else f'rank(s) {outside} outside'} the world of {world_size} "
            f"ranks (0-{world_size - 1})"
        )
    if faults:
        raise ValueError("only_ranks with injected faults: a fault needs the ranks it affects; run every rank")
    return StandIn(world_size, tuple(sorted(ranks)))


def run(payload: bytes, stand_in: StandIn, device: str, timeout: float | None) -> list[RankOutcome]:
    """Run a serialised call on the ranks of `stand_in` (fresh processes); one outcome per rank run, numbered
    as the ranks of the full world."""
    pool = RankPool(len(stand_in.ranks), device, stand_in=stand_in)
    try:
        pool.start()
    except DistributedFailure as failure:  # numbered by pool process: say which ranks failed to start
        renumbered = {
            stand_in.ranks[k]: dataclasses.replace(f, rank=stand_in.ranks[k]) for k, f in failure.failures.items()
        }
        raise DistributedFailure(renumbered, None, stand_in.world_size, device, summary=failure.summary) from None
    try:
        # the collective check compares ranks with their peers, which are not there
        outcomes = pool.run(payload, timeout, check_collectives=False)
    finally:
        pool.kill()
    return [_renumbered(outcome, stand_in) for outcome in outcomes]


def _renumbered(outcome: RankOutcome, stand_in: StandIn) -> RankOutcome:
    """`outcome` of pool process k as rank `stand_in.ranks[k]`'s."""
    rank = stand_in.ranks[outcome.rank]
    failure = dataclasses.replace(outcome.failure, rank=rank) if outcome.failure is not None else None
    return dataclasses.replace(outcome, rank=rank, failure=failure)
