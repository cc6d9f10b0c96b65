"""A simulated GPU is a particular card: its properties, its memory as the CUDA caching allocator
counts it, out-of-memory where the card runs out, and the GPUs CUDA_VISIBLE_DEVICES shows.

Written as GPU code is: `torch.cuda` queries, tensors on "cuda", NCCL collectives.
"""

from __future__ import annotations

import os
import resource

import pytest
import torch
import torch.distributed as dist

import accel.sim
from harness import distributed_test

MiB = 1 << 20
GiB = 1 << 30
SIZES = [2, 4]
#: the cuBLAS workspace a GPU takes for each thread that multiplies matrices (32 MiB on sm_90: H100, H200)
CUBLAS_WORKSPACE = 32 * MiB


# -- the card --------------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda", gpu="L4")
def test_the_card_is_the_one_asked_for(rank, world_size):
    props = torch.cuda.get_device_properties(rank)
    assert props.name == torch.cuda.get_device_name() == "NVIDIA L4"
    assert (props.major, props.minor) == torch.cuda.get_device_capability() == (8, 9)
    assert props.multi_processor_count == 58 and props.warp_size == 32
    assert f"{props.total_memory / GiB:.2f}" == "22.03"
    assert "name='NVIDIA L4', major=8, minor=9, total_memory=22559MB" in repr(props)
    free, total = torch.cuda.mem_get_info()
    assert total == props.total_memory and 0 < free < total  # the CUDA context takes its share
    with pytest.raises(AttributeError):
        props.total_memory = 1  # read-only, as torch's
    # every GPU of the host has its own identity
    uuids = {torch.cuda.get_device_properties(i).uuid for i in range(world_size)}
    assert len(uuids) == world_size


@distributed_test(world_size=[2], device="cuda", gpu="T4")
def test_what_depends_on_the_capability_follows_the_card():
    assert torch.cuda.get_device_capability() == (7, 5)
    # torch's own answer: no native bf16 below sm_80, emulated bf16 works
    assert not torch.cuda.is_bf16_supported(including_emulation=False)
    assert torch.cuda.is_bf16_supported()


@distributed_test(world_size=[2], device="cuda", gpu="memory=6GiB,capability=sm_86,name=Lab GPU")
def test_a_custom_card():
    props = torch.cuda.get_device_properties()
    assert (props.name, props.total_memory, props.major, props.minor) == ("Lab GPU", 6 * GiB, 8, 6)


@distributed_test(world_size=[2], device="cuda")
def test_the_default_card_is_an_h100_unless_the_environment_says(rank):
    assert torch.cuda.get_device_name() == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("bad", ["B200X", "memory=lots", "capability=8.0", "memory=8GiB,colour=red"])
def test_an_unknown_card_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="unknown GPU|memory size|needs memory|unknown key"):
        distributed_test(device="cuda", gpu=bad)
    with pytest.raises(ValueError):
        accel.sim.launch(print, world_size=2, device="cuda", gpu=bad)


def test_a_card_is_named_only_for_simulated_gpus():
    with pytest.raises(ValueError, match="needs device='cuda'"):
        distributed_test(device="cpu", gpu="L4")
    with pytest.raises(ValueError, match="needs device='cuda'"):
        accel.sim.launch(print, world_size=2, device="cpu", gpu="L4")


def _card_name():
    return torch.cuda.get_device_name()


def test_launch_takes_the_card_and_the_environment_variable(monkeypatch):
    assert accel.sim.launch(_card_name, world_size=2, device="cuda", gpu="A100-40GB") == ["NVIDIA A100-SXM4-40GB"] * 2
    monkeypatch.setenv("ACCEL_SIM_GPU", "V100")
    assert accel.sim.launch(_card_name, world_size=2, device="cuda", isolated=True) == ["Tesla V100-SXM2-16GB"] * 2


@distributed_test(world_size=[2], device="cuda")
def test_device_queries_that_need_nvml_are_refused_by_name():
    from accel.sim.cuda.fake import SimulatedDeviceError

    for query in (torch.cuda.utilization, torch.cuda.temperature, torch.cuda.power_draw):
        with pytest.raises(SimulatedDeviceError, match="is not available on a simulated GPU: it reads the GPU's NVML"):
            query()


