"""Fully sharded data parallelism through `Accelerator`: the FSDP2 strategy.

`Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))` (or `accel
launch --use_fsdp --fsdp_version 2`) on several GPUs runs as `DistributedType.FSDP`: `prepare`
shards the model with `torch.distributed.fsdp.fully_shard` (the layers picked by the plugin's
auto-wrap policy first, then the root) and points the optimizer at the sharded parameters;
the rest of the training step is FSDP2's own. What differs from replicated data parallelism
lives here, one method per question `Accelerator` asks:

- `shard(accelerator, objects)`: shard the models of a `prepare` call, rebind its optimizers;
- `no_sync(model)`: accumulate without reducing gradients (`set_requires_gradient_sync`);
- `clip_grad_norm_`: the norm over every shard (DTensor gradients);
- `full_state_dict(model)`: the whole model's weights on rank 0, for `save_model` and
  `get_state_dict`;
- `save_models` / `load_models`: `save_state` / `load_state` in Accelerate's FSDP layout
  (`pytorch_model_fsdp_0/` and `optimizer_0/` distributed checkpoints for sharded state
  dicts, `pytorch_model_fsdp.bin` and `optimizer.bin` written by rank 0 for full ones), so
  that checkpoints move between accel and Accelerate.

FSDP1 (`fsdp_version=1`, the `FullyShardedDataParallel` wrapper) is refused: PyTorch
deprecates it in favour of FSDP2, which is what accel runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accel.utils.constants import FSDP_MODEL_NAME
from accel.utils.fsdp_plugin import FSDP1_REFUSED, check_version, layer_classes_to_wrap  # noqa: F401  (public here too)
from accel.utils.module_tensors import get_non_persistent_buffers

#: Accelerate's folder and file name of an optimizer's state in a checkpoint of FSDP models (with FSDP_MODEL_NAME)
OPTIMIZER_NAME = "optimizer"

#: (file and folder name, key inside its distributed checkpoint) of a model's and of an optimizer's state
_MODEL_PLACE = (FSDP_MODEL_NAME, "model")
_OPTIMIZER_PLACE = (OPTIMIZER_NAME, "optimizer")


def modules_bottom_up(model: nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every module of `model`, children before their parents (`model` last), as Accelerate orders them."""
    stack: list[tuple[str, nn.Module]] = [("", model)]
    ordered: list[tuple[str, nn.Module]] = []
    while stack:
        name, module = stack.pop()
        for child_name, child in module.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
        ordered.append((name, module))
    ordered.reverse()
    return ordered if return_fqns else [module for _, module in ordered]


def auto_wrap_predicate(plugin: Any, model: nn.Module) -> Callable[[nn.Module], bool] | None:
    """Which submodules get their own `fully_shard` call, from the plugin's auto-wrap policy (None: only the root).

    Transformer-based wrapping picks the modules whose class is named in
    `transformer_cls_names_to_wrap` (default: the model's `_no_split_modules`); size-based
    wrapping the modules with more than `min_num_params` parameters (none without a minimum).
    """
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    policy = plugin.auto_wrap_policy
    if isinstance(policy, functools.partial):
        policy = policy.func
    if policy is transformer_auto_wrap_policy:
        wanted = tuple(layer_classes_to_wrap(plugin, model))

        def by_class(module: nn.Module) -> bool:
            module = getattr(module, "_checkpoint_wrapped_module", module)
            return bool(wanted) and isinstance(module, wanted)

        return by_class
    if policy is size_based_auto_wrap_policy:
        threshold = plugin.min_num_params or 0
        if threshold <= 0:
            return None  # as Accelerate: a size-based policy without a minimum wraps nothing but the root

        def by_size(module: nn.Module) -> bool:
            return sum(p.numel() for p in module.parameters()) > threshold

        return by_size
    if policy is None:
        return None
    raise ValueError(
        f"auto_wrap_policy={plugin.auto_wrap_policy!r}: FSDP2 through accel takes 'transformer_based_wrap', "
        "'size_based_wrap', 'no_wrap', or torch's transformer_auto_wrap_policy / size_based_auto_wrap_policy"
    )


def _canonical(name: str) -> str:
    """A parameter's name without the wrappers activation checkpointing and torch.compile add."""
    name = name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")
    return name.replace("_orig_mod.", "").replace("._orig_mod", "")


