"""The simulated clock in ranks on 2 and 4 simulated GPUs: what programs that time themselves read, and the steps.

Kernels run on the stream they were issued on, in order; streams overlap, wait for events and for
each other; the host runs ahead and waits where a GPU host waits; collectives run on their group's
stream and hold the stream that waits on their work. Each figure is compared with the cost model's
own (`accel.sim.cuda.timing`), so the tests say what the clock adds up, not what a kernel costs.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

from harness import distributed_test

SIZES = [2, 4]
aten = torch.ops.aten


def _clock():
    from accel.sim.cuda.timing import clock

    found = clock.current()
    assert found is not None, "the clock runs in every simulated GPU rank"
    return found


def _mm_seconds(n, dtype=torch.float32):
    from accel.sim.cuda.timing import costs

    a = torch.empty(n, n, dtype=dtype, device="meta")
    return costs.duration(_clock().card, aten.mm.default, "matmul", (a, a), {}, a)[0]


@distributed_test(world_size=SIZES, device="cuda")
def test_timing_events_measure_the_predicted_kernels(rank, world_size):
    a = torch.randn(1024, 1024, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) == pytest.approx(10 * _mm_seconds(1024) * 1e3, rel=1e-6)
    assert start.elapsed_time(end) > 0.1  # ms: ten 1024^3 matmuls are not free
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.cuda.Event().elapsed_time(end)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_side_stream_overlaps_until_waited_for(rank, world_size):
    a = torch.randn(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    clock = _clock()
    begin = clock.host
    for _ in range(4):
        a @ a
    with torch.cuda.stream(side):
        for _ in range(4):
            a @ a
    main_end, side_end = clock.ready(rank, 0), clock.ready(rank, side.sim_id)
    one = _mm_seconds(1024)
    assert main_end - begin == pytest.approx(4 * one, rel=0.01) and side_end - begin < 4.5 * one  # side by side
    torch.cuda.current_stream().wait_stream(side)
    a @ a
    assert clock.ready(rank, 0) == pytest.approx(max(main_end, side_end) + one)
    # an event recorded on the side stream holds the main stream until the side's work is done
    with torch.cuda.stream(side):
        for _ in range(8):
            a @ a
        done = side.record_event()
    torch.cuda.current_stream().wait_event(done)
    assert clock.ready(rank, 0) >= clock.ready(rank, side.sim_id)


@distributed_test(world_size=SIZES, device="cuda")
def test_the_host_runs_ahead_and_waits_where_a_gpu_host_waits(rank, world_size):
    a = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    clock = _clock()
    for _ in range(5):
        b = a @ a
    assert clock.host < clock.ready(rank, 0) - 4 * _mm_seconds(1024)  # only the launches so far
    b[0, 0].item()  # reading a value back waits for the kernels before it
    assert clock.host >= clock.free[(rank, 0)]
    for _ in range(5):
        a @ a
    b.cpu()  # a blocking copy to the host
    assert clock.host >= clock.free[(rank, 0)]
    for _ in range(5):
        a @ a
    torch.cuda.synchronize()
    assert clock.host >= clock.drained(rank)
    for _ in range(5):
        a @ a
    assert clock.host < clock.drained(rank)
    torch.accelerator.synchronize()
    assert clock.host >= clock.drained(rank)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_collective_runs_on_its_own_stream_and_holds_the_stream_that_waits(rank, world_size):
    from accel.sim.cuda.timing import collectives, ops

    grad = torch.ones(32 << 20, device="cuda", dtype=torch.bfloat16)  # 64 MiB
    a = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    clock = _clock()
    before = clock.ready(rank, 0)
    work = dist.all_reduce(grad, async_op=True)
    a @ a  # compute overlaps the all-reduce: it does not wait for it
    expected = collectives.seconds("all_reduce", grad.nbytes, world_size, ops.links())
    assert expected > 2 * _mm_seconds(1024)
    assert clock.ready(rank, 0) - before < _mm_seconds(1024) + 1e-4
    work.wait()  # now the stream waits for the all-reduce's end
    assert clock.ready(rank, 0) == pytest.approx(before + expected, rel=1e-6)
    assert torch.equal(grad[:4].cpu(), torch.full((4,), float(world_size), dtype=torch.bfloat16))
    # a synchronous collective: the issuing stream waits at once
    start = clock.ready(rank, 0)
    dist.all_reduce(grad)
    assert clock.ready(rank, 0) - start == pytest.approx(expected, rel=1e-3)


@distributed_test(world_size=SIZES, device="cuda")
def test_collectives_of_two_groups_at_once_share_the_link_they_both_need(rank, world_size):
    from accel.sim.cuda.timing import collectives, ops

    first, second = dist.new_group(list(range(world_size))), dist.new_group(list(range(world_size)))
    x = torch.ones(32 << 20, device="cuda", dtype=torch.bfloat16)  # 64 MiB
    y = torch.ones_like(x)
    alone = collectives.seconds("all_reduce", x.nbytes, world_size, ops.links())
    torch.cuda.synchronize()
    clock = _clock()
    start = clock.ready(rank, 0)
    works = [dist.all_reduce(x, group=first, async_op=True), dist.all_reduce(y, group=second, async_op=True)]
    for work in works:
        work.wait()
    # two NCCL streams, one NVLink: the second runs in the time the first leaves it
    assert clock.ready(rank, 0) - start == pytest.approx(2 * alone, rel=0.01)
    if world_size == 4:  # two nodes of two GPUs: a pair within a node and a pair across share no link
        os.environ[ops.GPUS_PER_NODE_ENV] = "2"
        try:
            pairs = {pair: dist.new_group(list(pair)) for pair in ((0, 1), (2, 3), (0, 2), (1, 3))}
            near = pairs[(0, 1) if rank < 2 else (2, 3)]
            far = pairs[(0, 2) if rank in (0, 2) else (1, 3)]
            links = ops.links()
            t_near = collectives.seconds("all_reduce", x.nbytes, 2, links)
            t_far = collectives.seconds(
                "all_reduce", x.nbytes, 2, collectives.Links(links.intra_gbps, links.nic_gbps, 1)
            )
            assert t_far > 2 * t_near  # the network is slower than NVLink
            torch.cuda.synchronize()
            start = clock.ready(rank, 0)
            works = [dist.all_reduce(x, group=far, async_op=True), dist.all_reduce(y, group=near, async_op=True)]
            for work in works:
                work.wait()
            assert clock.ready(rank, 0) - start == pytest.approx(t_far, rel=0.01)
        finally:
            del os.environ[ops.GPUS_PER_NODE_ENV]


def _train(steps):
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    x = torch.randn(512, 256, device="cuda")
    for _ in range(steps):
        ddp(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@distributed_test(world_size=SIZES, device="cuda")
def test_each_optimizer_step_ends_a_step_with_its_flops_and_communication(rank, world_size):
    _train(4)
    steps = _clock().steps
    assert len(steps) == 3  # between the returns of four optimizer steps
    # forward 2 matmuls, backward 3 (the input needs no gradient): 2 * 512 * 256 * 1024 FLOPs each
    assert all(step.flops == 5 * 2 * 512 * 256 * 1024 for step in steps)
    assert steps[1].time_s == pytest.approx(steps[2].time_s, rel=1e-9)  # the same work takes the same time
    assert all(0 < step.comm_s < step.time_s and 0 <= step.exposed_comm_s <= step.comm_s for step in steps)
    assert all(step.compute_s <= step.time_s + 1e-12 for step in steps)


@distributed_test(world_size=SIZES, device="cuda", shapes_only=True)
def test_fsdp2_gathers_the_next_layer_while_this_one_computes(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    layers = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(6)]).cuda()
    for layer in layers:
        fully_shard(layer)
    fully_shard(layers)
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1)
    x = torch.randn(8192, 2048, device="cuda")
    for _ in range(3):
        layers(x).sum().backward()
        optimizer.step()
    begin, end, spans = _clock().last
    gathers = [(s, e) for s, e, comm, name, _ in spans if comm and "all_gather" in name]
    matmuls = [(s, e) for s, e, comm, name, _ in spans if name == "mm"]
    assert len(gathers) >= 6 and len(matmuls) >= 6 * 2
    # FSDP2 prefetches: all-gathers run on their own stream while the previous layer's matmuls run
    overlapping = [g for g in gathers if any(min(g[1], m[1]) > max(g[0], m[0]) for m in matmuls)]
    assert len(overlapping) >= len(gathers) - 2  # all but the first of forward (and of backward) hide
    step = _clock().steps[-1]
    assert step.exposed_comm_s < step.comm_s / 2


@distributed_test(world_size=SIZES, device="cuda", shapes_only=True)
def test_shapes_only_predicts_the_same_steps_as_a_run_with_values(rank, world_size):
    _train(3)
    assert len(_clock().steps) == 2 and _clock().steps[1].flops == 5 * 2 * 512 * 256 * 1024


@distributed_test(world_size=SIZES, device="cuda")
def test_the_end_of_run_line_and_the_json_report(rank, world_size):
    import os
    import tempfile

    from accel.sim.cuda.timing import report

    _train(4)
    os.environ[report.TOKENS_ENV] = "8192"
    try:
        line = report.line(rank, world_size)
    finally:
        del os.environ[report.TOKENS_ENV]
    median = sorted(s.time_s for s in _clock().steps)[1]
    assert line.startswith(f"rank {rank} on NVIDIA H100 80GB HBM3: predicted step {median * 1e3:.3g} ms")
    assert "MFU" in line and "exposed communication" in line
    tflops = 5 * 2 * 512 * 256 * 1024 / median / 1e12  # a small model: its TFLOPS in three digits, not "0"
    assert f", {tflops:.3g} TFLOPS," in line and tflops < 10
    assert f"{8192 / median / world_size:,.0f} tokens/s per GPU" in line
    chosen = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(chosen)  # one file for the ranks of the run
    path = os.path.join(chosen[0], "timing.json")
    report.write(path, rank)
    dist.barrier()
    with open(path) as written:
        data = json.load(written)
    assert data["card"] == "NVIDIA H100 80GB HBM3" and data["network"] == "400Gbps"
    assert sorted(data["ranks"], key=int) == [str(r) for r in range(world_size)]
    step = data["ranks"][str(rank)]["steps"][0]
    assert set(step) == {"time_s", "compute_s", "comm_s", "exposed_comm_s", "flops"}
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(chosen[0])


@distributed_test(world_size=SIZES, device="cuda")
def test_a_compiled_chain_of_pointwise_ops_is_one_kernel_at_its_boundary(rank, world_size):
    from accel.sim.cuda.timing import costs

    def chain(x):
        return ((x * 2 + 1).sin() * x).relu()

    x = torch.randn(1 << 22, device="cuda")  # 16 MiB
    compiled = torch.compile(chain)
    torch.cuda.synchronize()
    clock = _clock()
    begin = clock.ready(rank, 0)
    first = compiled(x)  # traced first (Dynamo's fake tensors launch nothing), then run
    fused_first = clock.ready(rank, 0) - begin
    torch.cuda.synchronize()
    begin = clock.ready(rank, 0)
    chain(x)
    eager = clock.ready(rank, 0) - begin
    torch.cuda.synchronize()
    begin = clock.ready(rank, 0)
    compiled(x)
    fused = clock.ready(rank, 0) - begin
    # eager: five kernels reading and writing 11 tensors of x's size; compiled: one reading x, writing the result
    assert eager == pytest.approx(costs.moved(clock.card, 11 * x.nbytes), rel=0.01)
    assert fused == pytest.approx(costs.moved(clock.card, 2 * x.nbytes), rel=0.01)
    assert fused_first == pytest.approx(fused, rel=0.01)
    assert torch.allclose(first, chain(x), atol=1e-6)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_checkpointed_compiled_region_run_op_by_op_is_timed_as_fused_kernels(rank, world_size):
    # the memory model runs checkpointed compiled regions op by op (compiled_buffers); Inductor fuses them all the same
    from torch.utils.checkpoint import checkpoint

    from accel.sim.cuda.timing import costs

    def chain(x):
        return ((x * 2 + 1).sin() * x).relu()

    def checkpointed(x):
        return checkpoint(chain, x, use_reentrant=False)

    x = torch.randn(1 << 22, device="cuda", requires_grad=True)  # 16 MiB
    compiled = torch.compile(checkpointed)
    compiled(x).sum().backward()  # traced first
    clock = _clock()
    timed = {}
    for name, fn in (("eager", checkpointed), ("compiled", compiled)):
        torch.cuda.synchronize()
        begin = clock.ready(rank, 0)
        out = fn(x)
        forward = clock.ready(rank, 0)
        timed[name] = (forward - begin, out)
        if name == "compiled":
            out.sum().backward()
            torch.cuda.synchronize()
            spans = [(s, e, n) for s, e, _, n, _ in clock.spans if s >= forward]
    # forward: one kernel reading x and writing the result (nothing else is kept under checkpointing)
    assert timed["compiled"][0] == pytest.approx(costs.moved(clock.card, 2 * x.nbytes), rel=0.01)
    assert timed["eager"][0] > 4 * timed["compiled"][0]
    # backward: the recomputation and the gradient run as fused kernels, none of the chain's ops alone
    names = {n for _, _, n in spans}
    assert "fused kernel (compiled)" in names and not names & {"sin", "mul.Tensor", "relu", "cos", "add.Tensor"}
    assert torch.allclose(timed["compiled"][1], chain(x), atol=1e-6)


@distributed_test(world_size=SIZES, device="cuda")
def test_a_functional_collective_holds_the_stream_where_its_result_is_first_used(rank, world_size):
    import torch.distributed._functional_collectives as funcol

    from accel.sim.cuda.timing import collectives, ops

    x = torch.full((8 << 20,), float(rank), device="cuda", dtype=torch.bfloat16)  # 16 MiB
    torch.cuda.synchronize()
    clock = _clock()
    before = clock.ready(rank, 0)
    gathered = funcol.all_gather_tensor(x, 0, dist.group.WORLD)  # DTensor's and tensor parallelism's call
    expected = collectives.seconds("all_gather", x.nbytes * world_size, world_size, ops.links())
    assert clock.ready(rank, 0) - before < expected / 2  # issued, not waited for: the stream goes on
    first = gathered[:: 8 << 20] + 0  # the first use waits (AsyncCollectiveTensor's wait_tensor)
    assert clock.ready(rank, 0) >= before + expected
    assert first.cpu().tolist() == [float(r) for r in range(world_size)]
