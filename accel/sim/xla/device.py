"""The simulated TPU core of a rank: XLA tensors held in CPU memory, built on the core's wrapper tensor.

Installed only inside a simulated TPU rank (`accel.sim.devices.prepare_rank("xla")`):
part of it (the hidden PrivateUse1 device `simxla` and its kernels) is process-wide and
cannot be undone. As under PJRT, each process drives one device, which it sees as
`xla:0` whatever its global ordinal.

* Tensors (`XlaTensor`): `device="xla"` factories, `.to(device)`, `module.to(device)`,
  `torch.tensor(..., device=)` give tensors on `xla:0` (`is_xla`, printed with
  `device='xla:0'`) that compute on the CPU. `.cpu()` copies back; `.numpy()` refuses
  as torch does for a tensor not on the host.
* Mixing with CPU tensors follows torch_xla's ATen bridge (`torch_xla/csrc/aten_xla_bridge.cpp`,
  `aten_xla_type.cpp`): the binary arithmetic ops lowered through `DoBinaryOp` (add, sub,
  mul, div, pow, fmod, rsub, the bitwise ones) move a CPU operand onto the device; a 0-dim
  CPU tensor is taken as a wrapped number everywhere; CPU index tensors may index; any
  other op given a CPU tensor raises `RuntimeError("Expected XLA tensor. Got: CPUFloatType")`
  (for a list argument, torch_xla's words for lists).
* RNG: the device's running seed as XLA keeps it (`xm.set_rng_state` / `get_rng_state`,
  default 101, advanced by `seed = 2531011 + 214013 * seed` after each random op); each
  random op draws from a CPU generator seeded with the running seed. `torch.manual_seed`
  does not reach it, as on a TPU.
* `torch.autocast("xla")`: torch_xla's TPU policy (`torch_xla/csrc/autocast_mode.cpp`).
* `torch.accelerator` answers as on a TPU host (no accelerator torch knows of).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from accel.sim.core import autocast as core_autocast
from accel.sim.core import carried, device_rules, hidden, torch_internals, wrapper
from accel.sim.core import compile as sim_compile
from accel.sim.core.wrapper import WrapperTensor

#: what C++ calls the device under a simulated XLA tensor (PrivateUse1, renamed)
HIDDEN_DEVICE = "simxla"
#: the seed of an XLA device's RNG when nothing set it (torch's lazy DeviceContext)
DEFAULT_SEED = 101
_SEED_MUL, _SEED_ADD = 214013, 2531011
_MASK = (1 << 64) - 1

#: ops whose XLA lowering moves a CPU operand onto the device (`DoBinaryOp` / `GetBinaryOperands`
#: in torch_xla's aten_xla_type.cpp); their in-place and out= forms go through them too
BINARY_OPS = frozenset(
    {"add", "sub", "mul", "div", "pow", "fmod", "rsub", "bitwise_and", "bitwise_or", "bitwise_xor",
     "__lshift__", "__rshift__", "__ilshift__", "__irshift__"}
)  # fmt: skip


def scalar_type_name(tensor: torch.Tensor) -> str:
    """`at::Tensor::toString()` of a CPU tensor: 'CPUFloatType', 'CPULongType', ..."""
    legacy = tensor.type()  # 'torch.FloatTensor', 'torch.BFloat16Tensor', ...
    return "CPU" + legacy[len("torch.") : -len("Tensor")] + "Type"


class XlaDevice(wrapper.SimDevice):
    """The XLA device of this process: one, `xla:0`, with XLA's running seed."""

    type = "xla"
    hidden = HIDDEN_DEVICE

    def __init__(self) -> None:
        super().__init__(1)
        self.seed = DEFAULT_SEED
        self.running_seed = DEFAULT_SEED

    def set_seed(self, seed: int) -> None:
        self.seed = self.running_seed = int(seed) & _MASK

    def generator(self, index: int) -> torch.Generator:
        # eager XLA: a random op takes the current seed, and the device's seed moves on
        generator = self.generators[index]
        generator.manual_seed(self.seed)
        self.seed = self.running_seed = (_SEED_ADD + _SEED_MUL * self.seed) & _MASK
        return generator

    def common_device(self, func: Any, args: tuple, kwargs: dict) -> torch.device | None:
        if func in device_rules.CROSS_DEVICE_OPS:
            return self._first_xla(args, kwargs)
        base = func._schema.name.split("::")[-1]
        lenient = base in BINARY_OPS or base.rstrip("_") in BINARY_OPS
        skip_indices = func in device_rules.INDEX_OPS
        device: torch.device | None = None
        positions = [*args, *kwargs.values()]
        names = [*(None for _ in args), *kwargs]
        for position, (value, name) in enumerate(zip(positions, names, strict=True)):
            if isinstance(value, WrapperTensor):
                device = device or value._shown
            elif isinstance(value, torch.Tensor):
                self._check_cpu(value, lenient, None)
            elif isinstance(value, (list, tuple)):
                indices = skip_indices and (position == 1 or name == "indices")
                for index, item in enumerate(value):
                    if isinstance(item, WrapperTensor):
                        device = device or item._shown
                    elif isinstance(item, torch.Tensor) and not indices:
                        self._check_cpu(item, lenient, index)
        return device

    @staticmethod
    def _check_cpu(tensor: torch.Tensor, lenient: bool, index: int | None) -> None:
        if lenient or tensor.dim() == 0 or tensor.device.type != "cpu":
            return
        got = scalar_type_name(tensor)
        if index is None:
            raise RuntimeError(f"Expected XLA tensor. Got: {got}")
        raise RuntimeError(
            f"Expected all tensors in the given list to be XLA tensors. Element at index {index} is not an XLA "
            f"tensor. Got: {got}"
        )

    @staticmethod
    def _first_xla(args: tuple, kwargs: dict) -> torch.device | None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, WrapperTensor):
                return value._shown
        return None


