"""The kinds of device the simulator can stand in for: the one definition.

Kept free of imports (torch included) so that the CLI's `--help` and the launcher can
read it cheaply.
"""

from __future__ import annotations

#: the simulated devices, in the order the CLI lists them
DEVICES: tuple[str, ...] = ("cpu", "cuda", "xla")
