"""The clock's options as people write them, read without torch (`accel launch` checks them before any rank)."""

from __future__ import annotations


def parse_network(text: str) -> float:
    """Gb/s in "400Gbps", "400 Gb/s", "400G", "400"; raises ValueError naming the form otherwise."""
    cleaned = text.strip().lower().replace(" ", "").replace("/", "")
    for suffix in ("gbps", "gbits", "gbit", "gbs", "gb", "g"):
        if cleaned.endswith(suffix):
            cleaned = cleaned[: -len(suffix)]
            break
    try:
        value = float(cleaned)
    except ValueError:
        raise ValueError(f"cannot read the network {text!r}: write each GPU's NIC as e.g. 400Gbps") from None
    if value <= 0:
        raise ValueError(f"the network {text!r} must be a positive bandwidth, e.g. 400Gbps")
    return value
