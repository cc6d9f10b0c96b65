"""How long a step takes on the simulated card: the clock per simulated GPU and the cost of kernels
and collectives (issue 36, to come; nothing lives here yet).

Kernels' durations from their FLOPs and bytes against the card's peaks (the card table in `gpus`),
collectives' from NCCL's algorithms over the links they cross, on the streams they were issued on.
May import: gpus, memory, tensors.
"""