class FSDP2Strategy:
    """What `Accelerator` does differently when it runs FSDP2 (see the module docstring)."""

    def __init__(self, plugin: Any) -> None:
        check_version(plugin)
        self.plugin = plugin
        # the parameters sharded so far, by id of the parameter they replace (held weakly: an id is only
        # trusted while its parameter lives), for optimizers prepared after their model
        self._moved: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}

    # -- prepare ------------------------------------------------------------------------------

    def shard(self, accelerator: Any, objects: Sequence[Any]) -> list[Any]:
        """Shard the models among `objects` in place and point the optimizers among them at the shards.

        A model may be prepared before the optimizer over its parameters (Accelerate requires them in
        the same call): the optimizer, prepared later, is pointed at the shards then.
        """
        from torch.distributed.fsdp import FSDPModule

        result = list(objects)
        models = [(i, m) for i, m in enumerate(result) if isinstance(m, nn.Module) and not isinstance(m, FSDPModule)]
        optimizers = [o for o in result if isinstance(o, torch.optim.Optimizer)]
        for index, model in models:
            before = {_canonical(n): p for n, p in model.named_parameters()}
            sharded = self.shard_model(accelerator, model)
            after = {_canonical(n): p for n, p in sharded.named_parameters()}
            for name, old in before.items():
                if name in after and after[name] is not old:
                    self._moved[id(old)] = (weakref.ref(old), after[name])
            result[index] = sharded
        live = {key: new for key, (ref, new) in self._moved.items() if ref() is not None}
        self._moved = {key: self._moved[key] for key in live}
        for optimizer in optimizers:
            _rebind_optimizer(optimizer, live)
        return result

    def shard_model(self, accelerator: Any, model: nn.Module) -> nn.Module:
        """Apply activation checkpointing and `fully_shard` to `model` as the plugin says; returns it."""
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if isinstance(model, FSDPModule):
            return model
        plugin = self.plugin
        predicate = auto_wrap_predicate(plugin, model)
        if plugin.activation_checkpointing:
            model = _apply_activation_checkpointing(
                model, predicate, offload=bool(plugin.activation_checkpointing_offload)
            )
        options: dict[str, Any] = {
            "reshard_after_forward": plugin.reshard_after_forward,
            "offload_policy": plugin.cpu_offload,
            "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        }
        if plugin.ignored_modules is not None:
            # kept whole on every rank (not sharded), on the device
            options["ignored_params"] = _ignored_parameters(plugin.ignored_modules, model, accelerator.device)
        if accelerator.mixed_precision != "no":
            # FSDP2 computes in the policy's dtype from fp32 master weights (as Accelerate upcasts them)
            for param in model.parameters():
                if param.requires_grad and param.dtype != torch.float32:
                    param.data = param.data.to(torch.float32)
        efficient = bool(plugin.cpu_ram_efficient_loading)
        if efficient:
            full_state = model.state_dict() if accelerator.is_main_process else {}
            persistent_not = _non_persistent_buffers(model)
            model = model.to(torch.device("meta"))
            _retie(model)
        elif accelerator.device_placement:
            model.to(accelerator.device)
        if predicate is not None:
            for module in modules_bottom_up(model)[:-1]:
                if predicate(module) and not isinstance(module, FSDPModule):
                    fully_shard(module, **options)
        self._shard_embeddings(model, options)
        if not isinstance(model, FSDPModule):
            fully_shard(model, **{k: v for k, v in options.items() if k != "reshard_after_forward"})
        if efficient:
            _load_full_state_from_rank0(model, full_state, accelerator.device, plugin.cpu_offload)
            for name, buffer in persistent_not.items():
                owner, _, leaf = name.rpartition(".")
                (model.get_submodule(owner) if owner else model).register_buffer(
                    leaf, buffer.to(accelerator.device), persistent=False
                )
            _retie(model)
        return model

    @staticmethod
    def _shard_embeddings(model: nn.Module, options: dict[str, Any]) -> None:
        """As Accelerate 1.15: input embeddings on their own; the final norm and output embeddings together,
        kept gathered after forward (they are used again first in backward)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        get_in = getattr(model, "get_input_embeddings", None)
        get_out = getattr(model, "get_output_embeddings", None)
        inputs = get_in() if callable(get_in) else None
        outputs = get_out() if callable(get_out) else None
        tied = inputs is not None and getattr(inputs, "weight", None) is getattr(outputs, "weight", object())
        if not tied and isinstance(inputs, nn.Module) and not isinstance(inputs, FSDPModule):
            fully_shard(inputs, **options)
        norm = _final_norm(model)
        tail = [m for m in ((norm, inputs, outputs) if tied else (norm, outputs)) if isinstance(m, nn.Module)]
        tail = [m for m in tail if not isinstance(m, FSDPModule)]
        if tail:
            fully_shard(tail, **{**options, "reshard_after_forward": False})

    # -- the training step ----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Accumulate gradients without reduce-scattering them (FSDP2's `set_requires_gradient_sync(False)`)."""
        setter = getattr(model, "set_requires_gradient_sync", None)
        if setter is None:
            yield
            return
        setter(False)
        try:
            yield
        finally:
            setter(True)

    @staticmethod
    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every shard of every gradient; returns that total norm.

        Gradients on several device meshes (or plain and sharded ones mixed) are normed per
        mesh and combined, as Accelerate does.
        """
        from torch.distributed.tensor import DTensor

        params = [p for p in parameters if p.grad is not None]
        groups: dict[Any, list[torch.Tensor]] = {}
        plain: list[torch.Tensor] = []
        for p in params:
            if isinstance(p.grad, DTensor):
                groups.setdefault(p.grad.device_mesh, []).append(p)
            else:
                plain.append(p)
        if len(groups) + bool(plain) <= 1:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        norms = [
            torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], norm_type)
            for group in [*groups.values(), *([plain] if plain else [])]
        ]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        for mesh, group in groups.items():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, DTensor.from_local(total, mesh))
        if plain:
            torch.nn.utils.clip_grads_with_norm_(plain, max_norm, total)
        return total

    # -- state dicts and checkpoints --------------------------------------------------------------

    @staticmethod
    def full_state_dict(model: nn.Module) -> dict[str, Any]:
        """The whole model's weights, on the CPU of rank 0 (other ranks get an empty dict), as Accelerate gives them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)

    def _options(self, num_processes: int) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        full = self._is_full()
        many = num_processes > 1
        # as Accelerate: a full state dict is gathered on rank 0's CPU (and broadcast from it when loading)
        return StateDictOptions(full_state_dict=full, cpu_offload=full and many, broadcast_from_rank0=full and many)

    def _is_full(self) -> bool:
        from torch.distributed.fsdp import StateDictType

        return bool(self.plugin.state_dict_type == StateDictType.FULL_STATE_DICT)

    def _write(self, accelerator: Any, state: Any, output_dir: str, place: tuple[str, str], index: int) -> None:
        """Write one model's or optimizer's `state` into `output_dir` in Accelerate's FSDP layout.

        `place` is (name, key): a full state dict goes to `name.bin` (`name_{index}.bin` past the
        first), written by rank 0; a sharded one to the distributed checkpoint `name_{index}/`,
        holding the state under `key`.
        """
        import torch.distributed.checkpoint as dcp

        name, key = place
        if self._is_full():
            if accelerator.process_index == 0:
                torch.save(state, os.path.join(output_dir, f"{name}.bin" if index == 0 else f"{name}_{index}.bin"))
            return
        folder = os.path.join(output_dir, f"{name}_{index}")
        os.makedirs(folder, exist_ok=True)
        dcp.save({key: state}, storage_writer=dcp.FileSystemWriter(folder))

    def _read_state(
        self,
        accelerator: Any,
        options: Any,
        input_dir: str,
        place: tuple[str, str],
        index: int,
        empty: Callable[[], Any],
    ) -> Any:
        """Read back what `_write` wrote at `place`.

        A full state dict is read by rank 0 only when it is broadcast from there (the others get
        `{}`); a sharded one is loaded into `empty()`, the model's or optimizer's own state dict.
        """
        import torch.distributed.checkpoint as dcp

        name, key = place
        if self._is_full():
            reads = accelerator.process_index == 0 or not options.broadcast_from_rank0
            path = os.path.join(input_dir, f"{name}.bin" if index == 0 else f"{name}_{index}.bin")
            return _read(path) if reads else {}
        folder = os.path.join(input_dir, f"{name}_{index}")
        if not os.path.isdir(folder) and os.path.isfile(os.path.join(input_dir, ".metadata")):
            folder = input_dir  # Accelerate also takes the distributed checkpoint's folder itself
        holder = {key: empty()}
        dcp.load(holder, storage_reader=dcp.FileSystemReader(_existing(folder)))
        return holder[key]

    def save_model(self, accelerator: Any, model: nn.Module, output_dir: str, index: int = 0) -> None:
        """Write `model`'s state into `output_dir` in Accelerate's FSDP layout (the model's `index`-th place)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        os.makedirs(output_dir, exist_ok=True)
        state = get_model_state_dict(model, options=self._options(accelerator.num_processes))
        self._write(accelerator, state, output_dir, _MODEL_PLACE, index)

    def save_optimizer(
        self, accelerator: Any, optimizer: Any, model: nn.Module, output_dir: str, index: int = 0
    ) -> None:
        """Write `optimizer`'s state (over `model`'s sharded parameters) into `output_dir` in Accelerate's layout."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        os.makedirs(output_dir, exist_ok=True)
        options = self._options(accelerator.num_processes)
        state: Any = get_optimizer_state_dict(model, _inner(optimizer), options=options)
        self._write(accelerator, state, output_dir, _OPTIMIZER_PLACE, index)

    def load_model(self, accelerator: Any, model: nn.Module, input_dir: str, index: int = 0) -> None:
        """Restore `model` from what `save_model` (or Accelerate's `save_fsdp_model`) wrote in `input_dir`."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        options = self._options(accelerator.num_processes)
        empty = functools.partial(get_model_state_dict, model, options=options)
        state = self._read_state(accelerator, options, input_dir, _MODEL_PLACE, index, empty)
        set_model_state_dict(model, state, options=options)

    def load_optimizer(
        self, accelerator: Any, optimizer: Any, model: nn.Module, input_dir: str, index: int = 0
    ) -> None:
        """Restore `optimizer` from what `save_optimizer` (or Accelerate's `save_fsdp_optimizer`) wrote."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        options = self._options(accelerator.num_processes)
        inner = _inner(optimizer)
        empty = functools.partial(get_optimizer_state_dict, model, inner, options=options)
        state = self._read_state(accelerator, options, input_dir, _OPTIMIZER_PLACE, index, empty)
        if self._is_full() and not _saved_any_state(state, broadcast=bool(options.broadcast_from_rank0)):
            # An optimizer without per-parameter state (plain SGD): torch's loader needs a tensor to place
            # the state by; only the groups' hyperparameters are there to restore.
            _load_group_settings(inner, state, broadcast=bool(options.broadcast_from_rank0))
            return
        set_optimizer_state_dict(model, inner, state, options=options)

    def save_models(
        self, accelerator: Any, output_dir: str, models: Sequence[nn.Module], optimizers: Sequence[Any]
    ) -> None:
        """Write the models' and optimizers' states into `output_dir` in Accelerate's FSDP layout."""
        for i, model in enumerate(models):
            self.save_model(accelerator, model, output_dir, i)
        for i, optimizer in enumerate(optimizers):
            self.save_optimizer(accelerator, optimizer, _model_of(optimizer, models), output_dir, i)

    def load_models(
        self, accelerator: Any, input_dir: str, models: Sequence[nn.Module], optimizers: Sequence[Any]
    ) -> None:
        """Restore what `save_models` (or Accelerate's FSDP `save_state`) wrote in `input_dir`."""
        for i, model in enumerate(models):
            self.load_model(accelerator, model, input_dir, i)
        for i, optimizer in enumerate(optimizers):
            self.load_optimizer(accelerator, optimizer, _model_of(optimizer, models), input_dir, i)


def strategy_for(state: Any) -> FSDP2Strategy | None:
    """The sharding strategy of this run: FSDP2 when the state runs `DistributedType.FSDP`, else None."""
    from accel.utils.dataclasses import DistributedType

    if state.distributed_type != DistributedType.FSDP:
        return None
    return FSDP2Strategy(state.fsdp_plugin)


# -- helpers --------------------------------------------------------------------------------------


def _rebind_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, nn.Parameter]) -> None:
    """Replace, in `optimizer`'s groups, the parameters that `mapping` (by id) knows by their sharded versions."""
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
    moved = set(mapping)
    stale = [p for p in list(optimizer.state) if id(p) in moved]
    if stale:
        raise ValueError(
            "the optimizer already holds state (it stepped) for parameters that FSDP2 now shards: prepare the model "
            "and the optimizer before the first optimizer step"
        )


