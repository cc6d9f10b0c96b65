"""accel: one PyTorch training script on a CPU, many processes, many GPUs or a TPU.

Public names are imported on first use, so `import accel` costs next to nothing.
"""

from typing import TYPE_CHECKING

from accel._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "accel.utils.modeling": ["infer_auto_device_map", "load_checkpoint_in_model"],
    "accel.big_modeling": [
        "cpu_offload",
        "cpu_offload_with_hook",
        "disk_offload",
        "dispatch_model",
        "init_empty_weights",
        "init_on_device",
        "load_checkpoint_and_dispatch",
    ],
    "accel.accelerator": ["Accelerator"],
    "accel.state": ["PartialState", "AcceleratorState", "GradientState", "reset_state"],
    "accel.data_loader": ["prepare_data_loader", "skip_first_batches"],
    "accel.launchers": ["debug_launcher", "notebook_launcher"],
    "accel.optimizer": ["AcceleratedOptimizer"],
    "accel.scheduler": ["AcceleratedScheduler"],
    "accel.logging": ["get_logger"],
    "accel.utils.memory": ["find_executable_batch_size"],
    "accel.utils.random": ["synchronize_rng_states"],
    "accel.utils.imports": ["is_rich_available"],
    "accel.utils.dataclasses": [
        "DistributedType",
        "RNGType",
        "AutocastKwargs",
        "DistributedDataParallelKwargs",
        "DDPCommunicationHookType",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "ProfileKwargs",
        "FP8RecipeKwargs",
        "GradientAccumulationPlugin",
        "DataLoaderConfiguration",
        "ProjectConfiguration",
        "FullyShardedDataParallelPlugin",
        "TorchDynamoPlugin",
    ],
}


# isort: off
if TYPE_CHECKING:  # what type checkers see; the _EXPORTS table is what runs (tests keep them equal)
    from accel.accelerator import (
        Accelerator as Accelerator,
    )
    from accel.state import (
        PartialState as PartialState,
        AcceleratorState as AcceleratorState,
        GradientState as GradientState,
        reset_state as reset_state,
    )
    from accel.data_loader import (
        prepare_data_loader as prepare_data_loader,
        skip_first_batches as skip_first_batches,
    )
    from accel.launchers import (
        debug_launcher as debug_launcher,
        notebook_launcher as notebook_launcher,
    )
    from accel.optimizer import (
        AcceleratedOptimizer as AcceleratedOptimizer,
    )
    from accel.scheduler import (
        AcceleratedScheduler as AcceleratedScheduler,
    )
    from accel.logging import (
        get_logger as get_logger,
    )
    from accel.utils.memory import (
        find_executable_batch_size as find_executable_batch_size,
    )
    from accel.utils.random import (
        synchronize_rng_states as synchronize_rng_states,
    )
    from accel.utils.imports import (
        is_rich_available as is_rich_available,
    )
    from accel.utils.dataclasses import (
        DistributedType as DistributedType,
        RNGType as RNGType,
        AutocastKwargs as AutocastKwargs,
        DistributedDataParallelKwargs as DistributedDataParallelKwargs,
        DDPCommunicationHookType as DDPCommunicationHookType,
        GradScalerKwargs as GradScalerKwargs,
        InitProcessGroupKwargs as InitProcessGroupKwargs,
        ProfileKwargs as ProfileKwargs,
        FP8RecipeKwargs as FP8RecipeKwargs,
        GradientAccumulationPlugin as GradientAccumulationPlugin,
        DataLoaderConfiguration as DataLoaderConfiguration,
        ProjectConfiguration as ProjectConfiguration,
        FullyShardedDataParallelPlugin as FullyShardedDataParallelPlugin,
        TorchDynamoPlugin as TorchDynamoPlugin,
    )
    from accel.big_modeling import (
        cpu_offload as cpu_offload,
        cpu_offload_with_hook as cpu_offload_with_hook,
        disk_offload as disk_offload,
        dispatch_model as dispatch_model,
        init_empty_weights as init_empty_weights,
        init_on_device as init_on_device,
        load_checkpoint_and_dispatch as load_checkpoint_and_dispatch,
    )
    from accel.utils.modeling import (
        infer_auto_device_map as infer_auto_device_map,
        load_checkpoint_in_model as load_checkpoint_in_model,
    )
# isort: on

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
