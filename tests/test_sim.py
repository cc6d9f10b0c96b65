"""Tests of `accel.sim.launch`: results, failure reports, timeouts, warm pools and clean starts."""

import logging
import os
import random
import signal
import sys
import threading
import time

import pytest

from accel.sim import DistributedFailure, DistributedTimeout, RankFailure, launch

# -- functions the ranks run (module level: sent by reference) ---------------------------


def describe_rank(offset):
    import torch
    import torch.distributed as dist

    from accel.state import PartialState

    state = PartialState()
    # on the rank's own GPU or TPU core where it has one: NCCL and torch_xla's group refuse CPU tensors
    device = state.device
    value = torch.tensor([float(state.process_index + offset)], device=device)
    dist.all_reduce(value)
    env = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCEL_BACKEND")}
    return {
        "index": state.process_index,
        "num": state.num_processes,
        "type": state.distributed_type.name,
        "backend": state.backend,
        "sum": value.item(),
        "env": env,
        "pid": os.getpid(),
    }


def get_pid():
    return os.getpid()


def fail_on(rank_to_fail, message="boom"):
    from accel.state import PartialState

    if PartialState().process_index == rank_to_fail:
        raise ValueError(message)
    return "fine"


def fail_while_others_wait():
    import torch.distributed as dist

    from accel.state import PartialState

    if PartialState().process_index == 1:
        raise KeyError("rank one gave up")
    dist.barrier()


def exit_with(code, how):
    from accel.state import PartialState

    if PartialState().process_index == 1:
        if how == "os":
            os._exit(code)
        sys.exit(code)
    return "done"


def kill_self(signum):
    import torch.distributed as dist

    from accel.state import PartialState

    if PartialState().process_index == 0:
        os.kill(os.getpid(), signum)
    dist.barrier()


def wait_forever_in_barrier():
    import torch.distributed as dist

    from accel.state import PartialState

    print(f"rank {PartialState().process_index} is about to wait", flush=True)
    if PartialState().process_index == 0:
        dist.barrier()  # rank 1 never joins
    else:
        spin_here()


def spin_here():
    while True:
        time.sleep(0.01)


def dirty_everything():
    import numpy
    import torch

    from accel.state import PartialState

    os.environ["ACCEL_SIM_TEST_LEAK"] = "1"
    os.environ["ACCEL_DEBUG_MODE"] = "1"
    PartialState().leaked_attribute = True
    random.seed(1234)
    torch.manual_seed(1234)
    numpy.random.seed(1234)
    torch.set_default_dtype(torch.float64)
    os.chdir("/")
    import logging

    logging.getLogger().setLevel(logging.DEBUG)
    logging.disable(logging.CRITICAL)
    return True


def read_clean_state():
    import logging

    import numpy
    import torch
    import torch.distributed as dist

    from accel.state import PartialState

    state = PartialState()
    return {
        "leak": os.environ.get("ACCEL_SIM_TEST_LEAK"),
        "debug": state.debug,
        "leaked_attribute": hasattr(state, "leaked_attribute"),
        "random": random.random(),
        "torch": torch.rand(1).item(),
        "numpy": float(numpy.random.rand()),
        "dtype": str(torch.get_default_dtype()),
        "cwd": os.getcwd(),
        "pg": dist.is_initialized(),
        "levels": (logging.getLogger().level, logging.root.manager.disable),
    }


def destroy_group():
    from accel.state import reset_state

    reset_state(destroy_process_group=True)


def all_reduce_ok():
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def print_something():
    from accel.state import PartialState

    print(f"hello from {PartialState().process_index}")
    print("to stderr", file=sys.stderr)


def raise_unpicklable_exception():
    import threading

    class LockedError(Exception):
        def __init__(self):
            super().__init__("holds a lock")
            self.lock = threading.Lock()

    raise LockedError()


class Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling for you")


def return_unpicklable():
    return Unpicklable()


# -- results -------------------------------------------------------------------------------


