"""Stand-in for `accelerate.test_utils` in Accelerate's own scripts run against accel.

Accelerate's scripts import a few helpers from its `test_utils`; the data and model
helpers there are plain torch and are re-exported, while the helpers that read
Accelerate's shared state (`are_the_same_tensors`) are written here against accel's
state, so that the script under test uses accel only.
"""

import torch
from accelerate.test_utils.testing import assert_exception, require_bnb, torch_device  # noqa: F401  (plain helpers)
from accelerate.test_utils.training import RegressionDataset, RegressionModel  # noqa: F401

from accel.state import AcceleratorState
from accel.utils.operations import gather


def are_the_same_tensors(tensor: torch.Tensor) -> bool:
    """Whether every process holds the same `tensor` (compared after gathering them)."""
    state = AcceleratorState()
    tensor = tensor[None].clone().to(state.device)
    tensors = gather(tensor).cpu()
    tensor = tensor[0].cpu()
    return all(torch.equal(tensors[i], tensor) for i in range(tensors.shape[0]))
