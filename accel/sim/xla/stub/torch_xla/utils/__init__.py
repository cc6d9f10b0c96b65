"""`torch_xla.utils` of the simulator."""
