"""The harness diagnoses, through pytest's own `pytester`: serial, under `-n 2`, and nothing left running.

One test file exercises them all: a world of one rank has a process group; mismatched
collectives fail at once naming each rank's call and line (unless `check_collectives=False`);
a rank left alone in a collective fails as a deadlock, not at the timeout; a dead rank's
last stderr lines are in the report; faults injected from the decorator kill, raise in or
stall a rank.
"""

import re

import pytest
from harness_support import assert_nothing_left_running

pytest_plugins = ["pytester"]

NO_HYPOTHESIS = ("-p", "no:hypothesispytest")


@pytest.fixture(autouse=True)
def short_lived_rank_servers(monkeypatch):
    """The sessions started here have rank servers of their own (pytester's HOME is in their
    key): those need not wait long for a next session."""
    monkeypatch.setenv("ACCEL_SIM_SERVER_IDLE", "20")


DIAGNOSED = """
import os, pathlib, sys
from harness import distributed_test
from accel.sim import Fault, fault_point

PIDS = pathlib.Path(__file__).parent / "pids"


def record():
    # every rank process and the fork server it came from, to check nothing outlives the session
    PIDS.mkdir(exist_ok=True)
    (PIDS / str(os.getpid())).write_text(str(os.getppid()))


@distributed_test(world_size=1, device=["cpu", "cuda"])
def test_one_rank(rank, world_size):
    import torch.distributed as dist
    record()
    assert dist.is_initialized() and dist.get_world_size() == 1 and rank == 0


@distributed_test(world_size=2)
def test_mismatch(rank):
    import torch, torch.distributed as dist
    record()
    value = torch.ones(3)
    if rank == 0:
        dist.all_reduce(value)
    else:
        dist.all_gather_into_tensor(torch.empty(6), value)


@distributed_test(world_size=2, check_collectives=False)
def test_unchecked(rank):
    import torch, torch.distributed as dist
    record()
    dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)


@distributed_test(world_size=4, timeout=300)
def test_deadlock(rank):
    import torch, torch.distributed as dist
    record()
    if rank == 0:
        dist.all_reduce(torch.ones(2))


@distributed_test(world_size=2)
def test_dies(rank):
    import torch.distributed as dist
    record()
    if rank == 1:
        print("cannot open /data/shard1", file=sys.stderr, flush=True)
        os._exit(5)
    dist.barrier()


@distributed_test(world_size=2, faults=["kill:rank=1:collective=2"])
def test_killed_by_a_fault(rank):
    import torch, torch.distributed as dist
    record()
    for _ in range(3):
        dist.all_reduce(torch.ones(1))


@distributed_test(world_size=2, faults=["raise:rank=0:point=after_save"])
def test_raise_at_a_point(rank):
    record()
    fault_point("after_save")


@distributed_test(world_size=2, faults=[Fault("stall", rank=1, point="slow", seconds=0.1)])
def test_stall_then_pass(rank):
    import torch.distributed as dist
    record()
    fault_point("slow")
    dist.barrier()
"""

PASSED = 4  # test_one_rank[cpu], test_one_rank[cuda], test_unchecked, test_stall_then_pass
FAILED = 5


def _failure_section(output: str, test_name: str) -> str:
    match = re.search(rf"_+ {re.escape(test_name)} _+\n(.*?)(?=\n_{{3,}} |\n=+ )", output, re.S)
    assert match, f"no failure section for {test_name} in:\n{output}"
    return match.group(1)


def _assert_nothing_left_running(pytester, fork_servers: bool) -> None:
    """Every rank is gone; with `fork_servers`, so are the fork servers they came from (a rank
    server stays for the next session, without ranks).

    (A pytest run in this process shares this process's fork server, which stays.)
    """
    ranks, parents = set(), set()
    for path in (pytester.path / "pids").iterdir():
        ranks.add(int(path.name))
        parents.add(int(path.read_text()))
    assert len(ranks) >= 2
    assert_nothing_left_running(ranks, parents if fork_servers else set())