def test_returns_each_rank_value_with_partial_state_set_up():
    results = launch(describe_rank, args=(10,), world_size=3)
    assert [r["index"] for r in results] == [0, 1, 2]
    assert all(r["num"] == 3 and r["type"] == "MULTI_CPU" and r["backend"] == "gloo" for r in results)
    assert all(r["sum"] == 33.0 for r in results)  # a real collective ran
    assert results[2]["env"] == {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "3",
        "ACCEL_BACKEND": "cpu",
    }
    assert len({r["pid"] for r in results}) == 3 and os.getpid() not in {r["pid"] for r in results}


def test_kwargs_reach_the_function():
    assert launch(fail_on, kwargs={"rank_to_fail": 99}, world_size=2) == ["fine", "fine"]


def test_lambdas_and_closures_are_sent_by_value():
    factor = 7
    assert launch(lambda: factor * 6, world_size=2) == [42, 42]

    def local(x):
        import torch.distributed as dist

        return x + dist.get_rank()

    assert launch(local, args=(100,), world_size=2) == [100, 101]


@pytest.mark.parametrize("device, expected", [("cuda", "MULTI_GPU"), ("xla", "XLA")])
def test_simulated_devices(device, expected):
    pytest.importorskip("accel.sim.devices")
    results = launch(describe_rank, args=(0,), world_size=2, device=device)
    assert [r["type"] for r in results] == [expected, expected]
    assert results[0]["sum"] == 1.0


def test_launcher_knows_the_simulated_devices():
    devices = pytest.importorskip("accel.sim.devices")
    from accel.sim.runtime.launcher import DEVICES

    assert tuple(devices.DEVICES) == DEVICES


def test_real_device_path_asks_for_the_real_backend():
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("real GPUs present: this checks the refusal without them")
    with pytest.raises(DistributedFailure, match="failed to start") as info:
        launch(get_pid, world_size=2, device="cuda", real_device=True)
    # Nothing was faked: the real CUDA backend was asked for and found no GPU.
    assert "ACCEL_BACKEND='cuda' was asked for but that hardware is not available here" in str(info.value)


def test_rejects_bad_options():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(get_pid, world_size=0)
    with pytest.raises(ValueError, match="unknown simulated device 'tpu'"):
        launch(get_pid, device="tpu")
    with pytest.raises(ValueError, match="timeout must be a positive"):
        launch(get_pid, timeout=0)


def test_unpicklable_result_is_reported():
    with pytest.raises(DistributedFailure) as info:
        launch(return_unpicklable, world_size=2)
    assert "cannot send" in str(info.value) and "no pickling for you" in str(info.value)


def test_output_is_relayed_with_rank_prefix(capsys):
    launch(print_something, world_size=2)
    captured = capsys.readouterr()
    assert "[rank 0] hello from 0" in captured.out and "[rank 1] hello from 1" in captured.out
    assert "[rank 1] to stderr" in captured.err


# -- failures ------------------------------------------------------------------------------


def test_exception_names_the_rank_with_its_own_traceback():
    with pytest.raises(DistributedFailure) as info:
        launch(fail_on, args=(1, "rank one broke"), world_size=3)
    error = info.value
    assert list(error.failures) == [1]
    failure = error.failures[1]
    assert isinstance(failure, RankFailure)
    assert failure.kind == "exception" and failure.exc_type == "ValueError" and failure.message == "rank one broke"
    assert isinstance(failure.exception, ValueError)
    assert "in fail_on" in failure.traceback and "raise ValueError(message)" in failure.traceback
    assert "worker.py" not in failure.traceback  # the simulator's own frames are left out
    text = str(error)
    assert "rank 1 of 3 failed" in text
    assert "[rank 1] ValueError: rank one broke" in text and "[rank 1]   File" in text


