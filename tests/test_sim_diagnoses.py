"""Diagnoses and injected faults of `accel.sim.launch`, on several real ranks.

World size 1 has a process group; mismatched collectives fail at once naming each rank's
call and line; ranks left in a collective their peers will never join fail as a
deadlock, not at the timeout; a dead rank's last stderr lines are in the report; faults
(kill, raise, stall) fire at a rank's N-th collective or at `fault_point`.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accel.sim import (
    CollectiveMismatch,
    DistributedDeadlock,
    DistributedFailure,
    DistributedTimeout,
    Fault,
    InjectedFault,
    fault_point,
    launch,
    parse_fault,
)
from accel.sim.diagnoses.faults import as_faults
from accel.sim.diagnoses.guard import has_main_guard

HERE = os.path.abspath(__file__)

# -- functions the ranks run (module level: sent by reference) ---------------------------


def group_of_one():
    import torch
    import torch.distributed as dist

    from accel.state import PartialState

    device = PartialState().device
    value = torch.tensor([3.0], device=device)  # NCCL and torch_xla's group take their device's tensors only
    dist.all_reduce(value)
    return dist.is_initialized(), dist.get_world_size(), dist.get_rank(), value.item()


def reduce_or_broadcast():
    import torch
    import torch.distributed as dist

    value = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(value)  # LINE-ALL-REDUCE
    else:
        dist.broadcast(value, src=0)  # LINE-BROADCAST


def sum_or_max():
    """Ranks disagree on the reduce op only: Gloo runs it anyway, the check does not."""
    import torch
    import torch.distributed as dist

    value = torch.ones(2)
    dist.all_reduce(value, op=dist.ReduceOp.SUM if dist.get_rank() == 0 else dist.ReduceOp.MAX)
    return "ran"


def scatter_sum_or_max():
    """reduce_scatter_single (what torch 2.14 asks reduce_scatter_tensor's callers to use), ops differing."""
    import torch
    import torch.distributed as dist

    output, input = torch.empty(1, device="cuda"), torch.ones(2, device="cuda")
    dist.reduce_scatter_single(output, input, op=dist.ReduceOp.SUM if dist.get_rank() == 0 else dist.ReduceOp.MAX)


def shapes_differ_in_a_subgroup():
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    if dist.get_rank() < 2:
        dist.all_reduce(torch.ones(2 + dist.get_rank()), group=group)


def object_collectives_agree():
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank()})
    shared = [dist.get_rank() * 10]
    dist.broadcast_object_list(shared, src=1)
    return gathered, shared[0]


def store_keys_after_tasks():
    """Keys in the rendezvous store after each of a few simulated tasks (run inside one rank task)."""
    import torch
    import torch.distributed as dist

    from accel.sim.diagnoses import collectives

    watch = collectives._watch
    task = watch.task
    counts = []
    for extra in range(1, 5):
        watch.begin(task + 1000 * extra, check=True)
        for _ in range(5):
            dist.all_reduce(torch.ones(1))
        dist.barrier()
        watch.forget_finished()  # as a rank does once it has answered a task
        dist.barrier()  # both have: the count is the same whichever rank reads it
        counts.append(watch._store().num_keys())
        dist.barrier()
    watch.begin(task, check=True)
    return counts


def late_rank_one():
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3)
    dist.all_reduce(torch.ones(1))


def debug_level():
    import torch.distributed as dist

    return dist.get_debug_level().name


def only_rank_zero_reduces():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(2))  # LINE-LONELY


def groups_in_opposite_orders():
    import torch
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # LINE-WORLD-FIRST
        dist.all_reduce(torch.ones(1), group=pair)
    else:
        dist.all_reduce(torch.ones(1), group=pair)  # LINE-PAIR-FIRST
        dist.all_reduce(torch.ones(1))


def receive_from_a_rank_that_returned():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.recv(torch.zeros(2), src=1)  # LINE-RECV


def steps(count):
    import torch
    import torch.distributed as dist

    done = []
    for step in range(count):
        dist.all_reduce(torch.ones(1))
        fault_point(f"after_step_{step}")
        done.append(step)
    return done


def complain_then_die():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("loading shard 7 of 8", file=sys.stderr)
        print("fatal: shard 7 is corrupt", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)
    dist.barrier()


def _line(marker):
    with open(HERE) as handle:
        for number, line in enumerate(handle, 1):
            if f"# {marker}" in line and "def _line" not in line:
                return number
    raise AssertionError(marker)


# -- world size 1 ------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda", "xla"])
def test_one_rank_has_a_process_group_of_size_one(device):
    assert launch(group_of_one, world_size=1, device=device) == [(True, 1, 0, 3.0)]


