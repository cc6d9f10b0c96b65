"""A test file written as Accelerate writes its multi-GPU tests (its tests/test_multidevice.py):
gated by `require_multi_device` / `require_non_cpu`, each runs `accelerate launch` on one of
Accelerate's own scripts in a subprocess.

Not collected by the project's suite (its name has no `test_` prefix):
tests/test_sim_node_suites.py runs it with pytest as `test_accelerate_style.py` on a
simulated node, where nothing may skip.
"""

import unittest

import torch
from accelerate.test_utils import (
    execute_subprocess_async,
    get_launch_command,
    path_in_accelerate_package,
    require_multi_device,
    require_non_cpu,
)
from accelerate.utils import patch_environment


class MultiDeviceTester(unittest.TestCase):
    ops = path_in_accelerate_package("test_utils", "scripts", "test_ops.py")
    script = path_in_accelerate_package("test_utils", "scripts", "test_script.py")

    @require_non_cpu
    def test_device(self):
        self.assertTrue(torch.cuda.is_available())
        self.assertEqual(torch.cuda.device_count(), 2)

    @require_multi_device
    def test_ops(self):
        with patch_environment(omp_num_threads=1):
            execute_subprocess_async(get_launch_command(num_processes=2) + [self.ops])

    @require_multi_device
    def test_script(self):
        with patch_environment(omp_num_threads=1):
            execute_subprocess_async(get_launch_command(num_processes=2) + [self.script])
