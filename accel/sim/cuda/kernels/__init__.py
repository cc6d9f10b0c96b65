"""CUDA kernels a CPU build lacks, computed on the host with the card's memory: one family a module.

Here: cuBLAS workspaces (`blas`), SyncBatchNorm's kernels (`batch_norm`), fused LSTM/GRU cells (`rnn`),
stand-ins for JIT-built extension kernels (`extension`), ops that take host arguments
(`host_arguments`), and CUDA's autocast policy (`autocast`).
May import: gpus, memory, tensors.
"""
