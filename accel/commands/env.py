"""`accel env`: the versions and hardware backends of this machine, for bug reports."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the `env` sub-command."""
    parser = subparsers.add_parser("env", help="print versions and available hardware backends")
    parser.set_defaults(run=run)
    return parser


def report() -> dict[str, str]:
    """The facts `accel env` prints, as name -> value."""
    import importlib.metadata
    import importlib.util

    import torch

    from accel.backends import registered_backends, select_backend

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    backends = registered_backends()
    available = [name for name, cls in backends.items() if cls.is_available()]
    try:
        selected = select_backend().name
    except (ValueError, RuntimeError) as error:
        selected = f"none ({error})"
    facts = {
        "accel": version("accel"),
        "Python": sys.version.split()[0],
        "Platform": platform.platform(),
        "torch": torch.__version__,
        "torch CUDA build": str(torch.version.cuda or "no"),
        "GPUs visible": str(torch.cuda.device_count() if torch.cuda.is_available() else 0),
        "torch_xla": version("torch_xla") if importlib.util.find_spec("torch_xla") else "not installed",
        "Backends registered": ", ".join(sorted(backends)),
        "Backends available": ", ".join(sorted(available)),
        "Backend selected": selected,
    }
    for name in sorted(os.environ):
        if name.startswith("ACCEL_"):
            facts[name] = os.environ[name]
    return facts


def run(args: argparse.Namespace) -> int:
    """Print the report; returns the exit code."""
    facts = report()
    width = max(len(name) for name in facts)
    for name, value in facts.items():
        print(f"{name + ':':<{width + 1}} {value}")
    return 0
