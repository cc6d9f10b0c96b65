"""Each simulated device is a subpackage of accel/sim/ whose `rank` module the runtime finds by name.

The protocol is in `accel.sim.devices`' docstring. These tests run in this (non-rank)
process: nothing here installs a device, wraps `init_process_group` or starts a rank.
"""

import importlib
import os
import sys
import textwrap

import pytest

import accel.sim
from accel.backends import ENV_VAR
from accel.sim import device_names, devices
from accel.sim.runtime import adopt_group

#: a new kind of simulated device: one subpackage, its `rank` module recording what it was asked
TOY_RANK = """
BACKEND = "toy_backend"
DEFAULT_BACKEND = "toy_pg"
EQUIVALENTS = {"toy_pg_internal": "toy_pg"}
calls = []


def prepare():
    calls.append("prepare")


def reset():
    calls.append("reset")


def as_fresh_process():
    calls.append("fresh")


def to_torch(label):
    return f"torch:{label}"


def to_user(backend):
    return f"user:{backend}"
"""


@pytest.mark.parametrize("device", ["cuda", "xla"])
def test_each_simulated_device_has_a_rank_module(device):
    rank = devices.rank_module(device)
    assert rank is importlib.import_module(f"accel.sim.{device}.rank")
    assert isinstance(rank.BACKEND, str) and callable(rank.prepare) and callable(rank.reset)
    for name in ("as_fresh_process", "to_torch", "to_user"):
        assert callable(getattr(rank, name, print)), name
    assert isinstance(getattr(rank, "DEFAULT_BACKEND", ""), str)
    assert isinstance(getattr(rank, "HAS_NCCL", False), bool)
    assert isinstance(getattr(rank, "EQUIVALENTS", {}), dict)


def test_what_the_devices_ask_for():
    cuda, xla = devices.rank_module("cuda"), devices.rank_module("xla")
    assert devices.rank_module("cpu") is None  # the real CPU: no subpackage, nothing faked
    assert (cuda.BACKEND, cuda.DEFAULT_BACKEND, cuda.HAS_NCCL) == ("sim_cuda", "nccl", True)
    assert cuda.EQUIVALENTS == {"accel_sim_cuda": "cpu:gloo,cuda:nccl"}
    assert (cuda.to_torch("nccl"), cuda.to_torch("gloo"), cuda.to_user("sim_nccl")) == ("sim_nccl", "gloo", "nccl")
    assert xla.BACKEND == "xla" and xla.STUB_PATH == devices.FAKE_XLA_PATH
    assert not any(hasattr(xla, name) for name in ("DEFAULT_BACKEND", "HAS_NCCL", "EQUIVALENTS", "as_fresh_process"))


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """`accel.sim.toy`: a device subpackage the runtime was never told of, and "toy" in DEVICES."""
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "__init__.py").write_text('"""A toy simulated device."""\n')
    (tmp_path / "toy" / "rank.py").write_text(textwrap.dedent(TOY_RANK))
    monkeypatch.setattr(accel.sim, "__path__", [*accel.sim.__path__, str(tmp_path)])
    monkeypatch.setattr(devices, "DEVICES", (*devices.DEVICES, "toy"))
    # nothing of the real group machinery in this process
    installed = []
    monkeypatch.setattr(adopt_group, "install", lambda device, rank: installed.append((device, rank)))
    monkeypatch.setattr(adopt_group, "restore", lambda: installed.append("restore"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    try:
        yield installed
    finally:
        for name in ("accel.sim.toy.rank", "accel.sim.toy"):
            sys.modules.pop(name, None)


def test_a_new_device_subpackage_is_found_by_its_name(toy):
    devices.prepare_rank("toy")
    rank = sys.modules["accel.sim.toy.rank"]
    assert rank.calls == ["prepare"] and toy == [("toy", rank)]
    assert os.environ[ENV_VAR] == "toy_backend"
    devices.as_fresh_process()
    devices.reset_rank("toy")
    assert rank.calls == ["prepare", "fresh", "reset"] and toy[1:] == ["restore"]
    with pytest.raises(ValueError, match="choose one of cpu, cuda, xla, toy"):
        devices.prepare_rank("tpu")


def test_adopt_group_asks_the_device(toy, monkeypatch):
    rank = devices.rank_module("toy")
    monkeypatch.setattr(adopt_group, "_rank", rank)
    monkeypatch.setattr(adopt_group, "_device", "toy")
    assert adopt_group._normalise(None) == "toy_pg"
    assert adopt_group._equivalents() == {"toy_pg_internal": "toy_pg"}
    with pytest.raises(adopt_group.IncompatibleProcessGroupRequest, match="this rank simulates 'toy', where NCCL"):
        adopt_group._check_possible("nccl", -1, -1)
    monkeypatch.setattr(adopt_group, "_original_get_backend", lambda group: "gloo")
    assert adopt_group.get_backend(object()) == "user:gloo"
    # the CPU: torch's own defaults
    monkeypatch.setattr(adopt_group, "_rank", None)
    assert (adopt_group._normalise(None), adopt_group._equivalents(), adopt_group.get_backend(object())) == (
        "gloo",
        {},
        "gloo",
    )


def test_the_devices_are_the_cpu_and_the_subpackages_with_a_rank_module(tmp_path):
    assert device_names.DEVICES == ("cpu", "cuda", "xla")  # core/, runtime/, diagnoses/ are not devices
    for name, files in {"toy": ["__init__.py", "rank.py"], "helpers": ["__init__.py"], "loose": ["rank.py"]}.items():
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text("")
    assert device_names.subpackages_with_rank(tmp_path) == ["toy"]
