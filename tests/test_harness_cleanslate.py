"""The clean slate of a warm rank, put back in two steps: most of it once a task has answered
(`reset`, off the next task's path), the task's paths and earlier tests' groups when the next
one begins (`enter`)."""

import os
import sys

import pytest

from accel.sim.cleanslate import CleanSlate


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


def test_a_reset_that_failed_fails_the_next_task():
    calls = []

    def broken_device_reset():
        calls.append(1)
        raise OSError("the device would not reset")

    slate = CleanSlate(broken_device_reset)
    slate.reset()  # after a task: nothing raised to the task that already answered...
    assert calls == [1]
    with pytest.raises(RuntimeError, match="could not be put back in its start-up state") as info:
        slate.enter()  # ...the next one fails, saying why
    assert isinstance(info.value.__cause__, OSError)
    slate.enter()  # said once


def test_what_reset_also_calls_fails_the_next_task_too():
    def forget():
        raise ConnectionError("store gone")

    slate = CleanSlate(lambda: None)
    slate.reset(forget)
    with pytest.raises(RuntimeError) as info:
        slate.enter()
    assert isinstance(info.value.__cause__, ConnectionError)
