"""Coverage of the lines run inside ranks, when the parent process is measured.

Under `coverage run` or pytest-cov the parent has a running `coverage.Coverage`; each
rank then starts its own with the same configuration and data directory, writing one
data file per rank process (saved after every task, since ranks may be killed), which
`coverage combine` and pytest-cov pick up with the others.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def parent_settings() -> dict[str, Any] | None:
    # Ranks measure coverage when the parent does (coverage run, pytest-cov): same
    # configuration, same data directory, one data file per rank process.
    coverage = sys.modules.get("coverage")
    current = getattr(getattr(coverage, "Coverage", None), "current", None)
    cov = current() if current else None
    if cov is None:
        return None
    from coverage.control import CONFIG_DATA_PREFIX

    return {
        "config": CONFIG_DATA_PREFIX + cov.config.serialize(),
        "data_file": os.path.abspath(cov.config.data_file),
    }


def start_in_rank(settings: dict[str, Any] | None) -> Any:
    """Start measuring this rank like the parent measures itself; the Coverage object, or None."""
    if not settings:
        return None
    import coverage

    inherited = coverage.Coverage.current()
    if inherited is not None:
        # Started at interpreter start-up in the fork server: its data file would be
        # shared by every rank forked from it.
        inherited._auto_save = False
        inherited.stop()
    cov = coverage.Coverage(config_file=settings["config"], data_file=settings["data_file"], data_suffix=True)
    cov._warn_no_data = False  # a rank that ran no measured code is normal
    cov._warn_unimported_source = False
    cov._warn_preimported_source = False  # the fork server preloaded accel
    cov.start()
    return cov
