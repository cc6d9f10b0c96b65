"""Every single-process test starts from a clean accel state and launcher environment."""

import os

import pytest

from accel.state import reset_state

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCEL_BACKEND")
ACCEL_VARS = ("ACCEL_DEBUG_MODE", "ACCEL_MIXED_PRECISION", "ACCEL_USE_CPU", "ACCEL_LOG_LEVEL")


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    before = dict(os.environ)
    for name in LAUNCH_VARS + ACCEL_VARS:
        monkeypatch.delenv(name, raising=False)
    reset_state()
    yield
    reset_state(destroy_process_group=True)
    # What a test (or the code it runs: FSDP plugins, the RAM-efficient-loading switches) set in this
    # process's environment is gone before the next test: later `accel launch` subprocesses inherit it.
    for name in set(os.environ) - set(before):
        del os.environ[name]
    os.environ.update((name, value) for name, value in before.items() if os.environ.get(name) != value)
