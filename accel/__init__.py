"""accel: one PyTorch training script on a CPU, many processes, many GPUs or a TPU.

Public names are imported on first use, so `import accel` costs next to nothing.
"""

from accel._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "accel.accelerator": ["Accelerator"],
    "accel.state": ["PartialState", "AcceleratorState", "GradientState", "reset_state"],
    "accel.data_loader": ["prepare_data_loader", "skip_first_batches"],
    "accel.optimizer": ["AcceleratedOptimizer"],
    "accel.scheduler": ["AcceleratedScheduler"],
    "accel.logging": ["get_logger"],
    "accel.utils.dataclasses": [
        "DistributedType",
        "RNGType",
        "AutocastKwargs",
        "DistributedDataParallelKwargs",
        "GradScalerKwargs",
        "InitProcessGroupKwargs",
        "ProfileKwargs",
        "FP8RecipeKwargs",
        "GradientAccumulationPlugin",
        "DataLoaderConfiguration",
        "ProjectConfiguration",
    ],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
