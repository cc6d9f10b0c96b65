"""A tensor on a simulated GPU: a CUDA tensor to Python code, a host tensor underneath.

Here: the tensor (`cuda_tensor`: `SimCudaTensor`, device checks, storages counted by the allocator),
how tensors get onto a GPU (`factories`: factories and copies), checkpoints saved as `cuda:k`
(`checkpoint`), and the host's waits for the GPU that `set_sync_debug_mode` reports (`sync_debug`).
May import: gpus, memory.
"""
