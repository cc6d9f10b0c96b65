"""merge_fsdp_weights and `accel merge-weights` in one process (on distributed checkpoints written by one
process), and what the FSDP checkpoint helpers refuse. Their multi-rank behaviour:
tests/multiproc/test_fsdp_helpers_ranks.py."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from accel.utils import merge_fsdp_weights


def write_checkpoint(folder, state):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def test_a_model_checkpoint_is_merged_into_safetensors(tmp_path):
    weights = {"linear.weight": torch.randn(4, 3), "linear.bias": torch.randn(4), "norm.weight": torch.ones(4)}
    write_checkpoint(tmp_path / "pytorch_model_fsdp_0", {"model": weights})
    merge_fsdp_weights(tmp_path / "pytorch_model_fsdp_0", tmp_path / "out")
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(merged) == sorted(weights)  # the {"model": ...} level is gone
    assert all(torch.equal(merged[k], v) for k, v in weights.items())
    assert (tmp_path / "pytorch_model_fsdp_0").exists()


def test_nested_state_keeps_its_shape_and_types(tmp_path):
    state = {
        "optimizer": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).reshape(2, 3)}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2, "params": ["b"]}],
        }
    }
    write_checkpoint(tmp_path / "optimizer_0", state)
    merge_fsdp_weights(str(tmp_path / "optimizer_0"), str(tmp_path), safe_serialization=False)
    merged = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert merged["param_groups"] == [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2, "params": ["b"]}]
    assert torch.equal(merged["state"]["w"]["exp_avg"], torch.arange(6.0).reshape(2, 3))
    assert merged["state"]["w"]["step"].item() == 3.0


def test_two_top_level_entries_are_kept(tmp_path):
    write_checkpoint(tmp_path / "ckpt", {"a": {"x": torch.ones(2)}, "b": {"y": torch.zeros(2)}})
    merge_fsdp_weights(tmp_path / "ckpt", tmp_path, safe_serialization=False)
    merged = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert sorted(merged) == ["a", "b"]


def test_remove_checkpoint_dir(tmp_path):
    write_checkpoint(tmp_path / "ckpt", {"model": {"w": torch.ones(2)}})
    merge_fsdp_weights(tmp_path / "ckpt", tmp_path / "out", remove_checkpoint_dir=True)
    assert not (tmp_path / "ckpt").exists()
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "present,hint",
    [
        ([], "couldn't find a valid metadata file.$"),
        (["pytorch_model_fsdp_0"], "pass .*pytorch_model_fsdp_0 instead"),
        (["optimizer_0"], "pass .*optimizer_0 instead"),
        (["pytorch_model_fsdp_0", "optimizer_0"], "a model and an optimizer checkpoint"),
    ],
)
def test_a_folder_without_a_checkpoint_is_refused_with_a_hint(tmp_path, present, hint):
    for name in present:
        (tmp_path / name).mkdir()
    with pytest.raises(ValueError, match=hint):
        merge_fsdp_weights(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_merge_weights_command(tmp_path):
    weights = {"w": torch.randn(3, 3)}
    write_checkpoint(tmp_path / "pytorch_model_fsdp_0", {"model": weights})
    command = [sys.executable, "-m", "accel.commands.cli", "merge-weights"]
    result = subprocess.run(
        [*command, str(tmp_path / "pytorch_model_fsdp_0"), str(tmp_path / "out"), "--unsafe_serialization"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert torch.equal(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)["w"], weights["w"])
    result = subprocess.run(
        [*command, str(tmp_path / "nowhere"), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "couldn't find a valid metadata file" in result.stderr
    usage = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60)
    assert "--remove_checkpoint_dir" in usage.stdout and "--unsafe_serialization" in usage.stdout


def test_the_parser_of_accelerates_merge_module():
    from accel.commands.merge import merge_command_parser

    args = merge_command_parser().parse_args(["in", "out", "--unsafe_serialization"])
    assert (args.checkpoint_directory, args.output_path, args.unsafe_serialization, args.remove_checkpoint_dir) == (
        "in",
        "out",
        True,
        False,
    )


def test_what_the_checkpoint_helpers_refuse(tmp_path):
    from torch import nn

    from accel.utils import FullyShardedDataParallelPlugin, load_fsdp_model, save_fsdp_model, save_fsdp_optimizer

    with pytest.raises(NotImplementedError, match="fsdp_version=2"):
        save_fsdp_model(FullyShardedDataParallelPlugin(fsdp_version=1), None, nn.Linear(2, 2), tmp_path)
    two = FullyShardedDataParallelPlugin(fsdp_version=2)
    with pytest.raises(NotImplementedError, match="use_dcp=False"):
        save_fsdp_optimizer(two, None, None, nn.Linear(2, 2), tmp_path, use_dcp=False)
    with pytest.raises(NotImplementedError, match="adapter_only=True"):
        load_fsdp_model(two, None, nn.Linear(2, 2), tmp_path, adapter_only=True)
    with pytest.raises(TypeError, match="expected a FullyShardedDataParallelPlugin"):
        save_fsdp_model("plugin", None, nn.Linear(2, 2), tmp_path)
