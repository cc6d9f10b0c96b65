"""The device-simulation core, shared by every simulated device (`accel.sim.cuda_*`, `accel.sim.xla`).

* `torch_internals`: every private torch API the simulated devices rely on (one home).
* `device_rules`: which devices an op accepts together; each device says what a mismatch raises.
* `hidden`: the hidden PrivateUse1 device under a simulated device's tensors (one per process).
* `wrapper`: the wrapper tensor (a device tensor to Python, a CPU tensor underneath) and its dispatch.
* `carried`: what the simulated devices' process groups share to carry collectives over Gloo.

A new kind of simulated device is a subpackage of `accel.sim` that describes its device
(`wrapper.SimDevice`: its type, words and rules) and installs the hidden device once.
"""
