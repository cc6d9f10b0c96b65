"""FP8 training through an external engine: TransformerEngine ("TE") or torchao ("AO").

PyTorch alone has no FP8 training recipe, so `mixed_precision="fp8"` needs one of these
packages; without either, `Accelerator` fails at construction with an error that says
what to install, rather than silently training in another precision.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

ENGINE_MODULES = {"TE": "transformer_engine", "AO": "torchao"}

INSTALL_HINT = (
    "install one of: transformer_engine (`pip install transformer-engine[pytorch]`, NVIDIA GPUs) "
    "or torchao (`pip install torchao`)"
)


def find_fp8_engine(requested: str | None = None) -> str:
    """The FP8 engine to use ("TE" or "AO"): the one requested, else the first installed."""
    if requested is not None and requested not in ENGINE_MODULES:
        raise ValueError(f"FP8 engine {requested!r} is not supported by accel; use 'TE' or 'AO'")
    candidates = [requested] if requested is not None else list(ENGINE_MODULES)
    for name in candidates:
        if importlib.util.find_spec(ENGINE_MODULES[name]) is not None:
            return name
    wanted = (
        f"the requested FP8 engine {ENGINE_MODULES[requested]!r} is not installed"
        if requested
        else "no FP8 engine is installed"
    )
    raise ImportError(f"mixed_precision='fp8' needs an FP8 engine but {wanted}; {INSTALL_HINT}")


def convert_model_to_fp8(model: torch.nn.Module, engine: str, recipe: Any = None) -> torch.nn.Module:
    """Make `model` compute its linear layers in FP8 with `engine` (in place; returns it)."""
    if engine == "AO":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
        return model
    return _convert_with_transformer_engine(model, recipe)


def _convert_with_transformer_engine(model: torch.nn.Module, recipe: Any) -> torch.nn.Module:
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    from accel.utils.modeling import install_autocast_forward

    _swap_linears(model, te)
    fp8_recipe = te_recipe.DelayedScaling(
        margin=getattr(recipe, "margin", 0),
        fp8_format=getattr(te_recipe.Format, getattr(recipe, "fp8_format", "HYBRID")),
        amax_history_len=getattr(recipe, "amax_history_len", 1024),
        amax_compute_algo=getattr(recipe, "amax_compute_algo", "most_recent"),
        override_linear_precision=getattr(recipe, "override_linear_precision", (False, False, False)),
    )
    install_autocast_forward(model, lambda: te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe))
    return model


def _swap_linears(module: torch.nn.Module, te: Any) -> None:
    """Replace every `nn.Linear` under `module` by TransformerEngine's, keeping the weights."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            replacement = te.Linear(
                child.in_features, child.out_features, bias=child.bias is not None, params_dtype=child.weight.dtype
            )
            with torch.no_grad():
                replacement.weight.copy_(child.weight)
                if child.bias is not None:
                    replacement.bias.copy_(child.bias)
            setattr(module, name, replacement)
        else:
            _swap_linears(child, te)
