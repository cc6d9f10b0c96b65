"""Every documented name resolves from the import paths users already write; importing is cheap."""

import subprocess
import sys

import pytest

import accel
import accel.utils


@pytest.mark.parametrize("module", [accel, accel.utils], ids=["accel", "accel.utils"])
def test_every_exported_name_resolves(module):
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))


def test_unknown_name_is_a_clear_attribute_error():
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = accel.NoSuchThing


def test_import_does_not_pull_heavy_modules():
    code = (
        "import sys, accel; from accel import Accelerator\n"
        "heavy = [m for m in ('torch._dynamo', 'torch.distributed.fsdp', 'accel.sim', 'harness') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