def test_ranks_waiting_on_a_failed_rank_are_stopped_with_their_stack():
    with pytest.raises(DistributedFailure) as info:
        launch(fail_while_others_wait, world_size=3, timeout=30)
    error = info.value
    assert not isinstance(error, DistributedTimeout)
    assert error.failures[1].exc_type == "KeyError"
    # Peers either failed on their own (Gloo noticed) or were stopped where they waited.
    for rank in (0, 2):
        assert rank in error.stopped or rank in error.failures
    for failure in error.stopped.values():
        assert failure.kind == "stopped" and "fail_while_others_wait" in failure.stack


def test_exception_that_cannot_travel_is_still_reported():
    with pytest.raises(DistributedFailure) as info:
        launch(raise_unpicklable_exception, world_size=2)
    failure = info.value.failures[0]
    assert failure.exception is None  # could not be sent back: its text is
    assert failure.exc_type.endswith("LockedError") and failure.message == "holds a lock"
    assert "raise LockedError()" in failure.traceback


@pytest.mark.parametrize("how", ["os", "sys"])
def test_exit_code_is_reported(how):
    with pytest.raises(DistributedFailure) as info:
        launch(exit_with, args=(3, how), world_size=2)
    failure = info.value.failures[1]
    assert failure.kind == "exit" and failure.exitcode == 3
    assert "[rank 1] exited with code 3" in str(info.value)


def test_sys_exit_zero_is_a_normal_end():
    assert launch(exit_with, args=(0, "sys"), world_size=2) == ["done", None]


def test_signal_is_reported_by_name():
    with pytest.raises(DistributedFailure) as info:
        launch(kill_self, args=(signal.SIGKILL,), world_size=2)
    error = info.value
    first = error.first()
    assert first.rank == 0 and first.kind == "signal" and first.signal_name == "SIGKILL"
    assert "[rank 0] killed by signal SIGKILL" in str(error)


def test_hang_times_out_with_every_live_rank_stack_and_kills_them(capsys):
    pids = launch(get_pid, world_size=2)
    started = time.monotonic()
    with pytest.raises(DistributedTimeout) as info:
        launch(wait_forever_in_barrier, world_size=2, timeout=2)
    assert time.monotonic() - started < 20
    error = info.value
    assert set(error.failures) == {0, 1}
    assert all(f.kind == "timeout" for f in error.failures.values())
    assert "in barrier" in error.failures[0].stack and "wait_forever_in_barrier" in error.failures[0].stack
    assert "spin_here" in error.failures[1].stack
    assert "timed out after 2 s" in str(error)
    assert "[rank 1] rank 1 is about to wait" in capsys.readouterr().out  # relayed before the kill
    for pid in pids:  # the hung pool was the warm one: it is gone
        assert not _alive(pid)


def _alive(pid):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True


def test_failure_text_labels_every_line_with_its_rank():
    failure = RankFailure(
        3,
        "exception",
        exc_type="pkg.CustomError",
        message="first line\nsecond",
        traceback=(
            'Traceback (most recent call last):\n  File "x.py", line 1, in f\npkg.CustomError: first line\nsecond\n'
        ),
    )
    lines = failure.format().splitlines()
    assert lines[0] == "[rank 3] CustomError: first line"
    assert all(line.startswith("[rank 3] ") for line in lines)
    signal_failure = RankFailure(0, "signal", signal_name="SIGSEGV", exitcode=-11)
    assert signal_failure.format() == "[rank 0] killed by signal SIGSEGV"
    error = DistributedFailure({3: failure, 0: signal_failure}, world_size=4, device="cuda")
    assert error.first() is failure and str(error).startswith("ranks 0, 3 of 4 failed (device 'cuda'):")


# -- warm ranks and clean starts -------------------------------------------------------------


def test_ranks_are_reused_warm_and_isolated_gets_fresh_ones():
    first = launch(get_pid, world_size=2)
    assert launch(get_pid, world_size=2) == first
    isolated = launch(get_pid, world_size=2, isolated=True)
    assert not set(isolated) & set(first)
    assert launch(get_pid, world_size=2) == first  # the isolated launch left the warm pool alone


