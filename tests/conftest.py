"""Every single-process test starts from a clean accel state and launcher environment."""

import pytest

from accel.state import reset_state

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCEL_BACKEND")
ACCEL_VARS = ("ACCEL_DEBUG_MODE", "ACCEL_MIXED_PRECISION", "ACCEL_USE_CPU", "ACCEL_LOG_LEVEL")


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    for name in LAUNCH_VARS + ACCEL_VARS:
        monkeypatch.delenv(name, raising=False)
    reset_state()
    yield
    reset_state(destroy_process_group=True)