@distributed_test(world_size=[2], device="cuda")
def test_events_time_the_work_between_them():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    x = torch.randn(256, 256, device="cuda")
    start.record()
    for _ in range(20):
        x = x @ x / 256
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) > 0
    with pytest.raises(RuntimeError, match="Both events must be created with argument 'enable_timing=True'"):
        torch.cuda.Event().elapsed_time(end)
    with pytest.raises(RuntimeError, match="Both events must be recorded"):
        torch.cuda.Event(enable_timing=True).elapsed_time(end)


# -- memory as the caching allocator counts it -----------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_memory_allocated_counts_blocks_as_the_allocator_rounds_them():
    base = torch.cuda.memory_allocated()
    # requests are rounded up to 512 bytes; views and in-place ops allocate nothing
    cases = [(1, 512), (100, 512), (129, 1024), (1000, 4096), (MiB // 4, MiB), (MiB // 4 + 1, MiB + 512)]
    for numel, counted in cases:
        before = torch.cuda.memory_allocated()
        x = torch.empty(numel, device="cuda")  # float32: 4 bytes each
        assert torch.cuda.memory_allocated() - before == counted, numel
        view = x[1:]
        x.add_(1) if numel > 1 else None
        assert torch.cuda.memory_allocated() - before == counted
        del x
        assert torch.cuda.memory_allocated() - before == counted  # the view keeps the storage
        del view
        assert torch.cuda.memory_allocated() == before
    assert torch.cuda.memory_allocated() == base


@distributed_test(world_size=SIZES, device="cuda")
def test_segments_are_reserved_as_the_allocator_reserves_them():
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0
    small = torch.empty(1000, device="cuda")  # from a 2 MiB segment of the small pool
    assert torch.cuda.memory_reserved() == 2 * MiB
    more = [torch.empty(1000, device="cuda") for _ in range(100)]  # the same segment serves them
    assert torch.cuda.memory_reserved() == 2 * MiB
    medium = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")  # 1-10 MiB: a 20 MiB segment
    assert torch.cuda.memory_reserved() == 22 * MiB
    big = torch.empty(33 * MiB, dtype=torch.uint8, device="cuda")  # its own segment, rounded to 2 MiB
    assert torch.cuda.memory_reserved() == 56 * MiB
    # the 1 MiB left in big's segment is too small to split off: the block is the whole 34 MiB
    assert torch.cuda.memory_allocated() == 101 * 4096 + 3 * MiB + 34 * MiB
    del small, more, medium, big
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_reserved() == 56 * MiB  # cached
    again = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")  # the cached 34 MiB block, split
    assert torch.cuda.memory_reserved() == 56 * MiB and torch.cuda.memory_allocated() == 30 * MiB
    del again
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0


@distributed_test(world_size=[2], device="cuda")
def test_memory_stats_summary_and_peaks_read_as_torch_writes_them(rank):
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    y = x * 2
    del x
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == 64 * MiB == torch.cuda.memory_allocated()
    assert stats["allocated_bytes.all.peak"] == 128 * MiB == torch.cuda.max_memory_allocated()
    assert stats["allocation.all.current"] == 1 and stats["segment.large_pool.current"] == 2
    assert stats["requested_bytes.all.current"] == 64 * MiB and stats["num_ooms"] == 0
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == 64 * MiB
    assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved() == 128 * MiB
    summary = torch.cuda.memory_summary()
    assert f"PyTorch CUDA memory summary, device ID {rank}" in summary and "Allocated memory" in summary
    assert torch.accelerator.memory_allocated() == 64 * MiB  # torch.accelerator reads the same counters
    segments = torch.cuda.memory_snapshot()
    assert sum(s["total_size"] for s in segments) == torch.cuda.memory_reserved()
    del y


@distributed_test(world_size=[2], device="cuda")
def test_peak_of_a_training_step_is_the_sum_the_allocator_counts():
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024, bias=False).cuda()  # 4 MiB of weights
    optimizer = torch.optim.Adam(model.parameters())
    batch = torch.randn(64, 1024, device="cuda")  # 256 KiB
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert before == 4 * MiB + 256 * 1024
    loss = model(batch).square().mean()
    loss.backward()
    optimizer.step()
    # live now: weights, gradient, Adam's two moments (4 MiB each), the batch and the loss
    # (Adam keeps its step counter on the host unless capturable), and the cuBLAS workspaces of
    # the forward's and the backward's threads (32 MiB each on an H100), as a real GPU holds them
    assert torch.cuda.memory_allocated() == 16 * MiB + 256 * 1024 + 512 + 2 * CUBLAS_WORKSPACE
    # the peak is above what stays live: the activations and the backward's temporaries
    assert torch.cuda.max_memory_allocated() > torch.cuda.memory_allocated()
    peak = accel.sim.peak_memory()
    assert peak.allocated == torch.cuda.max_memory_allocated() and peak.reserved == torch.cuda.max_memory_reserved()
    assert peak.card == "NVIDIA H100 80GB HBM3" and peak.allocated < 40 * GiB


# -- out of memory ----------------------------------------------------------------------------------


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@distributed_test(world_size=SIZES, device="cuda", gpu="memory=1GiB,capability=8.0")
def test_out_of_memory_is_raised_with_cuda_text_before_the_host_allocates(rank):
    keep = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    rss = _max_rss()
    attempts = [
        lambda: torch.zeros(2 * GiB, dtype=torch.uint8, device="cuda"),  # a factory
        lambda: torch.ones(2 * GiB, dtype=torch.uint8).to("cuda"),  # a copy to the GPU
    ]
    with pytest.raises(torch.OutOfMemoryError) as caught:
        attempts[0]()
    text = str(caught.value)
    assert text.startswith(
        # CUDA writes 1 GiB as 1024.00 MiB
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU {rank} has a total capacity of 1024.00 MiB"
    )
    assert "Of the allocated memory 256.00 MiB is allocated by PyTorch" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert _max_rss() - rss < 512 * MiB  # the 2 GiB were never asked of the host
    big_host = torch.ones(800 * MiB, dtype=torch.uint8)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 800.00 MiB"):
        big_host.to("cuda")
    # a computed result past the card: raised as well, and nothing is left counted
    a = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        torch.cat([a, a, a, a])
    assert torch.cuda.memory_allocated() == 456 * MiB
    assert torch.cuda.memory_stats()["num_ooms"] == 3
    del keep, a


@distributed_test(world_size=[2], device="cuda", gpu="memory=64MiB,capability=8.0")
def test_code_that_retries_with_a_smaller_batch_finds_one_that_fits():
    from accel.utils import find_executable_batch_size

    model = torch.nn.Linear(256, 256).cuda()
    tried = []

    # 64 Ki rows (64 MiB) cannot fit beside the model: about a dozen tries (each one collects
    # garbage, a tenth of a second) before one fits
    @find_executable_batch_size(starting_batch_size=1 << 16)
    def step(batch_size):
        tried.append(batch_size)
        x = torch.randn(batch_size, 256, device="cuda")  # 1 KiB a row
        model(x).sum().backward()
        return batch_size

    found = step()
    assert tried[0] == 1 << 16 and tried[-1] == found < 1 << 16 and len(tried) > 2
    assert found >= 4096  # input, output and their gradients: a few KiB a row


# -- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda")
def test_each_rank_sees_only_its_gpu_and_nccl_tells_them_apart(rank, local_rank, world_size):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)  # the idiom: before CUDA starts
    assert torch.cuda.device_count() == 1
    torch.cuda.set_device(0)
    x = torch.full((4,), float(rank + 1), device="cuda")
    assert x.device == torch.device("cuda", 0)
    dist.all_reduce(x)
    assert x.tolist() == [world_size * (world_size + 1) / 2] * 4
    assert torch.cuda.get_device_properties(0).uuid.endswith(f"{local_rank:012x}")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.empty(1, device="cuda:1")


