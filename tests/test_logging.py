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
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] hello world"]


def test_other_processes_stay_quiet_unless_asked(caplog):
    state = PartialState()
    state.process_index = 1  # pretend to be a second rank
    logger = get_logger("accel.test.other", log_level="DEBUG")
    with caplog.at_level(logging.DEBUG, logger="accel.test.other"):
        logger.info("hidden")
        logger.warning("shown", main_process_only=False)
    assert [r.getMessage() for r in caplog.records] == ["[RANK 1] shown"]


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


def test_warning_once_emits_each_message_once(caplog):
    PartialState()
    logger = get_logger("accel.test.once", log_level="INFO")
    with caplog.at_level(logging.INFO, logger="accel.test.once"):
        for _ in range(3):
            logger.warning_once("slow path")
        logger.warning_once("another")
        logger.warning_once("slow path")
    assert [r.getMessage() for r in caplog.records] == ["[RANK 0] slow path", "[RANK 0] another"]


def test_messages_match_accelerate(caplog, request):
    """Same text as the peer's logger, record for record."""
    from accelerate.logging import get_logger as peer_get_logger
    from accelerate.state import PartialState as PeerState

    PartialState()
    PeerState()
    request.addfinalizer(PeerState._reset_state)
    ours, theirs = get_logger("accel.test.same", "INFO"), peer_get_logger("accel.test.same_peer", "INFO")
    with caplog.at_level(logging.INFO):
        ours.info("step %d", 3)
        theirs.info("step %d", 3)
    assert caplog.records[0].getMessage() == caplog.records[1].getMessage() == "[RANK 0] step 3"
