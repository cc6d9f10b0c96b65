"""NCCL's semantics on simulated GPUs, carried by Gloo: the "nccl" process group and its neighbours.

Here: the "nccl" process group (`process_group`), the mixed "cpu:gloo,cuda:nccl" group (`mixed_group`),
torch's functional collectives (`functional`), DataParallel's copies between GPUs of one process
(`parallel_copies`), and collectives of ranks that stand in for others (`stand_in`).
May import: gpus, memory, tensors, timing.
"""
