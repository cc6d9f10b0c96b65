"""`AcceleratedOptimizer`: a torch optimizer that steps only when gradients are synchronised.

Under gradient accumulation the training loop calls `optimizer.step()` and
`optimizer.zero_grad()` on every batch; the wrapper turns those calls into no-ops until
the end of the accumulation window (`GradientState.sync_gradients`). With fp16 it steps
through the `GradScaler` and reports, in `step_was_skipped`, a step the scaler skipped
because the gradients overflowed (the scheduler wrapper reads it). The step itself is
asked of the hardware backend (XLA reduces gradients there).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from accel.state import AcceleratorState, GradientState


def move_to_device(state: Any, device: torch.device) -> Any:
    """`state` (an optimizer state dict) with every tensor inside (nested dicts, lists, tuples) moved to `device`."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return type(state)((k, move_to_device(v, device)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(move_to_device(v, device) for v in state)
    return state


def backend_reduces_gradients_in_step(hardware: Any) -> bool:
    """Whether the backend's `optimizer_step` also averages gradients across processes (XLA).

    Local stand-in until `Backend` states this itself: such a backend is recognised by
    overriding `Backend.optimizer_step`.
    """
    from accel.backends.base import Backend

    return type(hardware).optimizer_step is not Backend.optimizer_step


