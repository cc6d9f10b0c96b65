"""A GPU test file written on PyTorch's own test bases, as PyTorch's, torchtitan's and many
libraries' distributed tests are: `MultiProcessTestCase` (a FileStore group), `FSDPTest`
(`fully_shard`), `DTensorTestBase` (`with_comms`), each gated by `skip_if_lt_x_gpu(2)`, and
`MultiThreadedTestCase` (ranks that are threads of one process, torch's "threaded" group).

Not collected by the project's suite (its name has no `test_` prefix):
tests/test_sim_node_suites.py runs it with pytest as `test_torch_bases.py`, on a simulated
node (where nothing may skip) and without one (where every test must skip).
"""

import unittest

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
from torch.testing._internal.common_distributed import (
    MultiProcessTestCase,
    MultiThreadedTestCase,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_fsdp import FSDPTest
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class AllReduceTest(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @skip_if_lt_x_gpu(2)
    def test_all_reduce(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("nccl", store=store, rank=self.rank, world_size=self.world_size)
        torch.cuda.set_device(self.rank)
        tensor = torch.ones(4, device="cuda") * (self.rank + 1)
        dist.all_reduce(tensor)
        self.assertEqual(tensor, torch.full((4,), 3.0, device="cuda"))
        self.assertEqual(tensor.device, torch.device("cuda", self.rank))
        self.assertEqual(dist.get_backend(), "nccl")
        dist.destroy_process_group()


class FullyShardTest(FSDPTest):
    @property
    def world_size(self):
        return 2

    @skip_if_lt_x_gpu(2)
    def test_fully_shard(self):
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).cuda()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        torch.manual_seed(1 + self.rank)
        loss = model(torch.randn(4, 8, device="cuda")).sum()
        loss.backward()
        grad = model[0].weight.grad
        self.assertEqual(grad.to_local().shape, (4, 8))  # this rank's half of the rows
        self.assertEqual(grad.to_local().device, torch.device("cuda", self.rank))
        self.assertEqual(grad.full_tensor().shape, (8, 8))


class DTensorTest(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    @skip_if_lt_x_gpu(2)
    def test_shard(self):
        self.assertEqual(self.device_type, "cuda")
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        tensor = torch.arange(8.0, device=self.device_type)
        sharded = distribute_tensor(tensor, mesh, [Shard(0)])
        self.assertEqual(sharded.to_local(), tensor[4 * self.rank : 4 * self.rank + 4])
        self.assertEqual(sharded.full_tensor(), tensor)


class ThreadedAllReduceTest(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    @unittest.skipIf(torch.cuda.device_count() < 2, "needs 2 GPUs")
    def test_all_reduce_on_threads(self):
        rank = dist.get_rank()  # each thread is a rank of its own
        tensor = torch.ones(4, device=f"cuda:{rank}") * (rank + 1)
        dist.all_reduce(tensor)
        self.assertEqual(tensor.cpu(), torch.full((4,), 3.0))
        self.assertEqual(tensor.device, torch.device("cuda", rank))


if __name__ == "__main__":
    run_tests()
