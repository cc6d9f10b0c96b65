"""`torch.use_deterministic_algorithms(True)` on simulated GPUs: the CUDA kernels that have no deterministic
implementation refuse (or, with `warn_only=True`, warn), as on the card.

A simulated GPU computes with the host's kernels, which are deterministic where CUDA's are
not (atomic adds in pooling and upsampling backwards, scans, histograms...), so without this
a test suite that turns determinism on passes here and fails on its first GPU run. The ops
and conditions are those whose CUDA kernels call `Context::alertNotDeterministic` in this
torch (aten/src/ATen/native/cuda), with torch's caller names and message. Ops whose CPU
kernels alert too (`max_unpool2d/3d`, `put_` without accumulation) alert by themselves;
those torch reroutes in deterministic mode before they reach a kernel (scatter and
scatter_add, `F.interpolate`'s linear modes, `F.pad`'s replicate mode) are rerouted here too,
by torch's own Python. cuBLAS needs no `CUBLAS_WORKSPACE_CONFIG` in this torch (the check was
removed in 2.10), so matmuls pass, as on the card.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from accel.sim.core import torch_internals

aten = torch.ops.aten


def _always(args: tuple, kwargs: dict) -> bool:
    return True


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _floating(args: tuple, kwargs: dict) -> bool:
    return args[0].is_floating_point() or args[0].is_complex()


def _product(args: tuple, kwargs: dict) -> bool:
    return _arg(args, kwargs, 4, "reduce") == "prod"


def _accumulating(args: tuple, kwargs: dict) -> bool:
    return bool(_arg(args, kwargs, 3, "accumulate", False))


#: aten op -> (the CUDA kernel's caller name in torch's message, when it alerts)
_ALERTS: dict[Any, tuple[str, Any]] = {
    aten._adaptive_avg_pool2d_backward.default: ("adaptive_avg_pool2d_backward_cuda", _always),
    aten._adaptive_avg_pool3d_backward.default: ("adaptive_avg_pool3d_backward_cuda", _always),
    aten.adaptive_max_pool2d_backward.default: ("adaptive_max_pool2d_backward_cuda", _always),
    aten.avg_pool3d_backward.default: ("avg_pool3d_backward_cuda", _always),
    aten.max_pool3d_with_indices_backward.default: ("max_pool3d_with_indices_backward_cuda", _always),
    aten.fractional_max_pool2d_backward.default: ("fractional_max_pool2d_backward_cuda", _always),
    aten.fractional_max_pool3d_backward.default: ("fractional_max_pool3d_backward_cuda", _always),
    aten.upsample_linear1d_backward.default: ("upsample_linear1d_backward_out_cuda", _always),
    aten.upsample_bilinear2d_backward.default: ("upsample_bilinear2d_backward_out_cuda", _always),
    aten._upsample_bilinear2d_aa_backward.default: ("upsample_bilinear2d_aa_backward_out_cuda", _always),
    aten.upsample_bicubic2d_backward.default: ("upsample_bicubic2d_backward_out_cuda", _always),
    aten._upsample_bicubic2d_aa_backward.default: ("upsample_bicubic2d_aa_backward_out_cuda", _always),
    aten.upsample_trilinear3d_backward.default: ("upsample_trilinear3d_backward_out_cuda", _always),
    aten.reflection_pad1d_backward.default: ("reflection_pad1d_backward_out_cuda", _always),
    aten.reflection_pad2d_backward.default: ("reflection_pad2d_backward_cuda", _always),
    aten.reflection_pad3d_backward.default: ("reflection_pad3d_backward_out_cuda", _always),
    aten.replication_pad1d_backward.default: ("replication_pad1d_backward_cuda", _always),
    aten.replication_pad2d_backward.default: ("replication_pad2d_backward_cuda", _always),
    aten.replication_pad3d_backward.default: ("replication_pad3d_backward_cuda", _always),
    aten.nll_loss2d_forward.default: (
        "nll_loss2d_forward_out_cuda_template",
        lambda args, kwargs: _arg(args, kwargs, 3, "reduction", 1) != 0,  # not reduction="none"
    ),
    aten._ctc_loss_backward.default: ("ctc_loss_backward_gpu", _always),
    aten._embedding_bag_dense_backward.default: (
        "embedding_bag_backward_cuda_max",
        lambda args, kwargs: _arg(args, kwargs, 7, "mode") == 2,  # mode="max"
    ),
    aten.histc.default: ("_histc_cuda with floating point input", _floating),
    aten.bincount.default: ("_bincount_cuda", lambda args, kwargs: _arg(args, kwargs, 1, "weights") is not None),
    aten.kthvalue.default: ("kthvalue CUDA", _always),
    aten.median.dim: ("median CUDA with indices output", _always),
    aten.nanmedian.dim: ("median CUDA with indices output", _always),
    aten.grid_sampler_2d_backward.default: ("grid_sampler_2d_backward_cuda", _always),
    aten.grid_sampler_3d_backward.default: ("grid_sampler_3d_backward_cuda", _always),
    aten.cumsum.default: ("cumsum_cuda_kernel", _floating),
    aten.cumsum_.default: ("cumsum_cuda_kernel", _floating),
    aten.scatter_reduce.two: ("scatter_reduce_cuda_prod_", _product),
    aten.scatter_reduce_.two: ("scatter_reduce_cuda_prod_", _product),
    aten.index_reduce.default: ("index_reduce_cuda", _always),
    aten.index_reduce_.default: ("index_reduce_cuda", _always),
    aten.put_.default: ("put_", _accumulating),
    aten.put.default: ("put_", _accumulating),
}


def alert(caller: str) -> None:
    """`Context::alertNotDeterministic(caller)`: raise, or warn under `warn_only=True`, while determinism is on."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(
            f"{caller} does not have a deterministic implementation, but you set "
            "'torch.use_deterministic_algorithms(True, warn_only=True)'. You can file an issue at "
            "https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic support for this "
            "operation.",
            UserWarning,
            stacklevel=3,
        )
        return
    error = RuntimeError(
        f"{caller} does not have a deterministic implementation, but you set "
        "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, or you can "
        "use the 'warn_only=True' option, if that's acceptable for your application. You can also file an issue at "
        "https://github.com/pytorch/pytorch/issues to help us prioritize adding deterministic support for this "
        "operation."
    )
    if not torch_internals.in_backward():
        raise error
    # Raised inside the autograd engine, the error would abort the process (`torch_internals.in_backward`): the
    # rest of backward runs, and the error is raised as backward returns (`raise_pending`), as out-of-memory is.
    if not _pending:
        _pending.append(error)


#: the error met inside the backward that is running, raised when it returns
_pending: list[RuntimeError] = []


def raise_pending() -> None:
    """Raise the error an op of the backward that just returned met, if any."""
    if _pending:
        error = _pending.pop()
        try:
            raise error
        finally:
            del error  # (no frame of the backward kept alive through the traceback)


def checks() -> dict[Any, Any]:
    """op -> `check(args, kwargs)`, run before the op: the alert of its CUDA kernel, while determinism is on."""

    def check(caller: str, condition: Any) -> Any:
        def run(args: tuple, kwargs: dict) -> None:
            if torch.are_deterministic_algorithms_enabled() and condition(args, kwargs):
                alert(caller)

        return run

    return {func: check(caller, condition) for func, (caller, condition) in _ALERTS.items()}