@distributed_test(world_size=[2], device="cuda")
def test_two_ranks_on_one_physical_gpu_fail_as_nccl_fails(rank):
    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    with pytest.raises(dist.DistBackendError, match="Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1"):
        dist.all_reduce(torch.ones(1, device="cuda"))


@distributed_test(world_size=[2], device="cuda")
def test_the_visible_list_is_read_as_cuda_reads_it(rank):
    cases = {"1,0": [1, 0], "1,7,0": [1], "0,0": [], "": [], "x": [], "GPU-5e1a7ed0-acce-1000-8000-000000000001": [1]}
    for value, expected in cases.items():
        os.environ["CUDA_VISIBLE_DEVICES"] = value
        assert torch.cuda.device_count() == len(expected), value
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
    assert torch.cuda.get_device_properties(0).uuid.endswith("000000000001")  # cuda:0 is the host's GPU 1
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # too late: CUDA has started
    assert torch.cuda.device_count() == 2


@distributed_test(world_size=[2], device="cuda")
def test_no_visible_gpu_means_no_cuda():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    with pytest.raises(RuntimeError, match="No CUDA GPUs are available"):
        torch.zeros(1, device="cuda")


@distributed_test(world_size=[2], device="cuda")
def test_a_checkpoint_of_cuda_1_is_refused_where_one_gpu_is_visible(rank, tmp_path):
    from accel.sim.cuda import fake as fake_cuda

    path = tmp_path / f"on_gpu_1_by_{rank}.pt"
    torch.save(torch.ones(3, device="cuda:1"), path)
    fake_cuda.reset(local_rank=0, fresh=True)  # a new process, which sees one GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    with pytest.raises(
        RuntimeError, match="Attempting to deserialize object on CUDA device 1 but torch.cuda.device_count"
    ):
        torch.load(path)
    assert torch.load(path, map_location="cuda:0").device == torch.device("cuda", 0)