# -- collective mismatch -----------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_mismatched_collectives_fail_at_once_naming_each_call_and_line(world_size):
    with pytest.raises(DistributedFailure) as info:
        launch(reduce_or_broadcast, world_size=world_size, timeout=60)
    error = info.value
    others = "rank 1" if world_size == 2 else f"ranks 1–{world_size - 1}"
    assert error.summary.startswith(
        f"collective mismatch: rank 0 all_reduce(float32[4]) at test_sim_diagnoses.py:{_line('LINE-ALL-REDUCE')}; "
        f"{others} broadcast(float32[4], src=0) at test_sim_diagnoses.py:{_line('LINE-BROADCAST')}"
    )
    assert set(error.failures) == set(range(world_size))
    for failure in error.failures.values():
        assert isinstance(failure.exception, CollectiveMismatch)
        assert failure.exception.calls[0] == ("all_reduce(float32[4])", f"{HERE}:{_line('LINE-ALL-REDUCE')}")
        # the traceback ends at the user's call, not inside the simulator
        frames = [line.strip() for line in failure.traceback.splitlines() if line.strip().startswith("File ")]
        assert frames[-1].startswith(f'File "{HERE}"'), failure.traceback
    assert f"{HERE}:{_line('LINE-BROADCAST')}" in str(error)


def test_reduce_ops_and_subgroups_are_checked_too():
    with pytest.raises(DistributedFailure, match=r"rank 0 all_reduce\(float32\[2\], op=SUM\).*rank 1 all_reduce"):
        launch(sum_or_max, world_size=2)
    with pytest.raises(DistributedFailure) as info:
        launch(shapes_differ_in_a_subgroup, world_size=3)
    assert "rank 0 all_reduce(float32[2])" in info.value.summary
    assert "rank 1 all_reduce(float32[3])" in info.value.summary
    assert "(ranks 0–1)" in info.value.summary
    assert set(info.value.failures) == {0, 1}  # rank 2 returned: it was not in the group
    with pytest.raises(DistributedFailure, match=r"rank 0 reduce_scatter_single\(float32\[2\], op=SUM\).*rank 1"):
        launch(scatter_sum_or_max, world_size=2, device="cuda")


def test_the_check_can_be_turned_off_by_argument_and_by_environment(monkeypatch):
    assert launch(sum_or_max, world_size=2, check_collectives=False) == ["ran", "ran"]
    monkeypatch.setenv("ACCEL_SIM_CHECK_COLLECTIVES", "0")
    assert launch(sum_or_max, world_size=2) == ["ran", "ran"]
    monkeypatch.setenv("ACCEL_SIM_CHECK_COLLECTIVES", "maybe")
    with pytest.raises(ValueError, match="ACCEL_SIM_CHECK_COLLECTIVES"):
        launch(sum_or_max, world_size=2)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_agreeing_collectives_pass_the_check(device):
    results = launch(object_collectives_agree, world_size=3, device=device)
    assert results == [([{"rank": 0}, {"rank": 1}, {"rank": 2}], 10)] * 3
    assert launch(steps, args=(40,), world_size=4) == [list(range(40))] * 4  # store keys are reused safely


def test_torch_distributed_debug_of_the_launch_environment_reaches_the_ranks(monkeypatch):
    # torch reads it at import, which the fork server did with its own environment
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert launch(debug_level, world_size=2, isolated=True) == ["DETAIL", "DETAIL"]


