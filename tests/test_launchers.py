"""debug_launcher and notebook_launcher, with functions defined locally (as in a notebook cell or a test)."""

import socket

import pytest

import accel
from accel.launchers import debug_launcher, notebook_launcher


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("num_processes", [2, 4])
def test_debug_launcher_runs_a_local_function_on_cpu_ranks(num_processes, tmp_path):
    def training(folder, expected):
        import torch

        from accel import Accelerator, PartialState
        from accel.utils import gather

        state = PartialState()
        assert state.num_processes == expected and state.distributed_type == "MULTI_CPU"
        accelerator = Accelerator()
        assert accelerator.mixed_precision == "no"
        everyone = gather(torch.tensor([state.process_index]))
        (folder / f"rank{state.process_index}").write_text(str(everyone.tolist()))

    accel.debug_launcher(training, args=(tmp_path, num_processes), num_processes=num_processes)
    expected = str(list(range(num_processes)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(num_processes)]
    assert {p.read_text() for p in tmp_path.iterdir()} == {expected}


def test_debug_launcher_reports_the_failing_rank():
    from accel.sim import DistributedFailure

    def failing():
        from accel import PartialState

        if PartialState().process_index == 1:
            raise ValueError("rank one broke")

    with pytest.raises(DistributedFailure, match="rank one broke"):
        debug_launcher(failing, num_processes=2)


@pytest.mark.parametrize("device", ["cuda", "xla"])
def test_notebook_launcher_simulates_gpus_and_tpu_cores(device, tmp_path):
    def training(folder):
        from accel import Accelerator

        accelerator = Accelerator()
        kind = accelerator.distributed_type.value
        (folder / f"rank{accelerator.process_index}").write_text(f"{accelerator.num_processes} {kind}")
        assert accelerator.mixed_precision == "bf16"

    notebook_launcher(training, args=(tmp_path,), num_processes=2, mixed_precision="bf16", simulate=device)
    expected = {"cuda": "MULTI_GPU", "xla": "XLA"}[device]
    assert {p.read_text() for p in tmp_path.iterdir()} == {f"2 {expected}"}
    assert len(list(tmp_path.iterdir())) == 2


def test_notebook_launcher_starts_cpu_processes_through_torch_elastic(tmp_path):
    def training(folder):
        import torch.distributed as dist

        from accel import Accelerator

        accelerator = Accelerator()
        assert dist.is_initialized() and accelerator.num_processes == 2
        (folder / f"rank{accelerator.process_index}").write_text(accelerator.distributed_type.value)

    notebook_launcher(training, args=(tmp_path,), num_processes=2, use_port=_free_port())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"MULTI_CPU"}


def test_notebook_launcher_with_one_process_runs_here():
    seen = []

    def training(value):
        import os

        seen.append((value, os.environ["ACCEL_MIXED_PRECISION"]))

    notebook_launcher(training, args=(7,), num_processes=1, mixed_precision="fp16")
    assert seen == [(7, "fp16")]


def test_notebook_launcher_errors_are_clear():
    from accel import PartialState

    with pytest.raises(ValueError, match="unknown mixed_precision 'fp4'"):
        notebook_launcher(print, num_processes=2, mixed_precision="fp4")
    with pytest.raises(ValueError, match="node_rank \\(2\\) must be less than num_nodes \\(2\\)"):
        notebook_launcher(print, num_processes=2, node_rank=2, num_nodes=2)
    with pytest.raises(ValueError, match="needs num_processes"):
        notebook_launcher(print, simulate="cuda")
    PartialState()
    with pytest.raises(RuntimeError, match="already exists in this process"):
        notebook_launcher(print, num_processes=2, use_port=_free_port())


def test_launcher_signatures_extend_accelerate():
    """Every parameter of the peer, in the same order with the same defaults; ours come after, keyword-only."""
    import inspect

    import accelerate

    for ours, theirs in [
        (notebook_launcher, accelerate.notebook_launcher),
        (debug_launcher, accelerate.debug_launcher),
    ]:
        peer = list(inspect.signature(theirs).parameters.values())
        mine = list(inspect.signature(ours).parameters.values())
        assert [(p.name, p.default) for p in mine[: len(peer)]] == [(p.name, p.default) for p in peer]
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in mine[len(peer) :])
