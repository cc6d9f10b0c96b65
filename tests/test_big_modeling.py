"""Big-model basics on the CPU, side by side with Accelerate where it runs the same call:
empty and on-device initialisation, device maps within `max_memory`, loading checkpoints (a
`save_model` output, sharded safetensors with their index), dispatch, CPU offload and hooks."""

import json
import os
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

from accel import init_empty_weights, init_on_device
from accel.big_modeling import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    load_checkpoint_and_dispatch,
)
from accel.hooks import (
    AlignDevicesHook,
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    attach_align_device_hook,
    remove_hook_from_module,
)
from accel.utils import (
    compute_module_sizes,
    find_tied_parameters,
    has_offloaded_params,
    infer_auto_device_map,
    load_checkpoint_in_model,
    set_module_tensor_to_device,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


def stack(n=3):
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict((f"layer{i}", Block()) for i in range(n))).eval()


def peer_maps(build, **kwargs):
    from accelerate.utils import infer_auto_device_map as peer

    return infer_auto_device_map(build(), **kwargs), peer(build(), **kwargs)


# -- initialisation --------------------------------------------------------------------------


def test_init_empty_weights_puts_parameters_on_meta_and_keeps_buffers():
    with init_empty_weights():
        model = Block()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.batchnorm.running_mean.device.type == "cpu"
    assert isinstance(model.linear1.weight, nn.Parameter) and model.linear1.weight.requires_grad
    with init_empty_weights(include_buffers=True):
        model = Block()
    assert model.batchnorm.running_mean.device.type == "meta"
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # only inside the block


def test_init_on_device_builds_on_that_device():
    with init_on_device("meta"):
        layer = nn.Linear(1000, 1000)
    assert layer.weight.device.type == "meta" and layer.weight.shape == (1000, 1000)


# -- sizes and device maps --------------------------------------------------------------------


def test_module_sizes_count_tied_weights_once():
    model = stack(2)
    sizes = compute_module_sizes(model)
    per_block = (3 * 4 + 4) * 4 + (4 + 4 + 4 + 4) * 4 + 8 + (4 * 3 + 3) * 4  # linear1, batchnorm (+ counter), linear2
    assert sizes["layer0"] == per_block and sizes[""] == 2 * per_block
    model.layer1.linear1.weight = model.layer0.linear1.weight
    assert find_tied_parameters(model) == [["layer0.linear1.weight", "layer1.linear1.weight"]]
    assert compute_module_sizes(model)[""] == 2 * per_block - 3 * 4 * 4


@pytest.mark.parametrize(
    "max_memory,no_split",
    [
        ({0: 500, 1: 500}, None),
        ({0: 400, 1: 500}, None),
        ({0: 500, 1: 500}, ["Block"]),
        ({0: 200, 1: 300, "cpu": 1000}, None),
        ({0: "1KB", "cpu": "1KB"}, ["Block"]),
        ({"cpu": 10_000}, None),
    ],
)
def test_infer_auto_device_map_equals_accelerates(max_memory, no_split):
    ours, theirs = peer_maps(stack, max_memory=dict(max_memory), no_split_module_classes=no_split)
    assert ours == theirs


def test_infer_auto_device_map_reserves_the_largest_layer_and_splits_blocks():
    # blocks of 196 bytes, largest layer 72 (batchnorm): GPU 0 keeps 72 free for an offloaded layer
    device_map = infer_auto_device_map(stack(), max_memory={0: 400, 1: 500})
    assert device_map == {"layer0": 0, "layer1.linear1": 0, "layer1.batchnorm": 1, "layer1.linear2": 1, "layer2": 1}
    device_map = infer_auto_device_map(stack(), max_memory={0: 400, 1: 500}, no_split_module_classes=["Block"])
    assert device_map == {"layer0": 0, "layer1": 1, "layer2": 1}
    device_map = infer_auto_device_map(stack(), max_memory={0: 400, "cpu": 500})
    assert device_map["layer2"] == "cpu" and device_map["layer0"] == 0
    with pytest.raises(ValueError, match="'5XB'"):
        infer_auto_device_map(stack(), max_memory={0: "5XB"})


def test_infer_auto_device_map_on_a_meta_model_with_tied_weights():
    with init_empty_weights():
        model = stack()
    model.layer2.linear2.weight = model.layer0.linear2.weight
    ours = infer_auto_device_map(model, max_memory={0: 400, 1: 500})
    from accelerate.utils import infer_auto_device_map as peer

    assert ours == peer(model, max_memory={0: 400, 1: 500})
    assert ours["layer2.linear2"] == ours["layer0"]  # a tied weight goes with its first user