def _line_of(pytester, text: str) -> int:
    source = (pytester.path / "test_h_diagnosed.py").read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if text in line)


def test_diagnoses_in_one_session(pytester, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    pytester.makepyfile(test_h_diagnosed=DIAGNOSED)
    result = pytester.runpytest(*NO_HYPOTHESIS, "-rA", "-p", "no:randomly")
    result.assert_outcomes(passed=PASSED, failed=FAILED)
    output = result.stdout.str()

    mismatch = _failure_section(output, "test_mismatch")
    reduce_line, gather_line = _line_of(pytester, "dist.all_reduce(value)"), _line_of(pytester, "all_gather_into")
    assert (
        f"collective mismatch: rank 0 all_reduce(float32[3]) at test_h_diagnosed.py:{reduce_line}; "
        f"rank 1 all_gather_into_tensor(float32[3]) at test_h_diagnosed.py:{gather_line}"
    ) in mismatch
    assert "[rank 1] CollectiveMismatch: collective mismatch" in mismatch

    deadlock = _failure_section(output, "test_deadlock")
    lonely = _line_of(pytester, "        dist.all_reduce(torch.ones(2))")
    assert re.search(
        rf"deadlock: rank 0 waits in all_reduce \(its collective #1\) at \S*test_h_diagnosed.py:{lonely}; "
        r"ranks 1–3 already returned",
        deadlock,
    )
    assert re.search(rf"\[rank 0\] .*line {lonely} in test_deadlock", deadlock)
    assert "timed out" not in deadlock

    dies = _failure_section(output, "test_dies")
    assert "[rank 1] exited with code 5 before returning" in dies
    assert "[rank 1] its last lines on stderr:\n[rank 1]     cannot open /data/shard1" in dies

    killed = _failure_section(output, "test_killed_by_a_fault")
    assert "[rank 1] killed by signal SIGKILL" in killed
    assert "injected fault kill:rank=1:collective=2: killing this rank before its collective #2" in killed
    assert "[rank 0] still running after another rank had failed (then stopped): it waits in all_reduce" in killed

    raised = _failure_section(output, "test_raise_at_a_point")
    assert "[rank 0] InjectedFault: injected fault (raise:rank=0:point=after_save)" in raised

    result.stdout.fnmatch_lines(["*FAILED*test_mismatch - rank 0: CollectiveMismatch: collective mismatch*"])
    _assert_nothing_left_running(pytester, fork_servers=False)


def test_diagnoses_under_xdist_and_nothing_left_running(pytester):
    pytester.makepyfile(test_h_diagnosed=DIAGNOSED)
    result = pytester.runpytest_subprocess(*NO_HYPOTHESIS, "-n", "2")
    result.assert_outcomes(passed=PASSED, failed=FAILED)
    for line in (
        "deadlock: rank 0 waits in all_reduce (its collective #1) at *:*; ranks 1–3 already returned*",
        "collective mismatch: rank 0 all_reduce(float32[[]3[]]) at *; rank 1 all_gather_into_tensor(float32[[]3[]])*",
        "[[]rank 1[]]     cannot open /data/shard1",
        "[[]rank 1[]]     accel.sim: injected fault kill:rank=1:collective=2: *",
        "[[]rank 0[]] InjectedFault: injected fault (raise:rank=0:point=after_save)*",
    ):
        result.stdout.fnmatch_lines([line])
    _assert_nothing_left_running(pytester, fork_servers=True)


@pytest.mark.parametrize("knob", ["0", "1"])
def test_the_environment_knob_turns_the_check_off(pytester, monkeypatch, knob):
    pytester.makepyfile(
        test_h_knob="""
        from harness import distributed_test

        @distributed_test(world_size=2)
        def test_ops_differ(rank):
            import torch, torch.distributed as dist
            dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        """
    )
    monkeypatch.setenv("ACCEL_SIM_CHECK_COLLECTIVES", knob)
    result = pytester.runpytest(*NO_HYPOTHESIS)
    if knob == "0":
        result.assert_outcomes(passed=1)
    else:
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["*rank 0 all_reduce(float32[[]2[]], op=SUM)*rank 1 all_reduce(*op=MAX)*"])


