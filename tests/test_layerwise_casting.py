"""Layerwise casting (`attach_layerwise_casting_hooks`, `LayerwiseCastingHook`): linear and convolution layers
stored in a small dtype, computed in a larger one, on the CPU and on simulated GPUs."""

import pytest
import torch
from torch import nn

from accel.big_modeling import attach_layerwise_casting_hooks
from accel.hooks import LayerwiseCastingHook, remove_hook_from_submodules
from accel.utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
from harness import distributed_test


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.norm = nn.LayerNorm(6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.block(self.norm(self.conv(x))))


def dtypes(model):
    return {name: p.dtype for name, p in model.named_parameters()}


def test_only_linear_and_convolution_layers_are_stored_small():
    assert (
        nn.Linear in SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
        and nn.ConvTranspose3d in SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING
    )
    model = Net()
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    for name, dtype in dtypes(model).items():
        assert dtype == (torch.float32 if name.startswith("norm") else torch.float8_e4m3fn), name
    assert isinstance(model.block[0]._hf_hook, LayerwiseCastingHook) and not hasattr(model.norm, "_hf_hook")
    assert not hasattr(model, "_hf_hook") and not hasattr(model.block, "_hf_hook")


def test_each_layer_computes_in_the_compute_dtype_and_goes_back_to_storage():
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float16, compute_dtype=torch.float32)
    seen = {}
    for name in ("conv", "block.0", "head"):
        layer = model.get_submodule(name)
        inner = layer._old_forward  # the layer's own forward, which the hook surrounds

        def recording(x, layer=layer, inner=inner, name=name):
            seen[name] = layer.weight.dtype
            return inner(x)

        layer._old_forward = recording
    x = torch.randn(5, 2, 8)
    with torch.no_grad():
        out = model(x)
        # the same as a model whose stored weights were rounded to float16
        for name, p in reference.named_parameters():
            if not name.startswith("norm"):
                p.copy_(p.half().float())
        expected = reference(x)
    assert seen == {"conv": torch.float32, "block.0": torch.float32, "head": torch.float32}
    assert out.dtype == torch.float32 and torch.allclose(out, expected)
    assert dtypes(model)["head.weight"] == torch.float16  # stored small again after the forward


def test_gradients_flow_through_cast_layers():
    model = Net()
    attach_layerwise_casting_hooks(model, storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    model(torch.randn(3, 2, 8)).sum().backward()
    # computed while the weights were in float32 (as in Accelerate, the casting is meant for inference)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("pattern", ["block", ("^block$",), ["nothing", "block"]])
def test_modules_skipped_by_name_keep_everything_inside_them(pattern):
    model = Net()
    attach_layerwise_casting_hooks(
        model, storage_dtype=torch.float16, compute_dtype=torch.float32, skip_modules_pattern=pattern
    )
    found = dtypes(model)
    assert found["block.0.weight"] == found["block.2.bias"] == torch.float32  # one string is one pattern
    assert found["head.weight"] == found["conv.weight"] == torch.float16


def test_modules_skipped_by_class():
    model = Net()
    attach_layerwise_casting_hooks(
        model, storage_dtype=torch.float16, compute_dtype=torch.float32, skip_modules_classes=(nn.Conv1d,)
    )
    assert dtypes(model)["conv.weight"] == torch.float32 and dtypes(model)["head.weight"] == torch.float16


def test_the_hooks_come_off():
    model = Net()
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float16, compute_dtype=torch.float32)
    remove_hook_from_submodules(model)
    assert not hasattr(model.head, "_hf_hook") and model.head.forward.__self__ is model.head


def test_bad_arguments_are_refused_before_anything_is_cast():
    model = Net()
    with pytest.raises(TypeError, match="storage_dtype must be a floating-point torch.dtype"):
        attach_layerwise_casting_hooks(model, storage_dtype=torch.int8, compute_dtype=torch.float32)
    with pytest.raises(TypeError, match="compute_dtype must be a floating-point torch.dtype"):
        attach_layerwise_casting_hooks(model, storage_dtype=torch.float16, compute_dtype="float32")
    with pytest.raises(TypeError, match="skip_modules_classes must hold nn.Module subclasses"):
        attach_layerwise_casting_hooks(
            model, storage_dtype=torch.float16, compute_dtype=torch.float32, skip_modules_classes=("Linear",)
        )
    assert set(dtypes(model).values()) == {torch.float32}


@distributed_test(world_size=2, device="cuda")
def test_float8_storage_on_simulated_gpus(rank):
    torch.manual_seed(0)
    model = Net().to(f"cuda:{rank}")
    attach_layerwise_casting_hooks(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert model.head.weight.dtype == torch.float8_e4m3fn and model.head.weight.is_cuda
    model.norm.to(torch.bfloat16)
    with torch.no_grad():
        out = model(torch.randn(4, 2, 8, device=f"cuda:{rank}", dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.is_cuda and torch.isfinite(out.float()).all()
    assert model.block[0].weight.dtype == torch.float8_e4m3fn
