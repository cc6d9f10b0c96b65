"""Profiler calls on simulated GPUs answer as a CUDA build does with no profiling tool attached.

NVTX without a tool returns -2 (NVTX_NO_PUSH_POP_TRACKING) from range push and pop and range
id 0 from range start; the CUDA runtime's profiler start and stop succeed; `emit_nvtx` turns
torch's range-per-op profiler on; `torch.profiler` accepts CUDA as an activity. Each test
runs on 2 and 4 simulated GPU ranks.
"""

import contextlib
import os
import re
import tempfile

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@contextlib.contextmanager
def captured_stderr():
    """What C++ and Python write to this process's stderr inside the block (a list holding one string)."""
    text: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read())


@distributed_test(world_size=SIZES, device="cuda")
def test_nvtx_ranges_and_marks_answer_as_with_no_tool_attached(rank):
    nvtx = torch.cuda.nvtx
    assert nvtx.range_push(f"step {rank}") == -2
    assert nvtx.range_push("nested") == -2  # no tool tracks the depth
    assert nvtx.range_pop() == -2 and nvtx.range_pop() == -2
    assert nvtx.range_pop() == -2  # an unmatched pop too
    assert nvtx.range_start("across threads") == 0
    assert nvtx.range_end(0) is None and nvtx.mark("here") is None
    with nvtx.range("layer {}", rank):
        y = torch.ones(2, device="cuda") * 2

    @nvtx.range("decorated")
    def double(x):
        return x * 2

    assert double(y).tolist() == [4.0, 4.0]
    handle = nvtx._device_range_start("on the stream")
    assert nvtx._device_range_end(handle) is None
    # the C++ binding's own error for a message that is not a string
    expected = "rangePushA(): incompatible function arguments. The following argument types are supported:"
    with pytest.raises(TypeError, match=re.escape(expected)):
        nvtx.range_push(3)
    with pytest.raises(TypeError, match="rangeEnd"):
        nvtx.range_end("not an id")


@distributed_test(world_size=SIZES, device="cuda")
def test_cuda_profiler_start_stop_and_profile_do_nothing(rank):
    assert torch.cuda.profiler.start() is None and torch.cuda.profiler.stop() is None
    with torch.cuda.profiler.profile():
        x = torch.ones(3, device="cuda").sum()
    assert x.item() == 3
    cudart = torch.cuda.cudart()
    assert cudart.cudaProfilerStart() == cudart.cudaError.success == 0
    assert int(cudart.cudaProfilerStop()) == 0
    torch.cuda.check_error(cudart.cudaProfilerStart())
    with pytest.raises(torch.cuda.CudaError, match=re.escape("out of memory (2)")):
        torch.cuda.check_error(2)
    assert cudart.cudaMemGetInfo(rank) == torch.cuda.mem_get_info(rank)
    from accel.sim.cuda.fake import SimulatedDeviceError

    with pytest.raises(SimulatedDeviceError, match=r"cudaHostRegister is not available on a simulated GPU"):
        cudart.cudaHostRegister(x.data_ptr(), 4, 0)


@distributed_test(world_size=SIZES, device="cuda")
def test_emit_nvtx_turns_the_profiler_on_and_changes_no_result(rank):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).cuda()
    x = torch.randn(3, 4, device="cuda")
    expected = model(x).sum()
    assert not torch.autograd._profiler_enabled()
    with torch.autograd.profiler.emit_nvtx(record_shapes=True) as annotating:
        assert torch.autograd._profiler_enabled()
        got = model(x).sum()
        got.backward()
    assert not torch.autograd._profiler_enabled()
    assert got.item() == expected.item() and model.weight.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="NVTX annotation context manager is not reentrant"):
        annotating.__enter__()
    with torch.autograd.profiler.emit_nvtx(enabled=False):
        assert not torch.autograd._profiler_enabled()


@distributed_test(world_size=SIZES, device="cuda")
def test_torch_profiler_records_the_ops_when_asked_for_cuda(rank):
    activities = {torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA}
    assert activities <= torch.profiler.supported_activities()
    a, b = torch.randn(8, 8, device="cuda"), torch.randn(8, 8, device="cuda")
    with captured_stderr() as stderr:
        with torch.profiler.profile(activities=list(activities)) as profile:
            (a @ b).relu().sum().item()
        with torch.autograd.profiler.profile(use_device="cuda") as legacy:
            (a + b).sum().item()
    names = {event.key for event in profile.key_averages()}
    assert {"aten::mm", "aten::relu", "aten::sum"} <= names, names
    assert "aten::add" in {event.key for event in legacy.key_averages()}
    # a CPU build would fall back to recording CUDA events around each op, and warn at each one
    assert "Failed to record CUDA event" not in stderr[0], stderr[0][:2000]


@distributed_test(world_size=[2], device="cuda")
def test_deepspeed_nvtx_instrumentation_runs(rank):
    pytest.importorskip("deepspeed")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.nvtx import instrument_w_nvtx

    assert get_accelerator().range_push("forward") == -2 and get_accelerator().range_pop() == -2

    @instrument_w_nvtx
    def forward(x):
        return x + rank

    assert forward(torch.zeros(2, device="cuda")).tolist() == [rank, rank]