# -- storages that change size (FSDP2) ------------------------------------------------------------


@distributed_test(world_size=[2], device="cuda", gpu="memory=1GiB,capability=8.0")
def test_a_storage_resized_in_place_is_counted_at_its_new_size():
    x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    x.untyped_storage().resize_(0)  # as FSDP2 frees an unsharded parameter
    assert torch.cuda.memory_allocated() == 0
    x.untyped_storage().resize_(32 * MiB)
    assert torch.cuda.memory_allocated() == 32 * MiB
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        x.untyped_storage().resize_(2 * GiB)  # refused before the host grows it
    assert x.untyped_storage().nbytes() == 32 * MiB and torch.cuda.memory_allocated() == 32 * MiB


@distributed_test(world_size=SIZES, device="cuda")
def test_fsdp2_frees_its_unsharded_parameters_after_each_use(world_size):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(4)]).cuda()  # 4 MiB
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 512, device="cuda")
    model(x).sum().backward()
    optimizer.step()
    # after the step: each rank's shard of the weights, of their gradients and of Adam's two moments
    shards = 4 * 4 * MiB // world_size
    held = torch.cuda.memory_allocated() - x.numel() * 4 - 2 * CUBLAS_WORKSPACE  # forward's and backward's
    assert shards <= held < shards + 64 * 1024
    # in between, each layer's whole weight was gathered (1 MiB) and freed again
    assert torch.cuda.max_memory_allocated() >= shards // 2 + MiB


@distributed_test(world_size=SIZES, device="cuda", gpu="memory=170MiB,capability=8.0")
def test_out_of_memory_in_backward_is_raised_as_backward_returns(local_rank):
    def step(batch):
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8192)).cuda(),
            device_ids=[local_rank],
        )
        out = model(torch.randn(batch, 1024, device="cuda"))
        out.square().mean().backward()  # at batch 1000 the forward fits, the backward does not

    step(64)
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        step(1000)
    step(64)  # the process goes on, as on a GPU


# -- shapes only ------------------------------------------------------------------------------------


