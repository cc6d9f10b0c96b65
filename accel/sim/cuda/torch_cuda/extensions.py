"""CUDA extensions built at first use (`torch.utils.cpp_extension.load`) in a simulated GPU rank.

Frameworks compile some CUDA kernels just in time, the first time they are needed:
DeepSpeed's op builders do for the fused optimizers of its default configs (FusedAdam for
"Adam" / "AdamW", FusedLamb, FusedLion), through `torch.utils.cpp_extension.load`. A
simulated GPU can neither compile nor run CUDA code, so in a simulated rank `load` and
`load_inline` look at what they are asked to build:

* a CPU extension (no CUDA sources, `with_cuda` not set) builds as on any host;
* a CUDA extension with a stand-in (`STAND_INS`) gives a module whose functions compute
  the kernel's math in torch ops (`accel.sim.cuda.kernels.extension`), with the kernel's
  name, arguments and checks: `FusedAdam` then steps as `torch.optim.AdamW` (or `Adam`
  with L2 decay) does, to float rounding;
* any other CUDA extension fails at once with `SimulatedDeviceError`, naming it and, for
  the ones DeepSpeed's features build, the config switch that avoids it (`AVOID`), before
  anything is written to the extensions directory (a failed build there would leave a
  half-built extension that later runs trip over).

A stand-in is chosen by the extension's name and the file names of its sources, so that
another framework's extension of the same name is not mistaken for it. DeepSpeed builders
check for the CUDA toolkit (`CUDA_HOME`, `nvcc -V`) before calling `load`; for kernels
without a stand-in that check would fail first with "CUDA_HOME does not exist", so the
same decision is taken when a DeepSpeed builder starts (`_check_deepspeed_builds`).

Installed once per simulated GPU rank (`accel.sim.cuda.fake.install`); the patches are
made when the modules are imported.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
from collections.abc import Callable, Iterable
from typing import Any

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus.errors import SimulatedDeviceError
from accel.sim.cuda.kernels import extension as kernels

#: file name endings that make an extension a CUDA one when `with_cuda` is not given (torch's rule)
_CUDA_SUFFIXES = (".cu", ".cuh")


@dataclasses.dataclass(frozen=True)
class StandIn:
    """A CUDA extension a simulated GPU runs in torch ops instead of compiling it."""

    name: str  # the extension's name, as given to `load`
    sources: frozenset[str]  # file names among its sources that tell this kernel from another of that name
    functions: dict[str, Callable[..., Any]]  # the module's functions
    what: str  # who builds it, for the module's doc


STAND_INS: dict[str, StandIn] = {
    stand_in.name: stand_in
    for stand_in in (
        StandIn(
            "fused_adam",
            frozenset({"multi_tensor_adam.cu"}),
            {"multi_tensor_adam": kernels.multi_tensor_adam},
            "DeepSpeed's FusedAdam (deepspeed.ops.adam.FusedAdam, its optimizer for Adam and AdamW configs)",
        ),
        StandIn(
            "fused_lamb",
            frozenset({"fused_lamb_cuda_kernel.cu"}),
            {"lamb": kernels.lamb},
            "DeepSpeed's FusedLamb (deepspeed.ops.lamb.FusedLamb, its optimizer for Lamb configs)",
        ),
        StandIn(
            "fused_lion",
            frozenset({"multi_tensor_lion.cu"}),
            {"multi_tensor_lion": kernels.multi_tensor_lion},
            "DeepSpeed's FusedLion (deepspeed.ops.lion.FusedLion, its optimizer for Lion configs)",
        ),
    )
}

_INFERENCE = "DeepSpeed inference kernels: deepspeed.init_inference(..., replace_with_kernel_inject=False)"
_TRANSFORMER = "DeepSpeed's fused transformer layer: the model's own layers, not DeepSpeedTransformerLayer"

#: extension name -> what avoids building it (DeepSpeed's CUDA builds that its features start)
AVOID: dict[str, str] = {
    "fused_adam": 'DeepSpeed\'s FusedAdam: "optimizer": {"type": "AdamW", "params": {"torch_adam": true, ...}}',
    "fused_lamb": 'DeepSpeed\'s FusedLamb: an "Adam" or "AdamW" optimizer instead of "Lamb"',
    "quantizer": (
        'DeepSpeed ZeRO++ quantization: "zero_optimization": {"zero_quantized_weights": false, '
        '"zero_quantized_gradients": false}'
    ),
    "transformer": _TRANSFORMER,
    "stochastic_transformer": _TRANSFORMER,
    "transformer_inference": _INFERENCE,
    "spatial_inference": _INFERENCE,
    "inference_core_ops": _INFERENCE,
    "cutlass_ops": _INFERENCE,
    "ragged_device_ops": "DeepSpeed-FastGen (inference v2) kernels: run inference with plain torch modules",
    "ragged_ops": "DeepSpeed-FastGen (inference v2) kernels: run inference with plain torch modules",
    "random_ltd": 'DeepSpeed random-LTD: "data_efficiency": {"data_routing": {"random_ltd": {"enabled": false}}}',
    "fp_quantizer": "DeepSpeed's FP quantizer: deepspeed.linear.OptimizedLinear without a quantization_config",
    "evoformer_attn": "DeepSpeed's DS4Sci_EvoformerAttention: a torch attention",
    "dc": 'DeepSpeed DeepCompile: "compile": {"deepcompile": false}',
}


def builds_cuda(sources: Iterable[str], with_cuda: bool | None) -> bool:
    """Whether torch builds an extension of `sources` with CUDA (`with_cuda`, else: a .cu/.cuh source)."""
    if with_cuda is not None:
        return bool(with_cuda)
    return any(str(source).endswith(_CUDA_SUFFIXES) for source in sources)


def find_stand_in(name: str, sources: Iterable[str]) -> StandIn | None:
    """The stand-in for CUDA extension `name` built from `sources` (paths or file names), or None."""
    known = STAND_INS.get(name)
    files = {os.path.basename(str(source)) for source in sources}
    return known if known is not None and known.sources <= files else None


@functools.cache
def stand_in_module(name: str) -> types.ModuleType:
    """The module `load` returns for stand-in `name` (one per rank, as an extension is loaded once)."""
    stand_in = STAND_INS[name]
    module = types.ModuleType(name, f"Simulated GPU stand-in for the CUDA extension of {stand_in.what}.")
    for function_name, function in stand_in.functions.items():
        setattr(module, function_name, function)
    return module


def unsupported(name: str, sources: Iterable[str], builder: str) -> Exception:
    """The `SimulatedDeviceError` for CUDA extension `name`, which has no stand-in; `builder` names who builds it."""

    files = ", ".join(sorted({os.path.basename(str(source)) for source in sources})) or "inline sources"
    avoid = AVOID.get(name)
    remedy = f"To run without it: {avoid}." if avoid else "Turn off the feature that builds it, or run on a real GPU."
    return SimulatedDeviceError(
        f"the CUDA extension {name!r} ({files}), built by {builder}, is not available on a simulated GPU: "
        "its kernels are CUDA code for a real GPU, and the simulator has no stand-in in torch ops for them "
        f"(it has for: {', '.join(sorted(STAND_INS))}). Nothing was built or written. {remedy}"
    )


def _resolve(name: str, sources: Iterable[str], builder: str) -> types.ModuleType:
    """The stand-in module for CUDA extension `name`, or its `SimulatedDeviceError` (before anything is written)."""
    sources = list(sources)
    stand_in = find_stand_in(name, sources)
    if stand_in is None:
        raise unsupported(name, sources, builder)
    return stand_in_module(stand_in.name)


def _simulated_load(original: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.utils.cpp_extension.load`: CPU extensions built by torch; CUDA ones stand-ins, or refused."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        sources = arguments["sources"]
        sources = [sources] if isinstance(sources, str) else list(sources)
        if not builds_cuda(sources, arguments.get("with_cuda")):
            return original(*args, **kwargs)
        return _resolve(arguments["name"], sources, "torch.utils.cpp_extension.load")

    load._accel_sim = True  # type: ignore[attr-defined]
    return load


def _simulated_load_inline(original: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.utils.cpp_extension.load_inline`: CUDA sources (or `with_cuda=True`) are refused at once."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_inline(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        cuda = arguments.get("with_cuda")
        if cuda is None:
            cuda = bool(arguments.get("cuda_sources"))
        if not cuda:
            return original(*args, **kwargs)
        raise unsupported(arguments["name"], [], "torch.utils.cpp_extension.load_inline")

    load_inline._accel_sim = True  # type: ignore[attr-defined]
    return load_inline


def _patch_cpp_extension(cpp_extension: Any) -> None:
    """Replace `load` and `load_inline` of `torch.utils.cpp_extension` (once)."""
    if getattr(cpp_extension.load, "_accel_sim", False):
        return
    cpp_extension.load = _simulated_load(cpp_extension.load)
    cpp_extension.load_inline = _simulated_load_inline(cpp_extension.load_inline)


def _check_deepspeed_builds(builder_module: Any) -> None:
    """DeepSpeed's CUDA op builders refuse a kernel without a stand-in before they look for the CUDA toolkit.

    `CUDAOpBuilder.jit_load` reads `CUDA_HOME` and runs `nvcc -V` for most kernels before it
    calls `torch.utils.cpp_extension.load`; a kernel the simulator cannot run would fail
    there with "CUDA_HOME does not exist". Kernels with a stand-in go on to `load` unchanged.
    """
    builder_class: Any = getattr(builder_module, "CUDAOpBuilder", None)
    original = getattr(builder_class, "jit_load", None)
    if original is None or getattr(original, "_accel_sim", False):
        return  # not DeepSpeed's builders, or patched already

    @functools.wraps(original)
    def jit_load(self: Any, verbose: bool = True) -> Any:
        sources = self.sources()
        if find_stand_in(self.name, sources) is None:
            raise unsupported(self.name, sources, f"DeepSpeed's {type(self).__name__}")
        return original(self, verbose)

    jit_load._accel_sim = True  # type: ignore[attr-defined]
    builder_class.jit_load = jit_load


def _refuse_triton_launches(jit: Any) -> None:
    """A hand-written Triton kernel launched on simulated GPU tensors fails at its launch, naming the kernel.

    Triton compiles the kernel for the card its driver finds; there is none here, and the
    kernel's code is the card's. Code that only imports Triton (torchtitan's MoE kernels do)
    or launches it on CPU tensors is left alone.
    """
    original = getattr(jit.JITFunction, "run", None)
    if original is None or getattr(original, "_accel_sim", False):
        return

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        from accel.sim.cuda.tensors.cuda_tensor import is_simulated_cuda

        if any(is_simulated_cuda(value) for value in (*args, *kwargs.values())):
            name = getattr(getattr(self, "fn", None), "__qualname__", repr(self))
            raise SimulatedDeviceError(
                f"the Triton kernel {name!r} is not available on a simulated GPU: Triton compiles it for a real GPU. "
                "Call the framework's eager (torch) path for it on simulated GPUs, or run on a real GPU."
            )
        return original(self, *args, **kwargs)

    run._accel_sim = True  # type: ignore[attr-defined]
    jit.JITFunction.run = run


def install() -> None:
    """JIT-built CUDA extensions get stand-ins or fail at once, in torch and in DeepSpeed's builders."""
    torch_internals.after_import("torch.utils.cpp_extension", _patch_cpp_extension)
    torch_internals.after_import("triton.runtime.jit", _refuse_triton_launches)
    # DeepSpeed's builders live in `op_builder` in a source checkout installed for development
    for module in ("deepspeed.ops.op_builder.builder", "op_builder.builder"):
        torch_internals.after_import(module, _check_deepspeed_builds)
