"""`model.to` of a dispatched model warns only when it names a device (Accelerate's behaviour).

`WarnOnMove` reads `Module.to`'s arguments with public types only; this table is
`Module.to`'s documented forms and what torch reads from each (the device or None).
"""

import logging

import pytest
import torch
from torch import nn

from accel.hooks import WarnOnMove, _names_a_device

_T = torch.zeros(1)

#: (args, kwargs, names a device): torch's `Module.to` reads device None for exactly the False rows
FORMS = [
    ((), {}, False),
    (("cpu",), {}, True),
    ((torch.device("cpu"),), {}, True),
    ((0,), {}, True),
    (("cuda:1",), {}, True),
    (("cpu", torch.float16), {}, True),
    (("cpu",), {"non_blocking": True}, True),
    ((), {"device": "cpu"}, True),
    ((), {"device": None}, False),
    ((), {"device": "meta", "dtype": torch.float16}, True),
    ((None,), {}, False),
    ((None, torch.float16), {}, False),
    ((torch.float16,), {}, False),
    ((torch.float16, True), {}, False),
    ((), {"dtype": torch.float16}, False),
    ((_T,), {}, True),
    ((_T, True), {}, True),
    ((), {"tensor": _T}, True),
    ((), {"memory_format": torch.channels_last}, False),
    ((), {"non_blocking": True}, False),
]


@pytest.mark.parametrize(("args", "kwargs", "expected"), FORMS)
def test_module_to_arguments_read_as_torch_reads_them(args, kwargs, expected):
    assert _names_a_device(*args, **kwargs) is expected


def test_a_dispatched_model_warns_when_moved_to_a_device_not_when_cast(caplog):
    model = nn.Linear(2, 2)
    model.to = WarnOnMove(model.to, model)  # as `dispatch_model` wraps it
    with caplog.at_level(logging.WARNING, logger="accel.big_modeling"):
        model.to(torch.float64)
        model.to(dtype=torch.float32)
        assert "shouldn't move a model" not in caplog.text
        model.to("cpu")
        assert "shouldn't move a model that is dispatched" in caplog.text
    with pytest.raises(RuntimeError):
        model.to("no-such-device")  # refused by torch's own `to`, as without the wrapper