def test_decorator_refuses_bad_faults_and_check_values():
    from harness import distributed_test

    with pytest.raises(ValueError, match="unknown fault action"):
        distributed_test(faults=["boom:rank=0:collective=1"])
    with pytest.raises(TypeError, match="check_collectives"):
        distributed_test(check_collectives="yes")


# -- the collective check's exchange (accel.sim.diagnoses.collectives) -----------------------------------


def checked_collectives_and_store_keys(long_signatures, path):
    """Agreeing collectives (short signatures, and long ones published as digests) with the check's
    signatures through a shared-memory exchange at `path` (installed here: a warm pool's ranks may have
    started with the store's); the store's key count before and after."""
    import torch
    import torch.distributed as dist

    from accel.sim.diagnoses import collectives

    watch = collectives._watch
    kept = watch.exchange
    watch.exchange = collectives._Exchange(path, dist.get_rank(), dist.get_world_size())
    try:
        before = watch._store().num_keys()
        for _ in range(20):
            value = torch.ones(2)
            dist.all_reduce(value)
        outputs = [torch.zeros(3) for _ in range(long_signatures)]
        dist.all_reduce_coalesced(outputs)
        dist.barrier()
        return watch._store().num_keys() - before, value.tolist()
    finally:
        watch.exchange = kept


def long_signatures_differ():
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    # 30 tensors each: the signature is long (a digest crosses the exchange), and rank 1's last differs
    tensors = [torch.ones(3) for _ in range(29)] + [torch.ones(3 if rank == 0 else 4)]
    dist.all_reduce_coalesced(tensors)


@pytest.mark.parametrize("long_signatures", [1, 30])
def test_the_check_goes_through_shared_memory_not_the_store(tmp_path, long_signatures):
    from accel.sim import launch
    from accel.sim.diagnoses.collectives import _SYS_FUTEX

    if _SYS_FUTEX is None:
        pytest.skip("no futex(2) on this machine: the check goes through the store")
    path = str(tmp_path / "check.shm")
    results = launch(checked_collectives_and_store_keys, args=(long_signatures, path), world_size=4)
    # no key added by the check (through the store, each rank adds its own); the count may drop meanwhile:
    # the ranks drop the store keys of the task before in the background
    assert [values for _, values in results] == [[4.0, 4.0]] * 4
    assert all(added <= 0 for added, _ in results), results


@pytest.mark.parametrize("exchange", ["shm", "store"])
def test_a_mismatch_of_long_signatures_is_reported_in_full_either_way(monkeypatch, exchange):
    from accel.sim import DistributedFailure, launch

    monkeypatch.setenv("ACCEL_SIM_CHECK_EXCHANGE", exchange)
    with pytest.raises(DistributedFailure) as info:
        launch(long_signatures_differ, world_size=2, isolated=True, timeout=60)
    calls = info.value.failures[1].exception.calls
    assert calls[0][0] == "all_reduce_coalesced([" + "float32[3], " * 29 + "float32[3]])"
    assert calls[1][0] == "all_reduce_coalesced([" + "float32[3], " * 29 + "float32[4]])"
    assert all(
        where.endswith(f"test_harness_diagnoses.py:{_line_here('dist.all_reduce_coalesced(tensors)')}")
        for _, where in calls.values()
    )


def _line_here(text):
    with open(__file__) as handle:
        return next(number for number, line in enumerate(handle, 1) if line.strip() == text)