@distributed_test(world_size=SIZES, device="cuda", gpu="H100", shapes_only=True)
def test_shapes_only_fills_a_card_without_touching_the_host(local_rank, world_size):
    rss = _max_rss()
    big = torch.empty(16 * GiB, dtype=torch.uint8, device="cuda")  # nothing on the host
    weights = torch.randn(32768, 32768, device="cuda")  # 4 GiB
    product = weights @ weights  # computed as a shape
    assert product.shape == (32768, 32768) and product.device == torch.device("cuda", local_rank)
    assert torch.cuda.memory_allocated() == 16 * GiB + 8 * GiB + CUBLAS_WORKSPACE  # the product's workspace
    assert _max_rss() - rss < 256 * MiB
    assert product.sum().item() == 0.0 and product[:2, :2].cpu().tolist() == [[0.0, 0.0], [0.0, 0.0]]
    small = torch.tensor([1, 2, 3], device="cuda")  # small tensors keep their data
    assert small.sum().item() == 6
    dist.all_reduce(small)
    assert small.tolist() == [world_size, 2 * world_size, 3 * world_size]
    dist.all_reduce(weights)  # tensors without data exchange nothing
    with pytest.raises(torch.OutOfMemoryError, match="GPU .* has a total capacity of 79.19 GiB"):
        torch.empty(60 * GiB, dtype=torch.uint8, device="cuda")
    del big, weights, product


@distributed_test(world_size=[2], device="cuda", gpu="L4", shapes_only=True)
def test_shapes_only_runs_a_ddp_step_and_counts_its_peak(local_rank):
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8192, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 8192)).cuda(),
        device_ids=[local_rank],
    )  # 512 MiB of weights
    optimizer = torch.optim.AdamW(model.parameters())
    torch.cuda.reset_peak_memory_stats()
    loss = model(torch.randn(4096, 8192, device="cuda")).square().mean()
    loss.backward()
    optimizer.step()
    assert loss.item() == 0.0  # values mean nothing here
    # weights, gradients, DDP's buckets and Adam's two moments stay: 5 x 512 MiB
    assert torch.cuda.memory_allocated() >= 5 * 512 * MiB
    assert torch.cuda.max_memory_allocated() > torch.cuda.memory_allocated()


@pytest.mark.parametrize(("card", "flash"), [("A100-40GB", True), ("T4", False)])
def test_attention_takes_the_flash_path_only_on_cards_that_have_it(card, flash):
    def attend():
        q = torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.float16, requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return type(out.grad_fn).__name__

    names = accel.sim.launch(attend, world_size=2, device="cuda", gpu=card)
    # a GPU below sm_80 has no flash attention: torch takes another path there
    assert all(("Flash" in name) == flash for name in names), names


def _stream_caches():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() == side != torch.cuda.default_stream()
        x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    del x
    # the default stream does not reuse the block cached for the side stream: a segment of its own
    y = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    after_default = torch.cuda.memory_reserved()
    streams = sorted(segment["stream"] for segment in torch.cuda.memory_snapshot())
    with torch.cuda.stream(side):  # the side stream reuses its own
        z = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    del y, z
    return after_default, torch.cuda.memory_reserved(), streams[0] == 0 and streams[1] != 0


def test_cached_blocks_serve_only_the_stream_they_were_allocated_on():
    # torch's caching allocator keys its pools by stream: a block freed by a stream's tensor is reused on that stream
    assert accel.sim.launch(_stream_caches, world_size=1, device="cuda") == [(512 * MiB, 512 * MiB, True)]


@distributed_test(world_size=[2, 4], device="cuda")
def test_raw_allocations_come_from_the_caching_allocator():
    before = torch.cuda.memory_allocated()
    address = torch.cuda.caching_allocator_alloc(3 * MiB)
    assert isinstance(address, int) and torch.cuda.memory_allocated() == before + 3 * MiB
    side = torch.cuda.Stream()
    other = torch.cuda.caching_allocator_alloc(1000, stream=side)
    segments = {s["address"]: s for s in torch.cuda.memory_snapshot()}
    assert segments[other]["stream"] != 0 and segments[other]["segment_type"] == "small"  # the side stream's pool
    torch.cuda.caching_allocator_delete(address)
    torch.cuda.caching_allocator_delete(other)
    assert torch.cuda.memory_allocated() == before
    try:
        torch.cuda.caching_allocator_delete(address)
    except RuntimeError as error:
        assert "invalid device pointer" in str(error)
    else:
        raise AssertionError("a second delete was accepted")
    try:
        torch.cuda.caching_allocator_alloc(16, stream="side")
    except TypeError as error:
        assert "Invalid type for stream argument" in str(error)
    else:
        raise AssertionError("a string stream was accepted")
    try:
        torch.cuda.caching_allocator_alloc(1 << 50)
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        raise AssertionError("no out-of-memory")
