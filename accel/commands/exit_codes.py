"""Exit codes of `accel launch`, shared by its real (torchrun) and simulated runs."""

from __future__ import annotations


def process_exit_code(exitcode: int | None) -> int:
    """Our exit code for a process that ended with `exitcode` (negative: killed by that signal)."""
    if exitcode is None or exitcode == 0:
        return 1
    return 128 - exitcode if exitcode < 0 else exitcode
