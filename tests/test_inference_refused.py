"""Pipeline parallelism (Accelerate's `accelerate.inference.prepare_pippy`) is refused by name, with what to use."""

import inspect

import pytest
from torch import nn

from accel.inference import prepare_pippy


def test_prepare_pippy_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"prepare_pippy \(pipeline-parallel inference.*device map"):
        prepare_pippy(nn.Linear(2, 2), example_args=())


def test_prepare_pippy_takes_accelerates_arguments():
    import accelerate.inference

    ours = inspect.signature(prepare_pippy).parameters
    theirs = inspect.signature(accelerate.inference.prepare_pippy).parameters
    assert list(ours) == list(theirs)
    assert all(ours[name].default == theirs[name].default for name in ours)
