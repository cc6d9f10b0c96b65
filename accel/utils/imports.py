"""`is_*_available`: what this machine and this Python environment offer, asked at call time.

Accelerate's names, each answering for the process that calls it: inside a simulated GPU
rank `is_cuda_available()` is true because `torch.cuda.is_available()` says so there, and
inside a simulated TPU rank `is_torch_xla_available()` is true because the stand-in
`torch_xla` is importable. Nothing is cached, for that reason (the questions are cheap).
Packages are looked up without being imported, so asking does not slow start-up down.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from typing import Any

from accel.utils.environment import env_flag


def _installed(module: str, distribution: str | None = None) -> bool:
    """Whether `module` can be imported and comes from an installed distribution (not a stray folder)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):
        return False
    try:
        importlib.metadata.version(distribution or module)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _at_least(distribution: str, minimum: str) -> bool:
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return _version_tuple(found) >= _version_tuple(minimum)


def _torch() -> Any:
    import torch

    return torch


def _torch_at_least(minimum: str) -> bool:
    return _version_tuple(_torch().__version__) >= _version_tuple(minimum)


def _device_module_available(name: str, check_device: bool) -> bool:
    """`torch.<name>.is_available()` for out-of-tree device modules (npu, mlu, musa, sdaa, neuron)."""
    module = getattr(_torch(), name, None)
    if module is None:
        return False
    try:
        if check_device:
            module.device_count()  # raises where the driver finds no device
        return bool(module.is_available())
    except RuntimeError:
        return False


def _extension_device_available(extension: str, name: str, check_device: bool = False) -> bool:
    if importlib.util.find_spec(extension) is None:
        return False
    try:
        importlib.import_module(extension)
    except Exception:  # a device extension that cannot load (e.g. no driver) means no such device
        return False
    return _device_module_available(name, check_device)


# -- devices ----------------------------------------------------------------------------


def is_cuda_available() -> bool:
    """Whether a CUDA (or simulated CUDA) device is usable, asked without initialising CUDA when possible."""
    torch = _torch()
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # answer through NVML, leaving CUDA uninitialised for forks
    try:
        return bool(torch.cuda.is_available())
    finally:
        if previous is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous


def is_rocm_available() -> bool:
    """Whether torch was built for ROCm (AMD GPUs) and one is usable."""
    torch = _torch()
    return torch.version.hip is not None and bool(torch.cuda.is_available())


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether `torch_xla` (real, or the simulator's stand-in) is importable; optionally whether it drives a TPU/GPU.

    `USE_TORCH_XLA=0` makes it answer False, as in Accelerate, to train without XLA where it is installed.
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("is_torch_xla_available: check_is_tpu and check_is_gpu cannot both be true")
    if not env_flag("USE_TORCH_XLA", default=True):
        return False
    try:
        if importlib.util.find_spec("torch_xla") is None:
            return False
        import torch_xla.runtime as xr
    except ImportError:
        return False
    if check_is_gpu:
        return xr.device_type() in ("GPU", "CUDA")
    if check_is_tpu:
        return xr.device_type() == "TPU"
    return True


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's Metal (MPS) device is usable with torch at least `min_version`."""
    torch = _torch()
    return _torch_at_least(min_version) and torch.backends.mps.is_available() and torch.backends.mps.is_built()


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether an Intel XPU is usable through torch's own `torch.xpu`."""
    if not _torch_at_least("2.7"):
        return False
    return _device_module_available("xpu", check_device)


def is_npu_available(check_device: bool = False) -> bool:
    """Whether an Ascend NPU is usable (`torch_npu`)."""
    return _extension_device_available("torch_npu", "npu", check_device)


def is_mlu_available(check_device: bool = False) -> bool:
    """Whether a Cambricon MLU is usable (`torch_mlu`)."""
    return _extension_device_available("torch_mlu", "mlu", check_device)


def is_musa_available(check_device: bool = False) -> bool:
    """Whether a Moore Threads MUSA GPU is usable (`torch_musa`)."""
    return _extension_device_available("torch_musa", "musa", check_device)


def is_sdaa_available(check_device: bool = False) -> bool:
    """Whether a Tecorigin SDAA device is usable (`torch_sdaa`)."""
    return _extension_device_available("torch_sdaa", "sdaa", check_device)


def is_neuron_available(check_device: bool = False) -> bool:
    """Whether an AWS Neuron device is usable (`torch_neuronx`)."""
    return _extension_device_available("torch_neuronx", "neuron", check_device)


def is_hpu_available(init_hccl: bool = False) -> bool:
    """Whether an Intel Gaudi HPU is usable (`habana_frameworks.torch`); `init_hccl` also loads its collectives."""
    try:
        if (
            importlib.util.find_spec("habana_frameworks") is None
            or importlib.util.find_spec("habana_frameworks.torch") is None
        ):
            return False
        importlib.import_module("habana_frameworks.torch")
        if init_hccl:
            importlib.import_module("habana_frameworks.torch.distributed.hccl")
    except Exception:  # an HPU stack that cannot load means no HPU
        return False
    return _device_module_available("hpu", False)


def is_xccl_available() -> bool:
    """Whether torch.distributed has the XCCL backend (Intel GPUs)."""
    from torch.distributed import distributed_c10d

    check = getattr(distributed_c10d, "is_xccl_available", None)
    return bool(check()) if callable(check) else False


# -- numeric formats -----------------------------------------------------------------------


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether bfloat16 compute is supported here (on a TPU: unless `ignore_tpu`)."""
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    torch = _torch()
    if is_cuda_available():
        return bool(torch.cuda.is_bf16_supported())
    if is_xpu_available():
        return bool(torch.xpu.is_bf16_supported())
    if is_mps_available():
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return True


def is_fp16_available() -> bool:
    """Whether float16 compute is supported (everywhere but first-generation Gaudi)."""
    if is_hpu_available():
        try:
            import habana_frameworks.torch.utils.experimental as htexp

            return htexp._get_device_type() != htexp.synDeviceType.synDeviceGaudi
        except Exception:
            return True
    return True


def is_fp8_available() -> bool:
    """Whether an fp8 training library (MS-AMP, Transformer Engine or torchao) is installed."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_weights_only_available() -> bool:
    """Whether `torch.load(weights_only=True)` accepts an allow-list of globals (torch 2.4 and later)."""
    return _torch_at_least("2.4.0")


def is_pippy_available() -> bool:
    """Whether torch ships pipeline parallelism (`torch.distributed.pipelining`, torch 2.4 and later)."""
    return _torch_at_least("2.4.0")


# -- optional packages --------------------------------------------------------------------


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (accel does not run it; see DistributedType.DEEPSPEED)."""
    return _installed("deepspeed")


def is_megatron_lm_available() -> bool:
    """Whether Megatron-LM is installed and asked for (`ACCELERATE_USE_MEGATRON_LM`); accel does not run it."""
    if not env_flag("ACCELERATE_USE_MEGATRON_LM", default=False) or importlib.util.find_spec("megatron") is None:
        return False
    return _at_least("megatron-core", "0.8.0") and importlib.util.find_spec("megatron.training") is not None


def is_transformer_engine_available() -> bool:
    """Whether NVIDIA (or, on Gaudi, Intel) Transformer Engine is installed."""
    if is_hpu_available():
        return _installed("intel_transformer_engine", "intel-transformer-engine")
    return _installed("transformer_engine", "transformer-engine")


def is_transformer_engine_mxfp8_available() -> bool:
    """Whether Transformer Engine is installed and this GPU supports its MXFP8 format."""
    if not _installed("transformer_engine", "transformer-engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support

    return bool(check_mxfp8_support()[0])


def is_bnb_available(min_version: str | None = None) -> bool:
    """Whether bitsandbytes is installed (at least `min_version` when given)."""
    if not _installed("bitsandbytes"):
        return False
    return min_version is None or _at_least("bitsandbytes", min_version)


def is_4bit_bnb_available() -> bool:
    """Whether bitsandbytes supports 4-bit weights (0.39.0 and later)."""
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available() -> bool:
    """Whether bitsandbytes supports 8-bit weights (0.37.2 and later)."""
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available() -> bool:
    """Whether the installed bitsandbytes has its multi-backend (non-CUDA) support."""
    if not is_bnb_available():
        return False
    import bitsandbytes

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_msamp_available() -> bool:
    """Whether MS-AMP (fp8) is installed."""
    return _installed("msamp", "ms-amp")


def is_torchao_available() -> bool:
    """Whether torchao is installed."""
    return _installed("torchao")


def is_torchdata_available() -> bool:
    """Whether torchdata is installed."""
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available() -> bool:
    """Whether torchdata has `StatefulDataLoader` (0.8.0 and later)."""
    return _installed("torchdata") and _at_least("torchdata", "0.8.0")


def is_rich_available() -> bool:
    """Whether rich is installed and its tracebacks asked for (`ACCELERATE_ENABLE_RICH`, as in Accelerate)."""
    return _installed("rich") and env_flag("ACCELERATE_ENABLE_RICH", default=False)


def is_trackio_available() -> bool:
    """Whether trackio is installed (it needs Python 3.10 or later)."""
    return sys.version_info >= (3, 10) and _installed("trackio")


def is_tensorboard_available() -> bool:
    """Whether TensorBoard (or tensorboardX) is installed."""
    return _installed("tensorboard") or _installed("tensorboardX")


def is_pynvml_available() -> bool:
    """Whether NVIDIA's NVML bindings are installed (`pynvml` or `nvidia-ml-py`)."""
    return _installed("pynvml") or _installed("pynvml", "nvidia-ml-py")


def is_aim_available() -> bool:
    """Whether Aim (before 4.0, whose API Accelerate's tracker uses) is installed."""
    return _installed("aim") and not _at_least("aim", "4.0.0")


def is_mlflow_available() -> bool:
    """Whether MLflow (full or `mlflow-skinny`) is installed."""
    return _installed("mlflow") or _installed("mlflow", "mlflow-skinny")


def is_triton_available() -> bool:
    """Whether Triton is installed (its XPU build on Intel GPUs)."""
    if is_xpu_available():
        return _installed("triton", "triton-xpu")
    return _installed("triton")


def _package_check(module: str, distribution: str | None = None) -> Any:
    def check() -> bool:
        return _installed(module, distribution)

    check.__name__ = check.__qualname__ = f"is_{module.lower()}_available"
    check.__doc__ = f"Whether {distribution or module} is installed."
    return check


# Plain "is the package installed" questions, one per name Accelerate offers.
is_amdsmi_available = _package_check("amdsmi")
is_boto3_available = _package_check("boto3")
is_clearml_available = _package_check("clearml")
is_comet_ml_available = _package_check("comet_ml")
is_datasets_available = _package_check("datasets")
is_dvclive_available = _package_check("dvclive")
is_import_timer_available = _package_check("import_timer")
is_lomo_available = _package_check("lomo_optim")
is_matplotlib_available = _package_check("matplotlib")
is_pandas_available = _package_check("pandas")
is_peft_available = _package_check("peft")
is_pytest_available = _package_check("pytest")
is_sagemaker_available = _package_check("sagemaker")
is_schedulefree_available = _package_check("schedulefree")
is_swanlab_available = _package_check("swanlab")
is_timm_available = _package_check("timm")
is_torchvision_available = _package_check("torchvision")
is_transformers_available = _package_check("transformers")
is_wandb_available = _package_check("wandb")
is_tqdm_available = _package_check("tqdm")
