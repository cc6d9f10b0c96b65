"""`torch.compile` in a simulated rank: Dynamo traces the simulated tensors, the graphs run eagerly.

A real GPU compiles at the first call of a compiled function, and only then: Dynamo turns
the Python bytecode into graphs (breaking the graph where it cannot trace, recompiling when
a guard fails, raising under `fullgraph=True`), and a backend (Inductor by default) writes
kernels for the card. Here Dynamo runs as it does there, over the simulated tensors (which
are traceable wrapper subclasses, as DTensor is), so graph breaks, recompilations,
`fullgraph=True` errors and `torch.compiler` helpers behave as on the GPU; the backend is
Dynamo's own "eager" one, which runs each captured graph op by op on the simulated device.
Inductor and the other code generators write Triton or C++ for a real device and are not
used: `backend=`/`mode=`/`options=` are accepted and set aside, and one line on stderr says
so, once per process. A backend given as a callable (the user's own) is kept: it receives
the graph and the simulated example inputs as on a GPU.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from accel.sim.core import compiled_buffers, torch_internals, wrapper

#: the backend every named backend becomes: Dynamo's graphs run op by op on the simulated tensors
EAGER_BACKEND = "eager"

_said: list[bool] = []
#: [True] once `install` was given a memory model for Inductor's regions
_models_inductor: list[bool] = []
#: the first backend a `torch.compile` call named (what the one line on stderr reports)
_asked: list[Any] = []


def install(
    wrapper_classes: tuple[type, ...],
    pause: Callable[[], None] = lambda: None,
    resume: Callable[[], None] = lambda: None,
    buffers: compiled_buffers.Runtime | None = None,
) -> None:
    """Make `torch.compile` (and `nn.Module.compile`, which calls it) trace with Dynamo and run eagerly.

    `pause()` / `resume()` run as Dynamo starts and ends compiling (a device that counts its
    memory stops counting: tracing runs on fake tensors). With `buffers` (a device that counts
    memory), regions compiled for Inductor are counted as its kernels hold memory
    (`accel.sim.core.compiled_buffers`). Idempotent; nothing is imported or compiled until a
    compiled function is first called.
    """
    if getattr(torch.compile, "_accel_sim_original", None) is not None:
        return
    for cls in wrapper_classes:
        torch_internals.describe_wrappers_for_tracing(cls)
        torch_internals.run_flex_attention_on(cls, functools.partial(_on_inner, cls))
        torch_internals.trace_flex_attention_gradients_on_host(cls, wrapper.unwrap)
        torch_internals.adopt_dynamos_values(functools.partial(wrapper._adopt_fakes, cls))
    torch_internals.keep_dynamo_out_of("accel.sim")
    torch_internals.ask_python_for_dynamos_current_stream()  # torch 2.15 asks C++, which knows the hidden device
    torch_internals.around_dynamo_compiles(lambda: _starts(pause), lambda: _ends(resume))
    if buffers is not None:
        _models_inductor.append(True)
    inductor = compiled_buffers.backend(wrapper_classes[0], buffers) if buffers is not None else EAGER_BACKEND
    torch.compile = _eager_compile(torch.compile, inductor)  # same call, simulated ranks only
    torch.export.export = _tracing_export(torch.export.export, pause, resume)  # simulated ranks only


def _tracing_export(original: Callable[..., Any], pause: Callable[[], None], resume: Callable[[], None]) -> Any:
    """`torch.export.export` as Dynamo's compiles: it traces on fake tensors (strict or not), which take no GPU
    memory and launch no kernel (the pipelining API exports each model it splits)."""

    @functools.wraps(original)
    def export(*args: Any, **kwargs: Any) -> Any:
        if wrapper.is_tracing():
            return original(*args, **kwargs)
        wrapper.tracing(True)
        pause()
        try:
            return original(*args, **kwargs)
        finally:
            wrapper.tracing(False)
            resume()

    return export


def _on_inner(cls: type[wrapper.WrapperTensor], op: Any, *args: Any, **kwargs: Any) -> Any:
    """Higher-order op `op` on the host tensors under `cls`'s, its tensor results back on the first one's device.

    A host tensor stands for a wrapper that needs gradients with an alias that needs them too:
    flex attention's backward computes the gradients of `score_mod`'s captured tensors only
    for those that need them. While Dynamo traces, the results are fake tensors, wrapped too:
    the ops after flex attention in the same graph take them for simulated tensors.
    Its callables (`score_mod`, `mask_mod`, their graphs) run on the host tensors too: the
    devices Dynamo wrote into them (`noop_mask`'s `new_ones(..., device=cuda:k)`, the mask
    of a call without `block_mask`) are the host's (`_HostFactories`).
    """
    from torch.utils._pytree import tree_map

    tensors = [a for a in args if isinstance(a, cls)]
    device = tensors[0].device  # the query's (flex attention's first argument)
    inner = tree_map(
        lambda a: _host(a) if isinstance(a, cls) else _on_host(cls, a) if callable(a) else a, (args, kwargs)
    )
    out = op(*inner[0], **inner[1])
    return tree_map(lambda t: wrapper.wrap(cls, t, device) if _host_result(t) else t, out)


class _HostFactories(torch.overrides.TorchFunctionMode):
    """Tensors made on `cls`'s device (`device=` naming it) are made on the host."""

    def __init__(self, cls: type[wrapper.WrapperTensor]) -> None:
        super().__init__()
        self.cls = cls

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.cls._sim.is_mine(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        return func(*args, **kwargs)


def _on_host(cls: type[wrapper.WrapperTensor], function: Callable[..., Any]) -> Callable[..., Any]:
    def on_host(*args: Any) -> Any:
        with _HostFactories(cls):
            return function(*args)

    return on_host


def _host_result(value: Any) -> bool:
    return type(value) is torch.Tensor or (isinstance(value, torch.Tensor) and torch_internals.is_fake(value))


def _host(tensor: torch.Tensor) -> torch.Tensor:
    inner = wrapper.unwrap(tensor)
    return inner.detach().requires_grad_() if tensor.requires_grad else inner


def _starts(pause: Callable[[], None]) -> None:
    _say_once(_asked[0] if _asked else "inductor")  # at the first compile, not at decoration
    wrapper.tracing(True)
    pause()


def _ends(resume: Callable[[], None]) -> None:
    wrapper.tracing(False)
    resume()


def _eager_compile(original: Callable[..., Any], inductor: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", "inductor")
        if not callable(backend) or isinstance(backend, str):
            kwargs = {**kwargs, "backend": inductor if backend == "inductor" else EAGER_BACKEND}
            kwargs.pop("mode", None)
            kwargs.pop("options", None)
            if not _asked:
                _asked.append(backend)
        if model is None:
            return original(**kwargs)
        return original(model, **kwargs)

    compile._accel_sim_original = original  # type: ignore[attr-defined]
    return compile


def _say_once(backend: Any) -> None:
    if _said:
        return
    _said.append(True)
    print(
        "accel.sim: torch.compile traces with Dynamo as on the real device (graph breaks, recompilations and "
        f"fullgraph errors included); its graphs run eagerly on the simulated device, not through backend "
        f"{backend!r}, whose code is written for real hardware"
        + (
            "; their memory is counted as Inductor's kernels hold it (what its partitioner saves for backward; "
            "intermediates it fuses take none)"
            if backend == "inductor" and _models_inductor
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
