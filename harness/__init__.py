"""pytest plugin for multi-rank tests (see harness.plugin).

    from harness import distributed_test

    @distributed_test(world_size=[2, 4], device=["cpu", "cuda", "xla"])
    def test_all_reduce(rank, world_size):
        ...  # runs inside every simulated rank
"""

from harness.decorator import distributed_test

__all__ = ["distributed_test"]
