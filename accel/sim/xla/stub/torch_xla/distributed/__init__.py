"""`torch_xla.distributed` of the simulator: the `xla` process group and the device loader."""
