"""The clean slate of a warm rank, put back in two steps: most of it once a task has answered
(`reset`, off the next task's path), the task's paths and earlier tests' groups when the next
one begins (`enter`)."""

import os
import sys

import pytest

from accel.sim.runtime.cleanslate import CleanSlate


def test_reset_puts_the_state_back_and_enter_takes_the_tasks_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("H_SLATE", "start")
    slate = CleanSlate(lambda: None)
    os.environ["H_SLATE"] = "changed by a test"
    os.environ["H_SLATE_NEW"] = "1"
    path = [*sys.path, str(tmp_path)]
    slate.reset()
    assert os.environ["H_SLATE"] == "start" and "H_SLATE_NEW" not in os.environ
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(os.getcwd())
    slate.enter(str(tmp_path), path)
    assert os.getcwd() == str(tmp_path) and sys.path == path


def test_a_reset_that_failed_fails_the_next_task(monkeypatch):
    slate = CleanSlate(lambda: None)

    def broken_logging_restore():
        raise OSError("a handler would not close")

    monkeypatch.setattr(slate.logging, "restore", broken_logging_restore)
    slate.reset()  # after a task: nothing raised to the task that already answered...
    with pytest.raises(RuntimeError, match="could not be put back in its start-up state") as info:
        slate.enter()  # ...the next one fails, saying why
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    slate.enter()  # said once


def test_the_device_is_reset_when_the_next_task_begins_not_after_the_last():
    # peers may still use its communicators until every rank has answered
    resets = []
    slate = CleanSlate(lambda: resets.append(1))
    slate.reset()
    assert resets == []
    slate.enter()
    assert resets == [1]


def test_what_reset_also_calls_fails_the_next_task_too():
    def forget():
        raise ConnectionError("store gone")

    slate = CleanSlate(lambda: None)
    slate.reset(forget)
    with pytest.raises(RuntimeError) as info:
        slate.enter()
    assert isinstance(info.value.__cause__, ConnectionError)