def test_the_exchange_hands_each_peer_the_signature_it_waits_for(tmp_path, monkeypatch):
    import threading
    import time

    from accel.sim.diagnoses import collectives
    from accel.sim.diagnoses.collectives import _SYS_FUTEX, _Exchange

    if _SYS_FUTEX is None:
        pytest.skip("no futex on this machine: the check goes through the store")
    path = str(tmp_path / "check.shm")
    mine, peer = _Exchange(path, 0, 2), _Exchange(path, 1, 2)
    assert mine.collect([1], 5, "default", 1, timeout=0.2) is None  # nothing published: the timeout
    # The waiter sleeps on the peer's futex for the whole timeout unless the publish wakes it
    # (its usual slice would have it look again anyway): a lost wake-up returns after 20 s.
    monkeypatch.setattr(collectives, "_WAIT_SLICE", 20.0)
    later = threading.Timer(0.2, peer.publish, args=(5, "default", 1, "all_reduce(float32[2])"))
    start = time.monotonic()
    later.start()
    assert mine.collect([1], 5, "default", 1, timeout=20) == {1: "all_reduce(float32[2])"}
    waited = time.monotonic() - start
    later.join()
    assert waited < 10, f"the waiter saw the signature after {waited:.1f} s: the publish did not wake it"
    monkeypatch.undo()
    peer.publish(5, "default", 2, "barrier()")
    # one collective ahead, the peer still shows the one before; not another task's, nor another group's
    assert mine.collect([1], 5, "default", 1, timeout=1) == {1: "all_reduce(float32[2])"}
    assert mine.collect([1], 5, "default", 2, timeout=1) == {1: "barrier()"}
    assert mine.collect([1], 6, "default", 2, timeout=0.05) is None
    assert mine.collect([1], 5, "other", 1, timeout=0.05) is None
    long = "all_gather([" + ", ".join(["float32[3]"] * 50) + "])"
    peer.publish(5, "other", 1, long)
    assert mine.collect([1], 5, "other", 1, timeout=1)[1].startswith("#")  # a digest of it


def test_the_exchange_never_hands_out_a_half_written_slot(tmp_path):
    """A rank preempted while it rewrites its slot leaves it half new, half old; cut inside a signature
    in both, the mix parses and names another collective (seen in a full suite: the peers that read it
    saw a mismatch no other rank saw, and waited for the others' details until the timeout)."""
    import json
    import threading

    from accel.sim.diagnoses import collectives
    from accel.sim.diagnoses.collectives import _SYS_FUTEX, SLOT_SIZE, _Exchange

    if _SYS_FUTEX is None:
        pytest.skip("no futex on this machine: the check goes through the store")
    mine, peer = _Exchange(str(tmp_path / "check.shm"), 0, 2), _Exchange(str(tmp_path / "check.shm"), 1, 2)
    finished = _Exchange(str(tmp_path / "finished.shm"), 1, 2)  # the same writes, all of them done
    calls = ["all_reduce(float32[3])", "all_gather_object()", "broadcast_object_list(1 objects, src=0)"]
    for seq, call in enumerate(calls, 124):
        finished.publish(13, "default:cpu", seq, call)
        if seq < 126:
            peer.publish(13, "default:cpu", seq, call)
    start, data = SLOT_SIZE + collectives._SLOT_HEADER, SLOT_SIZE + 4

    def slot(exchange):
        return exchange.memory[start : start + int.from_bytes(exchange.memory[data : data + 4], "little")]

    old, new = slot(peer), slot(finished)
    # The rank stopped after the first 64 bytes of its copy: the old length, new bytes then old ones.
    torn = new[:64] + old[64:]
    peer.memory[start : start + len(torn)] = torn
    seq, signature = json.loads(torn)["c"]["default:cpu"][:2]
    assert seq == 126 and signature == "broadcast_object_list(1 objectse(float32[3])"  # parses, as another call
    assert mine.collect([1], 13, "default:cpu", 126, timeout=0.2) is None  # not the torn one: waits for the rest
    # The rank, back on a core, finishes its write (and wakes the waiter).
    later = threading.Timer(0.2, peer.publish, args=(13, "default:cpu", 126, calls[2]))
    later.start()
    assert mine.collect([1], 13, "default:cpu", 126, timeout=10) == {1: calls[2]}
    later.join()
