"""The error a simulated GPU raises for what a real GPU can do and it cannot.

The lowest module of the simulated GPU, so that every room can raise it without importing the
rank's installer (`accel.sim.cuda.fake`).
"""


class SimulatedDeviceError(RuntimeError):
    """Something a real GPU can do that a simulated one cannot (the message names it)."""
