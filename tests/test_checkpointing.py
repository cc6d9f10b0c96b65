"""accel.checkpointing: weights saved through wrappers, tied weights, and what a mismatch says."""

import os

import pytest
import torch
from safetensors.torch import save_file

from accel.accelerator import Accelerator
from accel.checkpointing import load_model_weights, model_file_name


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))


def test_weights_saved_through_wrappers_load_into_the_bare_model():
    source = _net()
    for prefix in ("module.", "_orig_mod.module.", "module._orig_mod."):
        target = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        load_model_weights(target, {prefix + k: v for k, v in source.state_dict().items()})
        for a, b in zip(target.parameters(), source.parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_model_whose_own_submodule_is_called_module_keeps_its_names():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    source, target = Holder(), Holder()
    load_model_weights(target, source.state_dict())  # keys "module.weight": not a wrapper's prefix here
    assert torch.equal(target.module.weight, source.module.weight)


def test_mismatched_weights_say_what_differs_and_strict_false_loads_what_matches(tmp_path):
    acc = Accelerator()
    model = acc.prepare(_net())
    folder = tmp_path / "ckpt"
    acc.save_state(folder)
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("1.")}
    weights["extra.weight"] = torch.zeros(1)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, model_file_name(0, True)))
    with pytest.raises(RuntimeError, match=r"missing \['1.weight', '1.bias'\], unexpected \['extra.weight'\]"):
        acc.load_state(folder)
    with torch.no_grad():
        model[0].weight.zero_()
    acc.load_state(folder, strict=False)
    assert torch.equal(model[0].weight, weights["0.weight"])


def test_pickled_checkpoint_is_found_when_there_is_no_safetensors_file(tmp_path):
    acc = Accelerator()
    model = acc.prepare(_net())
    acc.save_state(tmp_path, safe_serialization=False)
    assert "pytorch_model.bin" in os.listdir(tmp_path) and "model.safetensors" not in os.listdir(tmp_path)
    expected = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.zero_()
    acc.load_state(tmp_path)
    assert torch.equal(model[0].weight, expected)
    with pytest.raises(TypeError, match="DeepSpeed"):
        acc.save_state(tmp_path / "other", exclude_frozen_parameters=True)


def test_compiled_model_checkpoint_keeps_compile_names_and_save_model_writes_bare_names(tmp_path):
    from safetensors.torch import load_file

    acc = Accelerator()
    model = acc.prepare(torch.compile(_net(), backend="eager"))
    acc.save_state(tmp_path / "ckpt")
    # as Accelerate (unwrap_model keeps torch.compile's wrapper by default): `_orig_mod.` names
    assert sorted(load_file(tmp_path / "ckpt" / "model.safetensors")) == [
        "_orig_mod.0.bias",
        "_orig_mod.0.weight",
        "_orig_mod.1.bias",
        "_orig_mod.1.weight",
    ]
    expected = model._orig_mod[0].weight.detach().clone()
    with torch.no_grad():
        model._orig_mod[0].weight.zero_()
    acc.load_state(tmp_path / "ckpt")
    assert torch.equal(model._orig_mod[0].weight, expected)
    acc.save_model(model, tmp_path / "export")
    assert sorted(load_file(tmp_path / "export" / "model.safetensors")) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_resuming_by_hand_with_skip_first_batches_leaves_the_next_epoch_whole(tmp_path):
    def run(load):
        from accel.state import reset_state

        reset_state()
        acc = Accelerator()
        loader = acc.prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
        if load:
            acc.load_state(tmp_path)
            # Accelerate's resume pattern: skip the batches already seen, then whole epochs
            return [[b.tolist() for b in acc.skip_first_batches(loader, 2)], [b.tolist() for b in loader]]
        for i, _ in enumerate(loader):
            if i == 1:
                acc.save_state(tmp_path)
        return None

    run(load=False)
    assert run(load=True) == [[[4, 5], [6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]]