# -- loading ---------------------------------------------------------------------------------


def save_sharded(model, directory, shard_bytes):
    from accel.utils.saving import write_model_weights

    return write_model_weights(model.state_dict(), os.fspath(directory), max_shard_size=shard_bytes)


@pytest.mark.parametrize("shard_bytes", [10**9, 300])
def test_load_checkpoint_in_model_reads_save_model_outputs(tmp_path, shard_bytes):
    source = stack()
    names = save_sharded(source, tmp_path, shard_bytes)
    assert (len(names) > 1) == (shard_bytes == 300)
    for checkpoint in [tmp_path] + ([tmp_path / "model.safetensors.index.json"] if len(names) > 1 else []):
        with init_empty_weights():
            model = stack()
        load_checkpoint_in_model(model, checkpoint, device_map={"": "cpu"})
        for (name, theirs), ours in zip(source.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(ours, theirs), name
        plain = stack(3)
        with torch.no_grad():
            for p in plain.parameters():
                p.zero_()
        load_checkpoint_in_model(plain, checkpoint)  # without a device map: torch's set_model_state_dict
        pairs = zip(plain.state_dict().values(), source.state_dict().values(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text()) if len(names) > 1 else None
    if index is not None:
        assert set(index["weight_map"]) == set(source.state_dict())


def test_load_checkpoint_in_model_dtype_strict_and_unexpected_keys(tmp_path, caplog):
    source = stack(1)
    state = dict(source.state_dict())
    state["extra"] = torch.ones(2)
    torch.save(state, tmp_path / "weights.bin")
    model = stack(1)
    load_checkpoint_in_model(model, tmp_path / "weights.bin", device_map={"": "cpu"}, dtype=torch.float16)
    assert model.layer0.linear1.weight.dtype == torch.float16
    assert model.layer0.batchnorm.num_batches_tracked.dtype == torch.int64  # not a float: untouched
    assert "were not used when initializing" in caplog.text and "extra" in caplog.text
    with pytest.raises(RuntimeError, match="unexpected keys \\['extra'\\]"):
        load_checkpoint_in_model(stack(1), tmp_path / "weights.bin", strict=True)
    with pytest.raises(ValueError, match="pass offload_folder"):
        load_checkpoint_in_model(stack(1), tmp_path / "weights.bin", device_map={"": "disk"})
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        load_checkpoint_in_model(stack(1), tmp_path / "missing.bin")


def test_set_module_tensor_to_device_checks_shapes_and_keeps_parameters():
    model = Block()
    with pytest.raises(ValueError, match=r"Trying to set a tensor of shape torch.Size\(\[2, 2\]\) in \"weight\""):
        set_module_tensor_to_device(model, "linear1.weight", "cpu", value=torch.zeros(2, 2))
    set_module_tensor_to_device(model, "linear1.weight", "meta")
    with pytest.raises(ValueError, match="pass a `value`"):
        set_module_tensor_to_device(model, "linear1.weight", "cpu")
    set_module_tensor_to_device(model, "linear1.weight", "cpu", value=torch.ones(4, 3, dtype=torch.float64))
    weight = model.linear1.weight
    assert isinstance(weight, nn.Parameter) and weight.dtype == torch.float32 and weight.requires_grad


# -- dispatch, offload and hooks ---------------------------------------------------------------


def test_load_checkpoint_and_dispatch_with_cpu_offload_gives_the_same_outputs(tmp_path):
    source = stack()
    save_sharded(source, tmp_path, 300)
    x = torch.randn(4, 3)
    expected = source(x)
    with init_empty_weights():
        model = stack()
    model.eval()
    model = load_checkpoint_and_dispatch(
        model, tmp_path, device_map={"layer0": "cpu", "layer1": "cpu", "layer2": "cpu"}
    )
    assert model.hf_device_map == {"layer0": "cpu", "layer1": "cpu", "layer2": "cpu"}
    assert torch.allclose(model(x), expected)


def test_cpu_offload_keeps_weights_off_the_model_between_forwards():
    model = stack()
    x = torch.randn(4, 3)
    expected = model(x)
    cpu_offload(model, execution_device="cpu")
    assert model.layer0.linear1.weight.device.type == "meta" and has_offloaded_params(model.layer0.linear1)
    assert torch.allclose(model(x), expected)
    assert model.layer1.linear2.weight.device.type == "meta"


def test_cpu_offload_with_hook_chains_models():
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    first, hook1 = cpu_offload_with_hook(first, execution_device="cpu")
    second, hook2 = cpu_offload_with_hook(second, execution_device="cpu", prev_module_hook=hook1)
    y = second(first(torch.randn(2, 3)))
    assert y.shape == (2, 3) and not has_offloaded_params(first)
    hook2.remove()
    assert "forward" not in second.__dict__


def test_hooks_run_in_order_and_leave_no_trace():
    calls = []

    class Record(ModelHook):
        def __init__(self, tag):
            self.tag = tag

        def pre_forward(self, module, *args, **kwargs):
            calls.append(f"pre-{self.tag}")
            return args, kwargs

        def post_forward(self, module, output):
            calls.append(f"post-{self.tag}")
            return output + 1

    model = nn.Linear(2, 2)
    add_hook_to_module(model, Record("a"))
    add_hook_to_module(model, Record("b"), append=True)
    assert isinstance(model._hf_hook, SequentialHook)
    x = torch.randn(1, 2)
    out = model(x)
    assert calls == ["pre-a", "pre-b", "post-a", "post-b"]
    assert torch.allclose(out, nn.functional.linear(x, model.weight, model.bias) + 2)
    remove_hook_from_module(model)
    assert "forward" not in model.__dict__ and not hasattr(model, "_hf_hook")
    pickle.dumps(model)


def test_has_offloaded_params_as_accelerate():
    model = stack(1)
    assert not has_offloaded_params(model)
    attach_align_device_hook(model, offload=False)
    assert not has_offloaded_params(model.layer0.linear1)
    remove_hook_from_module(model, recurse=True)
    attach_align_device_hook(model, execution_device="cpu", offload=True)
    assert has_offloaded_params(model.layer0.linear1) and isinstance(model.layer0.linear1._hf_hook, AlignDevicesHook)
    remove_hook_from_module(model, recurse=True)
    assert model.layer0.linear1.weight.device.type == "cpu"  # the weights came back


def test_disk_offload_in_accelerates_layout(tmp_path):
    from accelerate.utils import OffloadedWeightsLoader as PeerLoader

    from accel.utils import OffloadedWeightsLoader, offload_state_dict

    model = stack(2)
    x = torch.randn(4, 3)
    expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["half"] = torch.ones(3, dtype=torch.bfloat16)
    offload_state_dict(tmp_path / "weights", state)
    for loader in (
        OffloadedWeightsLoader(save_folder=tmp_path / "weights"),
        PeerLoader(save_folder=str(tmp_path / "weights")),
    ):
        assert sorted(loader) == sorted(state)
        assert all(torch.equal(loader[k], v) and loader[k].dtype == v.dtype for k, v in state.items())
    disk_offload(model, tmp_path / "model")
    assert model.layer0.linear1.weight.device.type == "meta" and has_offloaded_params(model.layer0.linear1)
    assert torch.allclose(model(x), expected)


def test_load_and_dispatch_with_disk_and_cpu_blocks(tmp_path):
    source = stack()
    save_sharded(source, tmp_path / "ckpt", 300)
    x = torch.randn(4, 3)
    expected = source(x)
    device_map = {"layer0": "cpu", "layer1": "disk", "layer2": "cpu"}
    with init_empty_weights():
        model = stack()
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_in_model(model, tmp_path / "ckpt", device_map=device_map)
    model = load_checkpoint_and_dispatch(
        model, tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "off"
    )
    assert os.path.isfile(tmp_path / "off" / "index.json") and model.layer1.linear1.weight.device.type == "meta"
    assert torch.allclose(model.eval()(x), expected, atol=1e-6)
    with pytest.raises(RuntimeError, match="offloaded to cpu or disk"):
        model.to("cpu")
    with pytest.raises(ValueError, match="need an `offload_dir`"):
        dispatch_model(stack(1), {"layer0": "disk"})


def test_a_hooked_forward_keeps_its_name_and_signature():
    import inspect

    model = Block()
    add_hook_to_module(model, ModelHook())
    assert model.forward.__name__ == "forward" and list(inspect.signature(model.forward).parameters) == ["x"]
    remove_hook_from_module(model)
    assert not hasattr(model, "_hf_hook") and not hasattr(model, "_old_forward")
