"""The kinds of device the simulator can stand in for: the CPU, and each subpackage with a `rank` module.

A simulated device is a subpackage `accel/sim/<name>/` whose `rank.py` says what the
runtime asks of it (`accel.sim.devices`); it is found here by its files, without
importing anything (torch included), so that the CLI's `--help` and the launcher can
read the names cheaply.
"""

from __future__ import annotations

from pathlib import Path


def subpackages_with_rank(here: Path) -> list[str]:
    """The names of the packages in folder `here` that have a `rank` module: the simulated devices."""
    return sorted(path.parent.name for path in here.glob("*/rank.py") if (path.parent / "__init__.py").exists())


#: the simulated devices, in the order the CLI lists them (the CPU, then the subpackages by name)
DEVICES: tuple[str, ...] = ("cpu", *subpackages_with_rank(Path(__file__).resolve().parent))
