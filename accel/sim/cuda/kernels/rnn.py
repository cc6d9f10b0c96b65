"""The fused LSTM and GRU cell kernels on a simulated GPU: `nn.LSTM`, `nn.GRU` and their cells train.

On a CUDA device torch's recurrent layers run each time step through fused cell kernels
(`_thnn_fused_lstm_cell`, `_thnn_fused_gru_cell` and their backwards) that a CPU build has
no kernel for. Each handler here computes what the CUDA kernel computes (RNN.cu), in the
accumulate type (float32 for half inputs) and stored in the input's dtype, and allocates
its outputs on the simulated GPU:

* LSTM: gates = input_gates + hidden_gates (+ both biases), in the order input, forget,
  cell, output; cy = f * cx + i * g, hy = o * tanh(cy). The workspace kept for the backward
  holds the four activated gates (batch, 4 * hidden), as the kernel's does.
* GRU: reset r and update z from the summed gates; n = tanh(input_n + r * hidden_n);
  hy = (1 - z) * n + z * hx. The workspace is (batch, 5 * hidden): r, z, n, hx and hidden_n,
  the kernel's size.

cuDNN, which a GPU host uses for these layers when it is installed, is not simulated: its
packed weights and reserve space are not what these kernels allocate.
"""

from __future__ import annotations

from typing import Any

import torch

from accel.sim.cuda.tensors.cuda_tensor import host_tensors, wrap_like

aten = torch.ops.aten


def _cell_args(args: tuple, kwargs: dict) -> list[Any]:
    """The host tensors of a cell op's (input_gates, hidden_gates, state, input_bias, hidden_bias)."""
    given = list(args) + [None] * (5 - len(args))
    given[3], given[4] = kwargs.get("input_bias", given[3]), kwargs.get("hidden_bias", given[4])
    return host_tensors(*given[:5])


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _summed(gates: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gates if bias is None else gates + _acc(bias)


def _outputs(like: torch.Tensor, dtype: torch.dtype, *results: torch.Tensor | None) -> tuple:
    """Results stored in `dtype` on the simulated GPU of `like` (None stays None)."""
    return tuple(None if r is None else wrap_like(r.to(dtype).contiguous(), like) for r in results)


def lstm_cell(args: tuple, kwargs: dict) -> tuple:
    """`_thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias)` -> (hy, cy, workspace)."""
    input_gates = args[0]
    ig, hg, cx, ib, hb = _cell_args(args, kwargs)
    gates = _summed(_summed(_acc(ig) + _acc(hg), ib), hb)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * _acc(cx) + i * g
    hy = o * cy.tanh()
    return _outputs(input_gates, ig.dtype, hy, cy, torch.cat([i, f, g, o], 1))


def lstm_cell_backward(args: tuple, kwargs: dict) -> tuple:
    """`_thnn_fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias)`.

    -> (grad_gates, grad_cx, grad_bias): the gradient of the summed gates, of cx, and (with biases) of a bias.
    """
    workspace_arg = args[4]
    grad_hy, grad_cy, cx, cy, workspace = host_tensors(*args[:5])
    has_bias = args[5]
    i, f, g, o = _acc(workspace).chunk(4, 1)
    tanh_cy = _acc(cy).tanh()
    zero = torch.zeros_like(tanh_cy)
    ghy = zero if grad_hy is None else _acc(grad_hy)
    gcy = (zero if grad_cy is None else _acc(grad_cy)) + ghy * o * (1 - tanh_cy.square())
    grad_gates = torch.cat(
        [gcy * g * i * (1 - i), gcy * _acc(cx) * f * (1 - f), gcy * i * (1 - g.square()), ghy * tanh_cy * o * (1 - o)],
        1,
    )
    grad_bias = grad_gates.sum(0) if has_bias else None
    return _outputs(workspace_arg, workspace.dtype, grad_gates, gcy * f, grad_bias)


def gru_cell(args: tuple, kwargs: dict) -> tuple:
    """`_thnn_fused_gru_cell(input_gates, hidden_gates, hx, input_bias, hidden_bias)` -> (hy, workspace)."""
    input_gates = args[0]
    ig, hg, hx, ib, hb = _cell_args(args, kwargs)
    i_r, i_z, i_n = _summed(_acc(ig), ib).chunk(3, 1)
    h_r, h_z, h_n = _summed(_acc(hg), hb).chunk(3, 1)
    r, z = (i_r + h_r).sigmoid(), (i_z + h_z).sigmoid()
    n = (i_n + r * h_n).tanh()
    h = _acc(hx)
    hy = (1 - z) * n + z * h
    return _outputs(input_gates, ig.dtype, hy, torch.cat([r, z, n, h, h_n], 1))


def gru_cell_backward(args: tuple, kwargs: dict) -> tuple:
    """`_thnn_fused_gru_cell_backward(grad_hy, workspace, has_bias)`.

    -> (grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias).
    """
    grad_arg = args[0]
    grad_hy, workspace = host_tensors(args[0], args[1])
    has_bias = args[2]
    r, z, n, hx, h_n = _acc(workspace).chunk(5, 1)
    g = _acc(grad_hy)
    grad_n = g * (1 - z) * (1 - n.square())
    grad_z = g * (hx - n) * z * (1 - z)
    grad_r = grad_n * h_n * r * (1 - r)
    grad_input = torch.cat([grad_r, grad_z, grad_n], 1)
    grad_hidden = torch.cat([grad_r, grad_z, grad_n * r], 1)
    biases = (grad_input.sum(0), grad_hidden.sum(0)) if has_bias else (None, None)
    return _outputs(grad_arg, grad_hy.dtype, grad_input, grad_hidden, g * z, *biases)


def flatten_weight(args: tuple, kwargs: dict) -> torch.Tensor:
    """`_cudnn_rnn_flatten_weight(weights, ...)`: a recurrent layer moved to the GPU of a CUDA build with cuDNN.

    On the card the weights become views of one buffer, the same bytes in all; cuDNN is not
    simulated, so here they stay apart, and the flat copy the op returns (which its caller drops) is made.
    """
    return torch.cat([weight.detach().reshape(-1) for weight in args[0]])


def handlers() -> dict[Any, Any]:
    """The fused recurrent-cell ops -> their handlers on simulated CUDA tensors (`cuda_tensor.add_special`)."""
    return {
        aten._thnn_fused_lstm_cell.default: lstm_cell,
        aten._thnn_fused_lstm_cell_backward_impl.default: lstm_cell_backward,
        aten._thnn_fused_gru_cell.default: gru_cell,
        aten._thnn_fused_gru_cell_backward.default: gru_cell_backward,
        aten._cudnn_rnn_flatten_weight.default: flatten_weight,
    }
