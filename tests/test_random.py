"""Single-process tests of seeding and RNG synchronisation."""

import random
import sys

import pytest
import torch

from accel.state import PartialState
from accel.utils.operations import set_seed, synchronize_rng_state, synchronize_rng_states


def draws():
    return random.random(), torch.rand(3).tolist()


def test_set_seed_repeats_python_torch_and_numpy():
    numpy = pytest.importorskip("numpy")
    assert "numpy" in sys.modules
    set_seed(11)
    first = draws(), numpy.random.rand()
    set_seed(11)
    assert (draws(), numpy.random.rand()) == first
    set_seed(12)
    assert draws() != first[0]


def test_device_specific_seed_adds_the_process_index():
    state = PartialState()
    set_seed(3, device_specific=True)
    specific = draws()
    set_seed(3 + state.process_index)
    assert draws() == specific


def test_deterministic_flag(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda flag: seen.append(flag))
    set_seed(0, deterministic=True)
    assert seen == [True]


def test_set_seed_rejects_non_integers():
    with pytest.raises(TypeError, match="integer seed"):
        set_seed("7")


def test_synchronize_on_one_process_keeps_states():
    gen = torch.Generator().manual_seed(4)
    before = gen.get_state().clone(), torch.get_rng_state().clone()
    synchronize_rng_states(["torch", "generator"], generator=gen)
    assert torch.equal(gen.get_state(), before[0]) and torch.equal(torch.get_rng_state(), before[1])


def test_synchronize_errors_are_clear():
    with pytest.raises(ValueError, match="needs the generator"):
        synchronize_rng_state("generator")
    with pytest.raises(ValueError, match="no device generator"):
        synchronize_rng_state("cuda")
    with pytest.raises(ValueError):
        synchronize_rng_state("not-a-generator")
