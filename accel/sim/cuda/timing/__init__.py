"""How long a step takes on the simulated card: the clock per simulated GPU and the cost of kernels
and collectives. Here: the clock of streams and host (`clock`), kernels' durations (`costs`), NCCL's
collectives (`collectives`), what the clock hears of ops, waits and steps (`ops`), the end-of-run line
and JSON report (`report`), a step's trace and picture (`trace`), the options read without torch (`units`),
Python's clocks on the simulated host's time under ``ACCEL_SIM_CLOCK=gpu`` (`pyclock`), compiled regions
run op by op timed as Inductor's fused kernels (`fusion`), the module a traced kernel comes from (`modules`).

Kernels' durations from their FLOPs and bytes against the card's peaks (the card table in `gpus`),
collectives' from NCCL's algorithms over the links they cross, on the streams they were issued on.
May import: gpus, memory, tensors.
"""
