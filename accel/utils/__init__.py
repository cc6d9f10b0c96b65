"""Operations on nested tensors across processes, seeding, and the configuration dataclasses."""

from accel._lazy import lazy_exports

_EXPORTS = {
    "accel.utils.operations": [
        "gather",
        "gather_object",
        "broadcast",
        "broadcast_object_list",
        "pad_across_processes",
        "reduce",
        "send_to_device",
        "concatenate",
        "slice_tensors",
        "recursively_apply",
        "find_batch_size",
        "get_data_structure",
        "initialize_tensors",
        "set_seed",
        "synchronize_rng_states",
        "synchronize_rng_state",
        "DistributedOperationException",
    ],
    "accel.utils.modeling": ["extract_model_from_parallel", "is_compiled_module"],
    "accel.utils.memory": ["free_memory", "release_device_cache"],
    "accel.utils.metrics": ["gather_for_metrics"],
    "accel.utils.dataclasses": [
        "DistributedType",
        "RNGType",
        "PrecisionType",
        "KwargsHandler",
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
    ],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
