"""`torch_xla.experimental` of the simulator: only what refuses by name lives here."""