def _saved_any_state(state: Any, broadcast: bool) -> bool:
    """Whether a full optimizer state dict (read on rank 0 when `broadcast`) holds per-parameter state."""
    flag = [bool(state.get("state")) if isinstance(state, dict) and state else None]
    if broadcast:
        dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def _load_group_settings(optimizer: torch.optim.Optimizer, state: Any, broadcast: bool) -> None:
    groups = [state.get("param_groups") if isinstance(state, dict) else None]
    if broadcast:
        dist.broadcast_object_list(groups, src=0)
    saved = groups[0]
    if saved is None or len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"the saved optimizer state has {0 if saved is None else len(saved)} parameter groups, the optimizer "
            f"{len(optimizer.param_groups)}: was it saved with the same optimizer?"
        )
    for group, settings in zip(optimizer.param_groups, saved, strict=True):
        group.update({k: v for k, v in settings.items() if k != "params"})


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under an `AcceleratedOptimizer` (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _model_of(optimizer: Any, models: Sequence[nn.Module]) -> nn.Module:
    inner = getattr(optimizer, "optimizer", optimizer)
    ids = {id(p) for group in inner.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in ids for p in model.parameters()):
            return model
    raise ValueError("save_state/load_state with FSDP: an optimizer holds parameters of no prepared model")


def _existing(folder: str) -> str:
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"no distributed checkpoint folder {folder}: was the checkpoint saved with state_dict_type "
            "SHARDED_STATE_DICT and the same models and optimizers prepared in the same order?"
        )
    return folder


