"""Tests of the pytest harness (`@distributed_test`), each through pytest's own `pytester`.

Every test writes a small test file, runs pytest on it in this process, and checks
the outcomes and the report; the behaviours that need a separate pytest process
(xdist, coverage, Ctrl-C) are in `test_harness_process.py`.
"""

import os
import random
import re

import pytest

pytest_plugins = ["pytester"]


def run(pytester, *args):
    """pytest in this process; hypothesis' plugin re-imports hypothesis (seconds) in every inner run."""
    return pytester.runpytest("-p", "no:hypothesispytest", *args)


def _failure_section(output: str, test_name: str) -> str:
    """The text pytest printed for one failed test (between its header and the next)."""
    match = re.search(rf"_+ {re.escape(test_name)} _+\n(.*?)(?=\n_{{3,}} |\n=+ )", output, re.S)
    assert match, f"no failure section for {test_name} in:\n{output}"
    return match.group(1)


def test_outcomes_of_raise_exit_signal_skip_and_xfail(pytester, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # room for the one-line reasons in the summary
    pytester.makepyfile(
        test_h_outcomes="""
        import os, signal
        import pytest
        import torch.distributed as dist
        from harness import distributed_test

        @distributed_test(world_size=4)
        def test_passes(rank, world_size):
            import torch
            value = torch.ones(1)
            dist.all_reduce(value)
            assert value.item() == world_size

        @distributed_test(world_size=3)
        def test_raises_on_one_rank(rank):
            print("rank", rank, "says hi")
            assert rank != 2, "rank two is unhappy"

        @distributed_test(world_size=2)
        def test_exits(rank):
            if rank == 1:
                os._exit(7)
            dist.barrier()

        @distributed_test(world_size=2)
        def test_killed(rank):
            if rank == 0:
                os.kill(os.getpid(), signal.SIGSEGV)
            dist.barrier()

        @distributed_test(world_size=2)
        def test_skip_on_one_rank(rank):
            if rank == 1:
                pytest.skip("rank one has no data")
            dist.barrier()

        @distributed_test(world_size=2)
        def test_skip_everywhere(rank):
            pytest.skip("not today")

        @pytest.mark.xfail(reason="known bug", strict=True)
        @distributed_test(world_size=2)
        def test_xfail_mark(rank):
            assert rank == 5

        @pytest.mark.xfail(raises=ZeroDivisionError, strict=True)
        @distributed_test(world_size=2)
        def test_xfail_raises(rank):
            1 / 0

        @pytest.mark.xfail(raises=ZeroDivisionError, strict=True)
        @distributed_test(world_size=2)
        def test_xfail_wrong_exception_fails(rank):
            raise KeyError("not a division")

        @distributed_test(world_size=2)
        def test_imperative_xfail(rank):
            pytest.xfail("later")

        @distributed_test(world_size=2)
        def test_after_all_that(rank, world_size):
            import torch
            value = torch.ones(1)
            dist.all_reduce(value)
            assert value.item() == world_size
        """
    )
    result = run(pytester, "-rA")
    result.assert_outcomes(passed=2, failed=4, skipped=2, xfailed=3)
    output = result.stdout.str()

    raised = _failure_section(output, "test_raises_on_one_rank")
    assert "rank 2 of 3 failed" in raised
    assert "[rank 2] AssertionError: rank two is unhappy" in raised
    # The failing rank's own traceback, shown once, every line labelled with its rank.
    assert raised.count("assert rank != 2") == 1
    assert re.search(r"\[rank 2\]\s+File \".*test_h_outcomes.py\", line \d+, in test_raises_on_one_rank", raised)
    assert "[rank 0]" not in raised.split("Captured stdout call")[0]
    assert "[rank 2] rank 2 says hi" in raised  # what the ranks printed, by rank

    assert "[rank 1] exited with code 7 before returning" in _failure_section(output, "test_exits")
    killed = _failure_section(output, "test_killed")
    assert "[rank 0] killed by signal SIGSEGV" in killed
    assert "in test_killed" in killed  # the crash dump's stack
    assert "test_xfail_wrong_exception_fails" in output and "KeyError: 'not a division'" in output

    result.stdout.fnmatch_lines(
        [
            "SKIPPED * test_h_outcomes.py:*: rank 1: rank one has no data",
            "SKIPPED * test_h_outcomes.py:*: rank 0: not today",
            "*FAILED*test_raises_on_one_rank - rank 2: AssertionError: rank two is unhappy*",
            "*FAILED*test_killed - rank 0: killed by signal SIGSEGV*",
        ]
    )


def test_hang_fails_that_test_with_every_live_rank_stack_and_the_session_goes_on(pytester):
    pytester.makepyfile(
        test_h_hang="""
        import time
        import torch.distributed as dist
        from harness import distributed_test

        def wait_for_ever():
            while True:
                time.sleep(0.01)

        @distributed_test(world_size=3, timeout=2)
        def test_hangs(rank):
            if rank == 0:
                wait_for_ever()
            dist.barrier()

        @distributed_test(world_size=3)
        def test_next(rank):
            dist.barrier()
        """
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    hang = _failure_section(result.stdout.str(), "test_hangs")
    assert "timed out after 2 s: rank(s) 0, 1, 2 of 3 still running" in hang
    assert re.search(r"\[rank 0\].*in wait_for_ever", hang)
    for rank in (1, 2):
        assert re.search(rf"\[rank {rank}\].*in barrier", hang)
        assert re.search(rf"\[rank {rank}\].*in test_hangs", hang)
    assert "server.py" not in hang and "forkserver" not in hang  # where ranks came from is machinery


def test_lists_parametrize_and_fixtures_reach_every_rank(pytester):
    pytester.makepyfile(
        test_h_grid="""
        import os
        import pytest
        import torch.distributed as dist
        from harness import distributed_test

        @distributed_test(world_size=[2, 3], device=["cpu", "cuda", "xla"])
        @pytest.mark.parametrize("letter", ["a", "b"])
        def test_grid(rank, local_rank, world_size, device, letter, tmp_path):
            from accel.state import PartialState
            state = PartialState()
            assert state.process_index == rank == local_rank == int(os.environ["RANK"])
            assert state.num_processes == world_size == dist.get_world_size()
            backends = {"cpu": ("cpu",), "cuda": ("sim_cuda", "cuda"), "xla": ("xla",)}
            assert os.environ["ACCEL_BACKEND"] in backends[device]
            assert letter in "ab"
            (tmp_path / f"rank{rank}").write_text(letter)
            dist.barrier()
            assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(world_size)]

        @distributed_test(world_size=2)
        def test_without_fixtures():
            assert dist.get_world_size() == 2

        class TestInAClass:
            @distributed_test(world_size=2)
            def test_method(self, rank):
                assert isinstance(self, TestInAClass) and rank in (0, 1)
        """
    )
    result = run(pytester, "-v")
    result.assert_outcomes(passed=14)
    result.stdout.fnmatch_lines(
        ["*test_grid?a-2-cpu? PASSED*", "*test_grid?b-3-xla? PASSED*", "*TestInAClass::test_method PASSED*"]
    )


@pytest.mark.parametrize("import_mode", ["prepend", "importlib"])
def test_ranks_import_test_modules_in_packages_as_pytest_did(pytester, import_mode):
    pytester.mkpydir("h_pkg")
    pytester.path.joinpath("h_pkg", "test_h_in_pkg.py").write_text(
        "from harness import distributed_test\n"
        "HELPER = 41\n"
        "@distributed_test(world_size=2)\n"
        "def test_in_package(rank):\n"
        "    assert HELPER + 1 == 42\n"
    )
    result = run(pytester, f"--import-mode={import_mode}")
    result.assert_outcomes(passed=1)


def test_other_fixtures_are_refused_with_a_clear_error(pytester):
    pytester.makepyfile(
        test_h_fixtures="""
        from harness import distributed_test

        @distributed_test(world_size=2)
        def test_wants_monkeypatch(rank, monkeypatch):
            pass

        def test_rank_outside_a_distributed_test(rank):
            pass
        """
    )
    result = run(pytester)
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(
        [
            "*test_wants_monkeypatch asks for 'monkeypatch': the body runs inside the ranks*",
            "*the 'rank' fixture only exists in @distributed_test tests*",
        ]
    )


def test_warm_reuse_isolation_and_recovery_after_a_failure(pytester):
    pytester.makepyfile(
        test_h_reuse="""
        import os, pathlib
        from harness import distributed_test

        PIDS = pathlib.Path(__file__).parent / "pids"

        def record(name, rank):
            PIDS.mkdir(exist_ok=True)
            (PIDS / f"{name}.{rank}").write_text(str(os.getpid()))

        @distributed_test(world_size=2)
        def test_a(rank):
            record("a", rank)

        @distributed_test(world_size=2)
        def test_b(rank):
            record("b", rank)

        @distributed_test(world_size=2, isolated=True)
        def test_c_isolated(rank):
            record("c", rank)

        @distributed_test(world_size=2)
        def test_d_fails(rank):
            record("d", rank)
            assert rank == 0

        @distributed_test(world_size=2)
        def test_e_after_failure(rank):
            import torch, torch.distributed as dist
            record("e", rank)
            value = torch.ones(1)
            dist.all_reduce(value)
            assert value.item() == 2
        """
    )
    result = run(pytester)
    result.assert_outcomes(passed=4, failed=1)
    pids = {path.name: int(path.read_text()) for path in (pytester.path / "pids").iterdir()}
    warm = {pids["a.0"], pids["a.1"]}
    assert {pids["b.0"], pids["b.1"]} == warm  # same processes: warm
    assert not {pids["c.0"], pids["c.1"]} & warm  # isolated: fresh processes
    assert {pids["d.0"], pids["d.1"]} == warm
    assert not {pids["e.0"], pids["e.1"]} & warm  # the failed pool was replaced
    for pid in pids.values():  # nothing is left running after the session
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_state_env_seeds_and_process_group_do_not_leak_between_tests(pytester):
    expected_random = random.Random(0).random()
    pytester.makepyfile(
        test_h_leaks=f"""
        import os, random
        import numpy, torch
        import torch.distributed as dist
        from harness import distributed_test
        from accel.state import PartialState, AcceleratorState, GradientState

        @distributed_test(world_size=2)
        def test_1_dirty(rank):
            os.environ["LEAKY"] = "yes"
            os.environ["ACCEL_MIXED_PRECISION"] = "bf16"
            PartialState().leaked = True
            GradientState()._set_sync_gradients(False)
            random.seed(99); torch.manual_seed(99); numpy.random.seed(99)
            os.chdir("/")

        @distributed_test(world_size=2)
        def test_2_clean(rank):
            assert "LEAKY" not in os.environ
            assert "SET_BY_A_PARENT_FIXTURE" not in os.environ  # ranks start from the session's env
            assert AcceleratorState().mixed_precision == "no"
            assert not hasattr(PartialState(), "leaked")
            assert GradientState().sync_gradients is True
            assert random.random() == {expected_random!r}
            assert torch.rand(1).item() == torch.rand(1, generator=torch.Generator().manual_seed(0)).item()
            assert numpy.random.rand() == numpy.random.RandomState(0).rand()
            assert os.getcwd() != "/"

        @distributed_test(world_size=2)
        def test_3_destroys_the_group(rank):
            dist.destroy_process_group()

        @distributed_test(world_size=2)
        def test_4_has_a_group(rank):
            assert dist.is_initialized()
            value = torch.ones(1)
            dist.all_reduce(value)
            assert value.item() == 2
        """
    )
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture(autouse=True)
        def parent_side_env(request, monkeypatch):
            if request.node.name == "test_1_dirty":  # the test that starts the pool
                monkeypatch.setenv("SET_BY_A_PARENT_FIXTURE", "1")
        """
    )
    result = run(pytester, "-p", "no:randomly")
    result.assert_outcomes(passed=4)


def test_hardware_markers_are_registered_and_skip_without_hardware(pytester):
    pytester.makepyfile(
        test_h_markers="""
        import pytest
        from harness import distributed_test

        @pytest.mark.gpu
        def test_gpu():
            pass

        @pytest.mark.multi_gpu
        def test_multi_gpu():
            pass

        @pytest.mark.tpu
        def test_tpu():
            pass

        @distributed_test(world_size=64, device="cuda")
        def test_on_real_gpus(rank):
            pass
        """
    )
    markers = run(pytester, "--markers").stdout.str()
    assert "@pytest.mark.gpu" in markers and "@pytest.mark.multi_gpu" in markers and "@pytest.mark.tpu" in markers
    result = run(pytester, "--strict-markers", "--real-devices", "-rs")
    result.assert_outcomes(skipped=4)
    result.stdout.fnmatch_lines(
        ["*needs a GPU*", "*needs at least 2 GPUs*", "*needs a TPU*", "*--real-devices: needs 64 GPUs*"]
    )


def test_distributed_test_rejects_bad_arguments():
    from harness import distributed_test

    with pytest.raises(TypeError, match="takes an int or a list"):
        distributed_test(world_size="4")
    with pytest.raises(ValueError, match="must be positive"):
        distributed_test(world_size=[2, 0])
    with pytest.raises(TypeError, match="name each fixture"):
        distributed_test()(lambda **kwargs: None)


def test_calling_the_stand_in_directly_says_how_to_run_it():
    from harness import distributed_test

    @distributed_test(world_size=2)
    def body(rank):
        pass

    with pytest.raises(RuntimeError, match="run it with pytest and the accel harness plugin"):
        body()


def test_hypothesis_draws_the_same_examples_on_every_rank(pytester):
    pytester.makepyfile(
        test_h_hypothesis="""
        from hypothesis import given, settings, strategies as st
        from harness import distributed_test

        @distributed_test(world_size=2)
        @settings(max_examples=15, deadline=None, database=None)
        @given(x=st.integers(0, 10**6))
        def test_same_x_everywhere(rank, world_size, x):
            import torch, torch.distributed as dist
            value = torch.tensor([float(x)], dtype=torch.float64)
            dist.all_reduce(value)
            assert value.item() == x * world_size

        @distributed_test(world_size=2)
        @settings(max_examples=50, deadline=None, database=None)
        @given(x=st.integers(0, 1000))
        def test_shrinks_in_every_rank(rank, x):
            assert x < 500
        """
    )
    result = run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    for rank in (0, 1):  # each rank shrank to the same minimal example
        result.stdout.fnmatch_lines([f"*[[]rank {rank}[]]     x=500,*"])
