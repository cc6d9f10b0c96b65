"""What `torch.cuda` and `torch.accelerator` answer in a simulated GPU rank, as on a GPU host.

Here: device properties and memory counters (`properties`), streams and events (`streams`), the
profiler and NVTX (`profiler`), deterministic-algorithm alerts (`determinism`), JIT-built CUDA
extensions (`extensions`) and `torch.accelerator`'s private entry points (`accelerator`).
May import: gpus, memory, tensors, timing, kernels, attention, nccl.
"""
