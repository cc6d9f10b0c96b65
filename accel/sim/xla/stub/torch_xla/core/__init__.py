"""`torch_xla.core` of the simulator (see `xla_model`)."""