SIM = XlaDevice()


class XlaTensor(WrapperTensor):
    """A tensor on this process's simulated XLA device (`xla:0`); `_inner` holds its data."""

    _sim = SIM

    @property
    def is_xla(self) -> bool:
        return True

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]  # a property, as on Tensor
        return False

    def __reduce_ex__(self, protocol: Any) -> Any:
        # As torch pickles an XLA tensor (no storage): its data as numpy, its device named.
        return torch_internals.reduce_as_device_tensor(self._inner, self._shown, self.requires_grad)


def is_xla_tensor(tensor: Any) -> bool:
    """Whether `tensor` lives on the simulated XLA device."""
    return isinstance(tensor, XlaTensor)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding an XLA tensor's data (storage shared); other tensors unchanged."""
    return tensor._inner if isinstance(tensor, XlaTensor) else tensor


def from_host(tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
    """The host `tensor` seen as a tensor on `device` (default: this process's), storage shared."""
    if isinstance(tensor, XlaTensor):
        raise TypeError(f"from_host() takes a host tensor; this one is already on {tensor.device}")
    return XlaTensor(tensor, SIM.resolve("xla" if device is None else device))


# -- Python entry points (the core's, and pinning as on a TPU host) -------------------------------------


def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    """`Tensor.pin_memory` on a TPU host: torch knows of no accelerator to pin memory for."""
    raise RuntimeError("Cannot access accelerator device when none is available.")


def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
    """`Tensor.is_pinned` on a TPU host: no memory is pinned."""
    return False


# -- autocast: torch_xla's TPU policy ----------------------------------------------------------------

#: torch_xla/csrc/autocast_mode.cpp (`TORCH_LIBRARY_IMPL(aten, AutocastXLA, m)`), op by op
XLA_AUTOCAST_POLICY: dict[str, list[tuple[str, str]]] = {
    "lower": [
        ("conv1d", "default"), ("conv1d", "padding"), ("conv2d", "default"), ("conv2d", "padding"),
        ("conv3d", "default"), ("conv3d", "padding"), ("bmm", "default"), ("mm", "default"),
        ("baddbmm", "default"), ("addmm", "default"), ("addbmm", "default"), ("linear", "default"),
        ("matmul", "default"), ("conv_tbc", "default"), ("conv_transpose1d", "default"),
        ("conv_transpose2d", "input"), ("conv_transpose3d", "input"), ("prelu", "default"),
        ("relu", "default"), ("max_pool2d", "default"), ("einsum", "default"),
    ],
    "fp32": [
        ("batch_norm", "default"), ("_softmax", "default"), ("softmax", "int"), ("softmax", "Dimname"),
        ("log_softmax", "int"), ("log_softmax", "Dimname"), ("binary_cross_entropy", "default"),
        ("pow", "Tensor_Scalar"), ("prod", "default"), ("prod", "dim_int"), ("prod", "dim_Dimname"),
        ("cdist", "default"), ("trace", "default"), ("cholesky", "default"), ("cholesky_inverse", "default"),
        ("cholesky_solve", "default"), ("inverse", "default"), ("reflection_pad1d", "default"),
        ("reflection_pad2d", "default"), ("replication_pad1d", "default"), ("replication_pad2d", "default"),
        ("replication_pad3d", "default"), ("mse_loss", "default"), ("cosine_embedding_loss", "default"),
        ("nll_loss", "default"), ("nll_loss2d", "default"), ("hinge_embedding_loss", "default"),
        ("smooth_l1_loss", "default"), ("cross_entropy_loss", "default"), ("l1_loss", "default"),
        ("margin_ranking_loss", "default"), ("soft_margin_loss", "default"), ("triplet_margin_loss", "default"),
        ("multi_margin_loss", "default"), ("ctc_loss", "IntList"), ("ctc_loss", "Tensor"), ("kl_div", "default"),
        ("multilabel_margin_loss", "default"), ("binary_cross_entropy_with_logits", "default"), ("qr", "default"),
        ("svd", "default"), ("triangular_solve", "default"), ("multilabel_margin_loss_forward", "default"),
        ("linalg_svd", "default"), ("linalg_inv_ex", "default"),
    ],
    "promote": [("stack", "default"), ("cat", "default"), ("index_copy", "default"), ("index_copy", "dimname")],
}  # fmt: skip

AUTOCAST = core_autocast.Autocast("xla", HIDDEN_DEVICE, XlaTensor)


# -- empty tensors: zeros, as XLA makes them ------------------------------------------------------------

#: factories that leave memory uninitialised on other devices; torch_xla lowers them to a
#: full of zeros (aten_xla_type.cpp: `empty_symint` and friends call `tensor_methods::full(..., 0)`)
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"})
_EMPTY_LIKE = (
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
)


def _factory_kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    out = wrapper.factory_kernel(XlaTensor, op, *args, **kwargs)
    if op._schema.name.split("::")[-1] in _EMPTY:
        wrapper.unwrap(out).zero_()
    return out


def _zeroed_like(op: Any, args: tuple, kwargs: dict) -> Any:
    # An XLA tensor's empty_like / new_empty: zeros, as any XLA factory.
    out = wrapper.dispatch(XlaTensor, op, args, kwargs, apart=False)
    if isinstance(out, XlaTensor):
        out._inner.zero_()
    return out


# -- installing ------------------------------------------------------------------------------------------


def _no_accelerator() -> dict[str, Any]:
    """`torch.accelerator` on a TPU host: torch knows of no accelerator (torch_xla registers none)."""

    def none(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torch.accelerator: no accelerator is available (a TPU is not one torch.accelerator knows)")

    answers: dict[str, Any] = dict.fromkeys(torch_internals.ACCELERATOR_ENTRY_POINTS, none)
    answers["_get_accelerator"] = lambda: torch.device("cpu")
    answers["_accelerator_getAccelerator"] = lambda: None
    answers["_accelerator_isAllocatorInitialized"] = lambda: False
    return answers


_installed: list[bool] = []


def install() -> None:
    """Give this rank process its simulated XLA device (once per process)."""
    if _installed:
        return
    torch_internals.check_supported()
    hidden.register(HIDDEN_DEVICE, hidden.HiddenDeviceModule(1, seed_all=None))
    SIM.attach()
    torch_internals.patch_accelerator(_no_accelerator())
    wrapper.register_factories(("XLA", "PrivateUse1"), _factory_kernel)
    wrapper.add_special(XlaTensor, {op: functools.partial(_zeroed_like, op) for op in _EMPTY_LIKE})
    AUTOCAST.install(XLA_AUTOCAST_POLICY)
    wrapper.install_entry_points(XlaTensor)
    torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign,assignment]  # same signature
    torch.Tensor.is_pinned = is_pinned  # type: ignore[method-assign,assignment]  # same signature
    sim_compile.install((XlaTensor,))  # torch.compile(backend="openxla") traces, then runs eagerly
    torch_internals.record_no_flights_of(carried.PythonGroup)  # torch_xla's stand-in group is Python's
    _installed.append(True)


def is_installed() -> bool:
    """Whether this process has its simulated XLA device."""
    return bool(_installed)


def reset() -> None:
    """Between tests: the device's seed back to XLA's default, autocast off."""
    SIM.set_seed(DEFAULT_SEED)
    AUTOCAST.reset()