def test_the_check_waits_for_peers_no_longer_than_its_timeout(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_CHECK_TIMEOUT", "1")
    with pytest.raises(DistributedFailure) as info:
        launch(late_rank_one, world_size=2, isolated=True, timeout=60)
    failure = info.value.failures[0]
    assert failure.exc_type == "TimeoutError"
    assert failure.message.startswith("rank 0 waited 1 s for rank 1 to reach collective #1 of group default")
    assert "ACCEL_SIM_CHECK_TIMEOUT" in failure.message


# -- deadlock ----------------------------------------------------------------------------


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_left_in_a_collective_is_a_deadlock_not_a_timeout(world_size, check):
    with pytest.raises(DistributedDeadlock) as info:
        launch(only_rank_zero_reduces, world_size=world_size, timeout=120, check_collectives=check)
    error = info.value
    others = "rank 1" if world_size == 2 else f"ranks 1–{world_size - 1}"
    assert error.summary.startswith(
        f"deadlock: rank 0 waits in all_reduce (its collective #1) at {HERE}:{_line('LINE-LONELY')}; "
        f"{others} already returned"
    )
    assert list(error.failures) == [0]
    assert f"line {_line('LINE-LONELY')} in only_rank_zero_reduces" in error.failures[0].stack
    assert "in all_reduce" in error.failures[0].stack
    assert not isinstance(error, DistributedTimeout)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_ranks_waiting_for_each_other_in_different_groups_are_a_deadlock(check):
    with pytest.raises(DistributedDeadlock) as info:
        launch(groups_in_opposite_orders, world_size=2, timeout=120, check_collectives=check)
    assert info.value.summary == (
        f"deadlock: rank 0 waits in all_reduce (its collective #1) at {HERE}:{_line('LINE-WORLD-FIRST')}; "
        f"rank 1 waits in all_reduce (its collective #1) at {HERE}:{_line('LINE-PAIR-FIRST')}; "
        "each waits for another: none of these collectives can complete (device 'cpu')"
    )


def test_a_receive_from_a_rank_that_returned_is_a_deadlock():
    with pytest.raises(DistributedDeadlock) as info:
        launch(receive_from_a_rank_that_returned, world_size=2, timeout=120)
    assert info.value.summary.startswith(
        f"deadlock: rank 0 waits in recv from rank 1 at {HERE}:{_line('LINE-RECV')}; rank 1 already returned"
    )


def test_many_tasks_leave_no_signatures_behind_in_the_store():
    # each task's keys are deleted once the next one has ended: thousands of tests do not grow the store
    counts = [count for rank_counts in launch(store_keys_after_tasks, world_size=2) for count in rank_counts]
    assert max(counts) - min(counts) <= 2, counts  # 4 more keys per task if they were kept


# -- dead ranks --------------------------------------------------------------------------


def test_a_dead_rank_brings_its_last_stderr_lines():
    with pytest.raises(DistributedFailure) as info:
        launch(complain_then_die, world_size=2)
    failure = info.value.failures[1]
    assert failure.kind == "exit" and failure.exitcode == 3
    assert failure.stderr.splitlines() == ["loading shard 7 of 8", "fatal: shard 7 is corrupt"]
    assert "[rank 1] its last lines on stderr:\n[rank 1]     loading shard 7 of 8" in str(info.value)


def test_a_script_without_a_main_guard_gets_a_hint(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import accel.sim

            def work():
                return 1

            accel.sim.launch(work, world_size=2)
            """
        )
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "failed to start" in run.stderr
    assert f'hint: {script} has no `if __name__ == "__main__":` guard' in run.stderr
    assert has_main_guard('if __name__ == "__main__":\n    main()\n')
    assert has_main_guard("if '__main__' == __name__:\n    main()\n")
    assert not has_main_guard("main()\n")


# -- injected faults ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_kill_at_the_nth_collective(world_size):
    with pytest.raises(DistributedFailure) as info:
        launch(steps, args=(5,), world_size=world_size, faults=[f"kill:rank={world_size - 1}:collective=3"])
    error = info.value
    victim = error.failures[world_size - 1]
    assert victim.kind == "signal" and victim.signal_name == "SIGKILL"
    assert "injected fault kill:rank=" in victim.stderr and "before its collective #3" in victim.stderr
    assert list(error.failures) == [world_size - 1]  # the others are victims, stopped
    assert set(error.stopped) == set(range(world_size - 1))
    assert all("waits in all_reduce (its collective #3)" in f.headline() for f in error.stopped.values())


def test_raise_at_a_named_point_and_at_a_collective():
    with pytest.raises(DistributedFailure) as info:
        launch(steps, args=(4,), world_size=2, faults=[Fault("raise", rank=0, point="after_step_1")])
    failure = info.value.failures[0]
    assert isinstance(failure.exception, InjectedFault)
    assert "fault_point('after_step_1')" in failure.message
    assert 'in steps\n    fault_point(f"after_step_{step}")' in failure.traceback
    with pytest.raises(DistributedFailure, match="raise:rank=1:collective=2"):
        launch(steps, args=(4,), world_size=2, faults=["raise:rank=1:collective=2"])


def test_a_stalled_rank_delays_but_does_not_fail_and_the_timeout_shows_where():
    assert (
        launch(steps, args=(3,), world_size=2, faults=["stall:rank=1:point=after_step_0:seconds=0.2"])
        == [[0, 1, 2]] * 2
    )
    with pytest.raises(DistributedTimeout) as info:
        launch(steps, args=(3,), world_size=2, timeout=2, faults=["stall:rank=1:collective=2:seconds=60"])
    assert "in _fire" in info.value.failures[1].stack and "in all_reduce" in info.value.failures[1].stack


def test_faults_fire_only_in_their_task():
    with pytest.raises(DistributedFailure):
        launch(steps, args=(2,), world_size=2, faults=["raise:rank=0:collective=1"])
    assert launch(steps, args=(2,), world_size=2) == [[0, 1]] * 2


def test_fault_point_is_a_no_op_outside_the_simulator():
    fault_point("after_save")


def test_parse_fault_grammar():
    assert parse_fault("kill:rank=1:collective=3") == Fault("kill", rank=1, collective=3)
    assert parse_fault("raise:rank=0:point=after_save") == Fault("raise", rank=0, point="after_save")
    assert parse_fault("stall:collective=5:rank=2:seconds=3") == Fault("stall", rank=2, collective=5, seconds=3.0)
    assert parse_fault("stall:rank=2:point=x").seconds == 5.0
    for spec in ("kill:rank=1:collective=3", "raise:rank=0:point=after_save", "stall:rank=2:collective=5:seconds=3"):
        assert parse_fault(spec).describe() == spec
    bad = {
        "explode:rank=1:collective=1": "unknown fault action 'explode'",
        "kill:collective=1": "says no rank",
        "kill:rank=1": "exactly one of them",
        "kill:rank=1:collective=1:point=p": "exactly one of them",
        "kill:rank=1:collective=0": "counts from 1",
        "kill:rank=-1:collective=1": "rank must be an int >= 0",
        "kill:rank=one:collective=1": "invalid literal",
        "kill:rank=1:collective": "is not NAME=VALUE",
        "kill:rank=1:rank=2:collective=1": "rank is given twice",
        "kill:rank=1:collective=1:when=now": "unknown field",
        "kill:rank=1:collective=1:seconds=2": "only a stall takes seconds",
        "kill:rank=1:point=": "is not NAME=VALUE",
    }
    for spec, message in bad.items():
        with pytest.raises(ValueError, match=message) as info:
            parse_fault(spec)
        assert repr(spec) in str(info.value)


def test_faults_naming_a_missing_rank_are_refused_before_launching():
    with pytest.raises(ValueError, match="names rank 4, but there are 2 ranks"):
        as_faults(["kill:rank=4:collective=1"], world_size=2)
    with pytest.raises(ValueError, match="names rank 2"):
        launch(steps, args=(1,), world_size=2, faults=["kill:rank=2:collective=1"])
    with pytest.raises(TypeError, match="faults must be"):
        as_faults([3])


def _write_board(path, state, **board):
    import json

    data = state + json.dumps(board).encode() + b"\0"
    path.write_bytes(data.ljust(4096, b"\0"))


def test_deadlock_watch_counts_what_finished_ranks_took_part_in(tmp_path, monkeypatch):
    from accel.sim.diagnoses import deadlock

    monkeypatch.setattr(deadlock, "SETTLE", 0.0)
    waiting = {"task": 7, "op": "all_reduce", "count": 2, "call": 2, "ranks": [0, 1], "group": "default", "seq": 2}
    _write_board(tmp_path / "rank0.board", b"W", **waiting, seqs={"default": 2})
    watch = deadlock.Watch(2, str(tmp_path), task=7)

    # rank 1 finished after its 2nd collective: it took part in the one rank 0 is leaving
    _write_board(tmp_path / "rank1.board", b"I", **{**waiting, "seqs": {"default": 2}})
    assert watch.stuck([0], finished={1}) == {} and watch.stuck([0], finished={1}) == {}

    # rank 1 finished after its 1st: rank 0's 2nd can never complete
    _write_board(tmp_path / "rank1.board", b"I", **{**waiting, "seqs": {"default": 1}})
    watch.stuck([0], finished={1})
    assert list(watch.stuck([0], finished={1})) == [0]

    # rank 1's board is from an earlier task: it did no collective in this one
    _write_board(tmp_path / "rank1.board", b"I", **{**waiting, "task": 6, "seqs": {"default": 5}})
    watch = deadlock.Watch(2, str(tmp_path), task=7)
    watch.stuck([0], finished={1})
    assert list(watch.stuck([0], finished={1})) == [0]

    # a rank that is not waiting (computing) means no verdict yet
    _write_board(tmp_path / "rank0.board", b"I", **waiting, seqs={"default": 2})
    assert watch.stuck([0], finished={1}) == {}


@given(
    action=st.sampled_from(["kill", "raise", "stall"]),
    rank=st.integers(0, 512),
    at=st.one_of(
        st.integers(1, 10**6).map(lambda n: {"collective": n}),
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,20}", fullmatch=True).map(lambda p: {"point": p}),
    ),
    seconds=st.floats(0, 1e9, allow_nan=False),
)
def test_every_fault_reads_back_from_its_spec(action, rank, at, seconds):
    fault = Fault(action, rank=rank, seconds=seconds if action == "stall" else 5.0, **at)
    assert parse_fault(fault.describe()) == fault