def _read(path: str) -> Any:
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no {path}: was the checkpoint saved with state_dict_type FULL_STATE_DICT and the same models and "
            "optimizers prepared in the same order?"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def _ignored_parameters(modules: Any, model: nn.Module, device: torch.device) -> set[nn.Parameter]:
    """The parameters of `modules`: modules, or a regular expression their names match whole (`ignored_modules`)."""
    import re

    if isinstance(modules, str):
        pattern = re.compile(modules)
        modules = [m for name, m in model.named_modules() if pattern.fullmatch(name)]
        if not modules:
            raise ValueError(f"ignored_modules={pattern.pattern!r} matches no module name of {type(model).__name__}")
    chosen = list(modules)
    for module in chosen:
        module.to(device)
    return {p for module in chosen for p in module.parameters()}


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    names = get_non_persistent_buffers(model, recurse=True, fqns=True)
    return copy.deepcopy({n: b for n, b in model.named_buffers() if n in names})


def _retie(model: nn.Module) -> None:
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def _final_norm(model: nn.Module) -> nn.Module | None:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    if not isinstance(base, nn.Module):
        return None
    found = None
    for _, module in base.named_children():
        if "Norm" in type(module).__name__:
            found = module
    return found


def _apply_activation_checkpointing(
    model: nn.Module, predicate: Callable[[nn.Module], bool] | None, offload: bool
) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    if predicate is None:
        raise ValueError(
            "activation_checkpointing with FSDP2 recomputes the layers the auto-wrap policy picks, and the plugin has "
            "none: set auto_wrap_policy='transformer_based_wrap' (with transformer_cls_names_to_wrap) or "
            "'size_based_wrap'"
        )
    for name, layer in modules_bottom_up(model, return_fqns=True)[:-1]:
        if predicate(layer):
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
            model.set_submodule(name, offload_wrapper(wrapped) if offload else wrapped)
    return model


