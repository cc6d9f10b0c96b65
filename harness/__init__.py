"""pytest plugin for multi-rank tests (loaded through the `pytest11` entry point).

    from harness import distributed_test

    @distributed_test(world_size=[2, 4], device=["cpu", "cuda", "xla"], timeout=30)
    def test_all_reduce(rank, world_size, tmp_path):
        ...  # runs inside every simulated rank, PartialState() ready

- The body runs in every rank of a warm pool; each test starts clean (environment,
  accel state, seeds, process group). `isolated=True` asks for fresh processes.
- Ranks are forked from a rank server that imported torch once and outlives the session,
  so the next `pytest` run (and every `-n N` worker) finds it warm; the first distributed
  test's ranks start while pytest still collects. A session's ranks end with it; the
  server stops after 15 idle minutes (`ACCEL_SIM_SERVER_IDLE` seconds), never serves a
  project whose files changed, and `ACCEL_SIM_SERVER=0` (the default when `CI` is set)
  gives each session its own fork server instead (`python -m accel.sim.runtime.server stop` stops
  this user's servers).
- Arguments: `rank`, `local_rank`, `world_size`, `device`, `tmp_path` (one directory
  shared by all ranks) and `pytest.mark.parametrize` values; lists of `world_size` /
  `device` parametrize. Other fixtures cannot cross into ranks and are refused.
- A rank that raises fails the test with its own traceback (`[rank N]` on each line);
  exits and signals are named; a hang fails after `timeout` with every live rank's
  stack. `pytest.skip` / `pytest.xfail` on any rank skip / xfail the test.
- Diagnoses: collectives are checked across ranks (a mismatch fails the test at once,
  naming each rank's call and line; `check_collectives=False` or
  `ACCEL_SIM_CHECK_COLLECTIVES=0` turn it off); ranks in collectives that can never
  complete fail within a second as a deadlock; a dead rank's last stderr lines are in
  the report; `world_size=1` has a process group of size 1.
- `faults=[...]` injects faults (`accel.sim.Fault` or specs such as
  "kill:rank=1:collective=3"; see `accel.sim.diagnoses.faults`).
- Works under `pytest -n N`, `coverage run -m pytest`, pytest-cov and hypothesis
  (every rank draws the same examples).
- Markers `gpu`, `multi_gpu`, `tpu` skip without that hardware; `--real-devices` runs
  `device="cuda"` tests on real GPUs (NCCL) when there are enough of them.
- Test functions must be importable from their module (module level or a test class).
"""

from harness.decorator import distributed_test

__all__ = ["distributed_test"]