def average_gradients(optimizer: torch.optim.Optimizer, hardware: Any, num_processes: int) -> None:
    """Average the gradients of `optimizer`'s parameters over all processes, in place.

    One all-reduce per dtype over the flattened gradients, as XLA's own reduction does.
    Used where the backend would otherwise average inside its optimizer step, when the
    averaged gradients are needed earlier (clipping, the fp16 overflow check).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        hardware.all_reduce(flat, "sum")
        flat.div_(num_processes)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _set_to_none_parameter(zero_grad: Any) -> tuple[bool, bool]:
    """Whether `zero_grad` takes `set_to_none`, and whether it defaults to True."""
    parameter = inspect.signature(zero_grad).parameters.get("set_to_none")
    return parameter is not None, parameter is not None and parameter.default is True


def _has_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensors(v) for v in value)
    return False


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wrap `optimizer` for distributed / mixed-precision / accumulated training.

    Args:
        optimizer: the torch optimizer to wrap.
        device_placement: move the optimizer's state (e.g. loaded from a checkpoint) to the
            process's device.
        scaler: the `GradScaler` to step through when training in fp16.
    """

    # Deliberately does not call Optimizer.__init__: every attribute below forwards to
    # the wrapped optimizer, so there is one source of truth for param_groups and state.
    def __init__(self, optimizer: torch.optim.Optimizer, device_placement: bool = True, scaler: Any = None) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self.device_placement = device_placement
        self.gradient_state = GradientState()
        self.accelerator_state = AcceleratorState()
        self._hardware = self.accelerator_state.hardware
        self._is_overflow = False
        self._unscaled = False
        self._num_processes = self.accelerator_state.num_processes
        # Where the backend averages gradients inside its optimizer step, this rank may
        # average them earlier itself (clipping, fp16) and then step the plain optimizer.
        self._reduces_in_step = self._num_processes > 1 and backend_reduces_gradients_in_step(self._hardware)
        self._gradients_averaged = False
        self._join_notified = False
        # Set by Accelerator.join_uneven_inputs when the hardware joins uneven inputs
        # itself: called before each real step so that joined ranks can shadow it.
        self._join_notify = None
        #: (zero_grad function, whether it takes set_to_none, whether that defaults to True), see zero_grad
        self._zero_grad_signature: tuple[Any, bool, bool] | None = None
        if device_placement and _has_tensors(optimizer.state_dict()["state"]):
            self.optimizer.load_state_dict(move_to_device(optimizer.state_dict(), self.accelerator_state.device))

    # -- forwarding to the wrapped optimizer -------------------------------------------

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (the same list)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyper-parameters."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, moving its tensors to this process's device when placing devices."""
        if self.device_placement:
            state_dict = move_to_device(state_dict, self.accelerator_state.device)
        self.optimizer.load_state_dict(state_dict)

    def train(self) -> None:
        """Forwarded to optimizers that have a train mode (e.g. schedule-free ones)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Forwarded to optimizers that have an eval mode (e.g. schedule-free ones)."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_join_notify", None)
        state.pop("_zero_grad_signature", None)  # holds a function, which need not pickle
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._join_notify = None
        self._zero_grad_signature = None

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    # -- the training step ---------------------------------------------------------------

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Zero the gradients, only at the end of an accumulation window.

        `set_to_none` defaults to True; an optimizer whose `zero_grad` takes no
        `set_to_none` is called without it (and refuses an explicit value).
        """
        if not self.gradient_state.sync_gradients:
            return
        zero_grad = self.optimizer.zero_grad
        # inspect.signature costs more than the zero_grad it inspects: look once per function,
        # again only if the optimizer's zero_grad is replaced (patched, or another optimizer).
        function = getattr(zero_grad, "__func__", zero_grad)
        known = self._zero_grad_signature
        if known is None or known[0] is not function:
            known = self._zero_grad_signature = (function, *_set_to_none_parameter(zero_grad))
        _, takes_set_to_none, true_by_default = known
        if set_to_none is None and true_by_default:
            zero_grad()  # set_to_none=True, as the call a hand-written loop makes
        elif takes_set_to_none:
            zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        elif set_to_none is not None:
            raise ValueError(
                f"set_to_none={set_to_none} cannot be passed on: {type(self.optimizer).__name__}.zero_grad() takes "
                "no set_to_none. Call zero_grad() without it."
            )
        else:
            zero_grad()

    def _notify_join(self) -> None:
        # Inside join_uneven_inputs' fallback: tell the joined ranks, once per step and
        # before the first gradient collective, that this rank is still training.
        if self._join_notify is not None and not self._join_notified:
            self._join_notify(self)
            self._join_notified = True

    def unscale_gradients(self) -> None:
        """Make the gradients final before they are inspected (clipping), at most once per step.

        Averages them across processes first where the backend would only do that
        inside its step, then divides them by the fp16 loss scale (if any).
        """
        if self._reduces_in_step and not self._gradients_averaged:
            self._notify_join()
            average_gradients(self.optimizer, self._hardware, self._num_processes)
            self._gradients_averaged = True
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure: Any = None) -> Any:
        """Take a step at the end of an accumulation window; otherwise do nothing.

        With a scaler, a step whose gradients overflowed is skipped by the scaler and
        `step_was_skipped` becomes True until the next real step.
        """
        if not self.gradient_state.sync_gradients:
            return None
        if self.scaler is None and self._join_notify is None:
            # The usual step, taken on every batch: nothing to notify or scale. The flags are
            # reset before stepping, to the values the general path leaves.
            averaged = self._gradients_averaged
            self._is_overflow = self._unscaled = self._gradients_averaged = self._join_notified = False
            if averaged:
                return self.optimizer.step() if closure is None else self.optimizer.step(closure=closure)
            if closure is None:
                return self._hardware.optimizer_step(self.optimizer)
            return self._hardware.optimizer_step(self.optimizer, closure=closure)
        self._notify_join()
        try:
            if self.scaler is None:
                self._is_overflow = False
                kwargs = {} if closure is None else {"closure": closure}
                if self._gradients_averaged:
                    return self.optimizer.step(**kwargs)
                return self._hardware.optimizer_step(self.optimizer, **kwargs)
            if self._reduces_in_step and not self._gradients_averaged:
                # Every rank must see the same (averaged) gradients to agree on an overflow.
                average_gradients(self.optimizer, self._hardware, self._num_processes)
            scale_before = self.scaler.get_scale()
            result = (
                self.scaler.step(self.optimizer, closure) if closure is not None else self.scaler.step(self.optimizer)
            )
            self.scaler.update()
            # The scaler lowers its scale exactly when it found inf/nan and skipped the step.
            self._is_overflow = self.scaler.get_scale() < scale_before
            return result
        finally:
            self._unscaled = False
            self._gradients_averaged = False
            self._join_notified = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped because fp16 gradients overflowed."""
        return self._is_overflow

    @property
    def is_overflow(self) -> bool:
        """Alias of `step_was_skipped`."""
        return self._is_overflow
