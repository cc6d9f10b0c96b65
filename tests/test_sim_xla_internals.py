"""Private torch APIs the simulated TPU adds to accel/sim/core/torch_internals.py: each fails loudly on an upgrade.

(Presence of every internal is checked by tests/test_sim_cuda_internals.py; here, that
the ones only the simulated TPU uses still behave as it relies on.)
"""

import pickle

import torch

from accel.sim.core import torch_internals


def test_xla_tensors_pickle_through_torchs_rebuild_from_a_cpu_tensor():
    # torch pickles an XLA tensor (no storage) as (a CPU copy, dtype, device name, requires_grad)
    data = torch.arange(3.0, dtype=torch.bfloat16)  # no numpy dtype for it: torch no longer goes through numpy
    rebuild, args = torch_internals.reduce_as_device_tensor(data, torch.device("cpu"), True)
    assert rebuild.__module__ == "torch._utils" and rebuild.__name__ == "_rebuild_device_tensor_from_cpu_tensor", (
        "torch._utils._rebuild_device_tensor_from_cpu_tensor moved: adapt accel/sim/core/torch_internals.py "
        f"(supported: {', '.join(torch_internals.SUPPORTED_TORCH)})"
    )
    rebuilt = pickle.loads(pickle.dumps(rebuild(*args)))
    assert torch.equal(rebuilt, data) and rebuilt.dtype == torch.bfloat16 and rebuilt.requires_grad


def test_torch_pickles_xla_tensors_as_the_simulator_does():
    # The simulated XLA tensor copies what torch's own Tensor._reduce_ex_internal does for device type "xla".
    import inspect

    source = inspect.getsource(torch.Tensor._reduce_ex_internal)
    assert '"xla"' in source and "_rebuild_device_tensor_from_cpu_tensor" in source, (
        "torch no longer pickles XLA tensors through _rebuild_device_tensor_from_cpu_tensor: adapt "
        "accel/sim/core/torch_internals.py reduce_as_device_tensor"
    )
