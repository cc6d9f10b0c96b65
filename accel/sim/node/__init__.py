"""A simulated node: every Python process started under `ACCEL_SIMULATE` is one of its processes.

`spec` reads the variable, `start` runs at interpreter start-up (from the `accel_simulate.pth`
file the package installs) and boots the process once it imports torch, `boot` installs the
simulated device and the node's NCCL groups in it, `tree` keeps the node's folder and stops
what the node's first process leaves running. Torch-free up to `boot`.
"""
