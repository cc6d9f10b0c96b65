"""`torch_xla._internal` of the simulator: the helpers scripts reach for."""