def _load_full_state_from_rank0(
    model: nn.Module, full_state: dict[str, Any], device: torch.device, offload: Any
) -> None:
    """Give the sharded (meta) `model` rank 0's `full_state`: each tensor broadcast, then sharded as the model is."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.tensor import DTensor, distribute_tensor

    to_cpu = isinstance(offload, CPUOffloadPolicy)
    main = dist.get_rank() == 0
    sharded: dict[str, Any] = {}
    for name, empty in model.state_dict().items():
        mesh = empty.device_mesh if isinstance(empty, DTensor) else None
        if main:
            if name not in full_state:
                raise KeyError(f"cpu_ram_efficient_loading: {name} is in the sharded model but not in rank 0's weights")
            tensor = full_state[name].detach().to(device)
            if isinstance(tensor, DTensor):
                tensor = tensor.to_local()
        else:
            tensor = torch.empty(empty.shape, dtype=empty.dtype, device=device)
        dist.broadcast(tensor, src=0)
        value = distribute_tensor(tensor, mesh, empty.placements) if mesh is not None else tensor
        if empty.dtype.is_floating_point:
            value = value.to(empty.dtype)
        sharded[name] = value.to("cpu") if to_cpu else value
    model.load_state_dict(sharded, assign=True)


__all__ = ["FSDP2Strategy", "strategy_for", "auto_wrap_predicate", "modules_bottom_up", "check_version"]
