"""PyTorch's own test helpers on simulated GPUs: what `torch.testing._internal` asks of a GPU host.

PyTorch's distributed test files (FSDP2, tensor parallelism, DTensor) run their CUDA tests under
`CudaNonDefaultStream`, which sets streams and devices through `torch._C._cuda_setStream` and
`_cuda_setDevice`; some keep a stream busy with `torch.cuda._sleep`; the memory-leak check clears
cuBLAS workspaces; `instantiate_device_type_tests` makes one test class per device type the host has.
"""

import io
import unittest

import torch

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_cuda_non_default_stream_sets_streams_and_devices_and_puts_them_back(rank, world_size):
    from torch.testing._internal.common_utils import CudaNonDefaultStream

    assert torch.cuda.current_device() == rank
    with CudaNonDefaultStream():
        assert torch.cuda.current_device() == rank  # it walks every GPU and comes back to the current one
        x = torch.ones(4, device="cuda") * 2
        assert x.sum().item() == 8.0
    assert torch.cuda.current_device() == rank
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


@distributed_test(world_size=SIZES, device="cuda")
def test_set_stream_by_id_makes_the_gpu_current_as_a_cuda_build_does(rank, world_size):
    other = (rank + 1) % world_size
    stream = torch.cuda.default_stream(other)
    torch.cuda._set_stream_by_id(stream.stream_id, stream.device_index, stream.device_type)
    assert torch.cuda.current_device() == other
    assert torch.cuda.current_stream(other) == stream
    torch.cuda.set_device(rank)
    try:
        torch.cuda._set_stream_by_id(stream.stream_id, rank, 0)  # a CPU stream's device type
    except RuntimeError as error:
        assert "CUDA stream" in str(error)
    else:
        raise AssertionError("a stream of another device type was taken for a CUDA one")


@distributed_test(world_size=SIZES, device="cuda")
def test_sleep_keeps_a_stream_busy_only_until_it_is_issued(rank, world_size):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    assert done.query() and stream.query()
    assert torch.cuda.current_device() == rank


@distributed_test(world_size=SIZES, device="cuda")
def test_clearing_cublas_workspaces_gives_their_memory_back(rank, world_size):
    a = torch.randn(64, 64, device="cuda")
    before = torch.cuda.memory_allocated()
    a @ a  # the first matrix product takes the (handle, stream) pair's workspace
    held = torch.cuda.memory_allocated()
    assert held > before
    torch._C._cuda_clearCublasWorkspaces()
    assert torch.cuda.memory_allocated() == before


@distributed_test(world_size=SIZES, device="cuda")
def test_device_type_tests_are_made_for_cpu_and_cuda_only(rank, world_size):
    from torch.testing._internal.common_device_type import instantiate_device_type_tests
    from torch.testing._internal.common_utils import TestCase

    class TestOnDevices(TestCase):
        def test_ones(self, device):
            self.assertEqual(torch.ones(2, device=device).sum().item(), 2.0)

    scope: dict = {"TestOnDevices": TestOnDevices}  # as a test file's globals: the generic class is replaced
    instantiate_device_type_tests(TestOnDevices, scope)
    assert sorted(scope) == ["TestOnDevicesCPU", "TestOnDevicesCUDA"], sorted(scope)  # nothing of the hidden device
    result = unittest.TextTestRunner(stream=io.StringIO()).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(scope["TestOnDevicesCUDA"])
    )
    assert result.wasSuccessful() and result.testsRun == 1, (result.errors, result.failures)


@distributed_test(world_size=SIZES, device="cuda")
def test_gpus_of_a_node_are_each_others_peers_as_on_a_gpu_node(rank, world_size):
    from torch.testing._internal.common_utils import requires_cuda_p2p_access

    count = torch.cuda.device_count()
    assert all(torch.cuda.can_device_access_peer(rank, peer) == (peer != rank) for peer in range(count))
    try:
        torch.cuda.can_device_access_peer(rank, count)
    except AssertionError as error:  # torch's own argument check, before the entry point
        assert "peer device" in str(error)
    else:
        raise AssertionError("a GPU the node does not have was called a peer")

    @requires_cuda_p2p_access()
    class NeedsPeers(unittest.TestCase):
        def test_p2p(self):
            pass

    result = unittest.TextTestRunner(stream=io.StringIO()).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(NeedsPeers)
    )
    assert result.testsRun == 1 and not result.skipped, result.skipped