def test_warm_reuse_after_a_failure():
    with pytest.raises(DistributedFailure):
        launch(fail_on, args=(0,), world_size=2)
    assert launch(all_reduce_ok, world_size=2) == [2.0, 2.0]


def test_nothing_leaks_from_one_launch_to_the_next():
    assert launch(dirty_everything, world_size=2) == [True, True]
    after = launch(read_clean_state, world_size=2)
    import numpy
    import torch

    fresh = {
        "random": random.Random(0).random(),
        "torch": torch.rand(1, generator=torch.Generator().manual_seed(0)).item(),
        "numpy": float(numpy.random.RandomState(0).rand()),
    }
    for state in after:
        assert state["leak"] is None and state["debug"] is False and state["leaked_attribute"] is False
        assert (
            state["random"] == fresh["random"] and state["torch"] == fresh["torch"] and state["numpy"] == fresh["numpy"]
        )
        assert state["dtype"] == "torch.float32" and state["cwd"] == os.getcwd() and state["pg"] is True
        assert state["levels"] == (logging.WARNING, logging.NOTSET)


def test_destroyed_process_group_is_replaced():
    launch(destroy_group, world_size=2)
    assert launch(all_reduce_ok, world_size=2) == [2.0, 2.0]


def test_concurrent_launches_do_not_collide():
    results, errors = {}, []

    def run(size):
        try:
            results[size] = launch(all_reduce_ok, world_size=size, isolated=True)
        except Exception as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(size,)) for size in (2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert results == {2: [2.0, 2.0], 3: [3.0, 3.0, 3.0]}


def test_least_recently_used_pools_are_closed_beyond_the_warm_budget():
    from accel.sim.runtime import serialize
    from accel.sim.runtime.launcher import run_payload
    from accel.sim.runtime.manager import new_manager

    manager = new_manager(max_warm_ranks=4)
    payload = serialize.dumps_call(get_pid, (), {})
    try:
        pids = {
            size: [serialize.loads(o.value) for o in run_payload(payload, size, "cpu", 30, manager=manager)]
            for size in (1, 2)
        }
        assert [serialize.loads(o.value) for o in run_payload(payload, 1, "cpu", 30, manager=manager)] == pids[
            1
        ]  # both fit
        run_payload(payload, 3, "cpu", 30, manager=manager)  # 1 + 2 + 3 ranks > 4: the least recent pool goes
        for pid in pids[2]:
            assert not _alive(pid)
        assert [serialize.loads(o.value) for o in run_payload(payload, 1, "cpu", 30, manager=manager)] == pids[1]
    finally:
        manager.close()


def make_a_group_and_count_descriptors():
    import torch.distributed as dist

    dist.all_gather_object([None] * dist.get_world_size(), 1, group=dist.new_group(backend="gloo"))
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors through /proc")
def test_groups_a_launch_created_are_gone_before_the_next():
    counts = [launch(make_a_group_and_count_descriptors, world_size=3)[0] for _ in range(6)]
    assert counts[-1] == counts[1]  # without the clean-up: a few more sockets every launch


def test_a_function_of_a_main_without_file_reaches_the_ranks_also_when_wrapped(tmp_path):
    # A notebook cell's function lives in a __main__ the ranks cannot import; with a card, a memory
    # report or shapes only, the launcher wraps it and it travels as an argument: still sent by value.
    import subprocess
    import sys

    code = (
        "import accel.sim\n"
        "def cell(scale):\n"
        "    import torch\n"
        "    return torch.cuda.get_device_name(), float(torch.ones(2, device='cuda').sum()) * scale\n"
        "print(accel.sim.launch(cell, args=(3,), world_size=2, device='cuda', gpu='L4'))\n"
        "print(accel.sim.launch(cell, args=(5,), world_size=2, device='cuda'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    wrapped, plain = done.stdout.strip().splitlines()[-2:]
    assert wrapped.count("L4") == 2 and wrapped.count("6.0") == 2, wrapped
    assert plain.count("10.0") == 2, plain
