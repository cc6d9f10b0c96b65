"""`torch_xla.debug` of the simulator."""
