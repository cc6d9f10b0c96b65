"""`Accelerator.save_model` writes what Accelerate 1.15 writes (files, index, tensors), and the save/load hooks."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from accel.accelerator import Accelerator
from harness import distributed_test


class TiedModel(torch.nn.Module):
    """A language-model shape: the output layer shares the embedding's weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


def _read_folder(folder):
    """{file name: content}: tensors of weight files, parsed JSON of index files."""
    content = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            content[name] = load_file(path)
        elif name.endswith(".json"):
            with open(path) as handle:
                content[name] = json.load(handle)
        else:
            content[name] = torch.load(path, weights_only=True)
    return content


def _assert_same_folders(ours, theirs):
    assert list(ours) == list(theirs)
    for name, value in ours.items():
        if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
            assert list(value) == list(theirs[name]), name
            assert all(torch.equal(value[k], theirs[name][k]) for k in value), name
        else:
            assert value == theirs[name], name


@pytest.mark.parametrize("safe_serialization", [True, False], ids=["safetensors", "pickle"])
@pytest.mark.parametrize("max_shard_size", ["10GB", "3KB", 2000], ids=["one-file", "3KB", "2000-bytes"])
def test_save_model_writes_what_accelerate_writes(tmp_path, safe_serialization, max_shard_size):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    model = TiedModel()
    Accelerator().save_model(model, tmp_path / "ours", max_shard_size, safe_serialization)
    theirs = accelerate.Accelerator()
    theirs.save_model(model, tmp_path / "theirs", max_shard_size, safe_serialization)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()

    ours, reference = _read_folder(tmp_path / "ours"), _read_folder(tmp_path / "theirs")
    _assert_same_folders(ours, reference)
    weight_files = [n for n in ours if not n.endswith(".json")]
    assert (len(weight_files) > 1) == (max_shard_size != "10GB")
    stem = "model" if safe_serialization else "pytorch_model"
    if len(weight_files) > 1:
        assert weight_files[0] == f"{stem}-00001-of-{len(weight_files):05d}" + (
            ".safetensors" if safe_serialization else ".bin"
        )
        assert f"{stem}{'.safetensors' if safe_serialization else '.bin'}.index.json" in ours


def test_save_model_round_trip_with_tied_weights_and_stale_shards(tmp_path):
    acc = Accelerator()
    model = acc.prepare(TiedModel())
    acc.save_model(model, tmp_path, max_shard_size="3KB")
    first = sorted(os.listdir(tmp_path))
    assert len(first) > 2 and "model.safetensors.index.json" in first
    acc.save_model(model, tmp_path)  # one file now: the shards and index of the first save are removed
    assert os.listdir(tmp_path) == ["model.safetensors"]
    saved = load_file(tmp_path / "model.safetensors")
    assert "head.weight" not in saved  # written once, under the first name
    fresh = TiedModel()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(saved, strict=False)
    assert torch.equal(fresh.head.weight, model.head.weight)
    with pytest.raises(ValueError, match="is a file"):
        acc.save_model(model, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="max_shard_size"):
        acc.save_model(model, tmp_path, max_shard_size="10 parsecs")


def test_save_and_load_pre_hooks(tmp_path):
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(3, 2))
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", [type(m) for m in models], output_dir))
        torch.save(weights.pop(), os.path.join(output_dir, "my_format.pt"))  # saved our own way

    def load_hook(models, input_dir):
        calls.append(("load", [type(m) for m in models], input_dir))
        models.pop().load_state_dict(torch.load(os.path.join(input_dir, "my_format.pt")))

    save_handle = acc.register_save_state_pre_hook(save_hook)
    load_handle = acc.register_load_state_pre_hook(load_hook)
    folder = acc.save_state(tmp_path / "ckpt")
    assert "model.safetensors" not in os.listdir(folder) and "my_format.pt" in os.listdir(folder)
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    acc.load_state(folder)  # no model file: the hook loaded the model
    assert torch.equal(model.weight, expected)
    assert calls == [("save", [torch.nn.Linear], folder), ("load", [torch.nn.Linear], folder)]

    save_handle.remove()
    load_handle.remove()
    folder = acc.save_state(tmp_path / "plain")
    assert "model.safetensors" in os.listdir(folder)
    acc.load_state(folder)
    assert len(calls) == 2


@distributed_test(world_size=[2, 4], device=["cpu", "cuda", "xla"])
def test_save_model_and_save_state_on_several_ranks(tmp_path, rank, world_size):
    acc = Accelerator()
    model = acc.prepare(TiedModel())
    acc.prepare(model)  # preparing again registers nothing more
    assert len(acc._models) == 1
    acc.save_model(model, tmp_path / "export", max_shard_size="3KB")
    acc.wait_for_everyone()
    bare = acc.unwrap_model(model).state_dict()
    with open(tmp_path / "export" / "model.safetensors.index.json") as handle:
        index = json.load(handle)
    assert set(index["weight_map"]) == set(bare) - {"head.weight"}  # bare names, tied weight once
    for name, shard in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / "export" / shard)[name], bare[name].cpu())
    calls = []
    acc.register_save_state_pre_hook(lambda models, weights, out: calls.append((type(models[0]), sorted(weights[0]))))
    acc.register_load_state_pre_hook(lambda models, folder: calls.append((type(models[0]), folder)))
    folder = acc.save_state(tmp_path / "ckpt")
    names = os.listdir(folder)
    assert "model_1.safetensors" not in names
    assert set(load_file(os.path.join(folder, "model.safetensors"))) == set(bare) - {"head.weight"}
    acc.load_state(folder)
    # every rank runs the hooks, with the user's model (not its DDP wrapper) and bare weight names
    assert calls == [(TiedModel, sorted(bare)), (TiedModel, folder)]
