"""The logger prints on the main process only unless asked."""

import logging

import pytest

from accel.logging import get_logger
from accel.state import PartialState


def test_logs_on_main_process(caplog):
    PartialState()
    logger = get_logger("accel.test.main", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="accel.test.main"):
        logger.info("hello %s", "world")
    assert [r.getMessage() for r in caplog.records] == ["hello world"]


def test_other_processes_stay_quiet_unless_asked(caplog):
    state = PartialState()
    state.process_index = 1  # pretend to be a second rank
    logger = get_logger("accel.test.other", log_level="DEBUG")
    with caplog.at_level(logging.DEBUG, logger="accel.test.other"):
        logger.info("hidden")
        logger.warning("shown", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["shown"]


def test_record_points_at_the_caller(caplog):
    PartialState()
    logger = get_logger("accel.test.caller", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="accel.test.caller"):
        logger.info("where")
    assert caplog.records[0].filename == "test_logging.py"


def test_level_from_environment(monkeypatch):
    monkeypatch.setenv("ACCEL_LOG_LEVEL", "error")
    assert get_logger("accel.test.env").logger.level == logging.ERROR


def test_use_before_state_is_a_clear_error():
    logger = get_logger("accel.test.early", log_level="INFO")
    with pytest.raises(RuntimeError, match="create an Accelerator or a PartialState"):
        logger.info("too early")
