"""`torch_xla._internal.utils`: `parse_xla_device` (what replaced `xm.parse_xla_device`)."""

from __future__ import annotations

import re


def parse_xla_device(device: str) -> tuple[str, int] | None:
    """('TPU', 3) for 'TPU:3'; None for anything else."""
    m = re.match(r"([A-Z]+):(\d+)$", device)
    if m:
        return (m.group(1), int(m.group(2)))
    return None
