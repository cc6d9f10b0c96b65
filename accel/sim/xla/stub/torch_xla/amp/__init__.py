"""`torch_xla.amp` of the simulator: `autocast` on XLA devices, and the sync-free optimizers."""

from .autocast_mode import autocast
