"""`torch_xla.distributed` of the simulator: the "xla" process group, the device loaders, `xmp`,
and SPMD / FSDP refused by name."""
