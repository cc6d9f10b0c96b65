"""The simulated TPU: XLA devices of a rank, and the stand-in `torch_xla` package (`stub/`).

`bridge` is what the stand-in package asks of the simulated device (which device this
process drives, moving tensors between it and the host); `stub/torch_xla` is put first on
`sys.path` of a simulated TPU rank only (`accel.sim.devices`).
"""
