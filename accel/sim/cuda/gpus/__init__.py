"""Which GPUs a simulated rank has and what card each is: the lowest room of the simulated GPU.

Here: the card table (`cards`), the rank's GPUs and the current one (`state`), their generators
(`generators`), shapes-only mode (`shapes`) and the error for what a real GPU can do and a simulated
one cannot (`errors`).
May import: nothing of accel.sim.cuda (only accel.sim.core and accel.sim.node).
"""
