"""Kwargs handlers and configuration dataclasses: to_kwargs, validation, the objects they build."""

import datetime

import pytest
import torch

from accel.utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    FP8RecipeKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    RNGType,
)


def test_to_kwargs_returns_only_changed_fields():
    assert AutocastKwargs().to_kwargs() == {}
    assert AutocastKwargs(cache_enabled=False).to_kwargs() == {"cache_enabled": False}
    assert GradScalerKwargs(init_scale=1024.0, growth_interval=10).to_kwargs() == {
        "init_scale": 1024.0,
        "growth_interval": 10,
    }
    timeout = datetime.timedelta(seconds=30)
    assert InitProcessGroupKwargs(timeout=timeout).to_kwargs() == {"timeout": timeout}


def test_ddp_kwargs_leave_hooks_out_of_constructor_arguments():
    handler = DistributedDataParallelKwargs(find_unused_parameters=True, comm_hook="fp16")
    assert handler.to_kwargs() == {"find_unused_parameters": True}
    assert handler.comm_hook is DDPCommunicationHookType.FP16


def test_ddp_kwargs_reject_unknown_hooks():
    with pytest.raises(ValueError, match="comm_hook='zip'.*'fp16'"):
        DistributedDataParallelKwargs(comm_hook="zip")
    with pytest.raises(ValueError, match="comm_wrapper"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="power_sgd")
    with pytest.raises(ValueError, match="comm_state_option"):
        DistributedDataParallelKwargs(comm_state_option={"matrix_approximation_rank": 2})


def test_register_comm_hook_calls_ddp_with_the_chosen_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    class FakeDDP:
        def register_comm_hook(self, state, hook):
            self.state, self.hook = state, hook

    model = FakeDDP()
    DistributedDataParallelKwargs(comm_hook="bf16").register_comm_hook(model)
    assert model.hook is default_hooks.bf16_compress_hook and model.state is None
    DistributedDataParallelKwargs(
        comm_hook="power_sgd", comm_state_option={"matrix_approximation_rank": 2}
    ).register_comm_hook(model)
    assert model.hook is powerSGD_hook.powerSGD_hook and model.state.matrix_approximation_rank == 2
    untouched = FakeDDP()
    DistributedDataParallelKwargs().register_comm_hook(untouched)
    assert not hasattr(untouched, "hook")


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: GradScalerKwargs(init_scale=0), "init_scale"),
        (lambda: GradScalerKwargs(backoff_factor=2.0), "backoff_factor"),
        (lambda: GradScalerKwargs(growth_factor=0.5), "growth_factor"),
        (lambda: FP8RecipeKwargs(backend="cudnn"), "backend"),
        (lambda: FP8RecipeKwargs(fp8_format="E9M9"), "fp8_format"),
        (lambda: FP8RecipeKwargs(amax_compute_algo="mean"), "amax_compute_algo"),
        (lambda: GradientAccumulationPlugin(num_steps=-2), "num_steps"),
        (lambda: GradientAccumulationPlugin(num_steps=0), "num_steps"),
        (lambda: ProjectConfiguration(total_limit=0), "total_limit"),
        (lambda: ProfileKwargs(activities=["gpu"]), "activities"),
        (lambda: InitProcessGroupKwargs(timeout=30), "timeout"),
    ],
)
def test_bad_values_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_fp8_backend_is_case_insensitive_and_lists_choices():
    assert FP8RecipeKwargs(backend="te").backend == "TE"
    with pytest.raises(ValueError, match=r"\['TE', 'MSAMP', 'AO'\]"):
        FP8RecipeKwargs(backend="x")


def test_profile_kwargs_build_a_working_profiler(tmp_path):
    profiler = ProfileKwargs(activities=["cpu"], record_shapes=True).build()
    with profiler as prof:
        torch.ones(8) @ torch.ones(8)
    assert any("aten::" in event.name for event in prof.events())


def test_configurations_defaults():
    assert DataLoaderConfiguration().even_batches is True
    assert DataLoaderConfiguration().dispatch_batches is None
    project = ProjectConfiguration(project_dir="runs/a")
    assert project.logging_dir == "runs/a" and project.iteration == 0
    project.set_directories("runs/b")
    assert project.project_dir == "runs/b"


def test_enums_compare_to_strings():
    assert DistributedType.MULTI_GPU == "MULTI_GPU" and str(DistributedType.XLA) == "XLA"
    from accelerate.utils import DistributedType as PeerDistributedType
    from accelerate.utils import RNGType as PeerRNGType

    assert DistributedType.list() == [m.value for m in PeerDistributedType]
    assert RNGType.list() == [m.value for m in PeerRNGType]
