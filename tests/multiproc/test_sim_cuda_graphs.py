"""CUDA graphs on simulated GPUs: capture records, replay runs the captured work again on the same memory.

What torch's CUDA path does (torch/cuda/graphs.py and the CUDA caching allocator): a capture launches
nothing (memory from before it is unchanged at its end), replay re-runs the kernels on the captured
addresses (static inputs refreshed in place are read again, static outputs written again, in-place
updates and collectives happen again), and the host may not wait for the GPU while capturing.
"""

import pytest
import torch

from harness import distributed_test

SIZES = [2, 4]


@distributed_test(world_size=SIZES, device="cuda")
def test_replay_reads_refreshed_inputs_and_rewrites_held_outputs(rank, world_size):
    import torch.distributed as dist

    static_in = torch.ones(4, device="cuda")
    weight = torch.full((4,), 2.0, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert torch.cuda.is_current_stream_capturing()
        buf = torch.zeros(4, device="cuda")  # made by the capture: zeroed again at every replay
        buf.add_(static_in * weight)
        dist.all_reduce(buf)
        static_out = buf.sum() + 1
    assert not torch.cuda.is_current_stream_capturing()
    for value in (3.0, 5.0):
        static_in.fill_(value)
        graph.replay()
        assert buf.tolist() == [2 * value * world_size] * 4
        assert static_out.item() == 8 * value * world_size + 1


@distributed_test(world_size=SIZES, device="cuda")
def test_capture_changes_no_memory_from_before_it_and_each_replay_updates_once(rank, world_size):
    import torch.distributed as dist

    state = torch.zeros(3, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        state.add_(1.0)
        dist.all_reduce(state)
        view = state[:2]
        view.mul_(10)
    assert state.tolist() == [0.0, 0.0, 0.0]  # the card ran nothing while capturing
    graph.replay()
    assert state.tolist() == [10.0 * world_size, 10.0 * world_size, world_size]
    graph.replay()
    assert state[2].item() == (world_size + 1) * world_size


@distributed_test(world_size=SIZES, device="cuda")
def test_the_host_may_not_wait_for_the_gpu_while_capturing(rank, world_size):
    x = torch.ones(4, device="cuda")
    for wait in (lambda: x.sum().item(), lambda: torch.cuda.synchronize(), lambda: x.cpu()):
        invalidated = pytest.raises(RuntimeError, match="operation failed due to a previous error during capture")
        with invalidated as info, torch.cuda.graph(torch.cuda.CUDAGraph()):
            wait()
        assert "operation not permitted when stream is capturing" in str(info.value.__context__)
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        torch.cuda.CUDAGraph().replay()


@distributed_test(world_size=SIZES, device="cuda")
def test_a_captured_training_step_trains_as_the_eager_one(rank, world_size):
    """The whole-network capture of torch's CUDA graphs notes: forward, backward and optimizer step captured
    once, replayed on new data copied into the static input; weights and losses as in eager steps."""

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).cuda()
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    batches = [(torch.randn(4, 8, device="cuda"), torch.randn(4, 1, device="cuda")) for _ in range(5)]
    eager, eager_opt = make()
    eager_losses = []
    for x, y in batches:
        eager_opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(eager(x), y)
        loss.backward()
        eager_opt.step()
        eager_losses.append(loss.item())

    model, opt = make()
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # one warm-up step, as the notes do (it makes the optimizer's state)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(static_x), static_y).backward()
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = torch.nn.functional.mse_loss(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    losses = []
    for x, y in batches[1:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses.append(static_loss.item())
    assert losses == pytest.approx(eager_losses[1:], rel=1e-5)
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@distributed_test(world_size=SIZES, device="cuda")
def test_make_graphed_callables_gives_the_eager_gradients(rank, world_size):
    torch.manual_seed(rank)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2)).cuda()
    sample = torch.randn(3, 8, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(module, (sample,))
    for _ in range(3):
        x = torch.randn(3, 8, device="cuda", requires_grad=True)
        graphed(x).square().sum().backward()
        got = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
        module.zero_grad(set_to_none=True)
        x.grad = None
        module(x).square().sum().backward()
        want = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
        module.zero_grad(set_to_none=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


@distributed_test(world_size=SIZES, device="cuda")
def test_replay_allocates_nothing_and_the_capture_holds_only_what_the_program_keeps(rank, world_size):
    x = torch.randn(256, 256, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x @ x  # warm-up on the capture stream: its cuBLAS workspace is made before the capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = ((x @ x).relu() @ x).sum(0)  # three 256 KiB intermediates, dropped
    held = torch.cuda.memory_allocated() - before
    assert 0 < held < 256 * 256 * 4  # the 1 KiB output (in its allocator block), not the intermediates
    torch.cuda.reset_peak_memory_stats()
    peak_before = torch.cuda.max_memory_allocated()
    graph.replay()
    assert torch.cuda.memory_allocated() - before == held
    assert torch.cuda.max_memory_allocated() == peak_before
    torch.testing.assert_close(out, ((x @ x).relu() @ x).sum(0))


@distributed_test(world_size=SIZES, device="cuda")
def test_what_a_simulated_gpu_cannot_answer_about_a_graph_is_refused_clearly(rank, world_size, tmp_path):
    assert torch.cuda.graphs.CUDAGraph is torch.cuda.CUDAGraph
    pool = torch.cuda.graph_pool_handle()
    assert pool != torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    graph.enable_debug_mode()
    x = torch.ones(2, device="cuda")
    with torch.cuda.graph(graph, pool=pool):
        y = x * 2
    assert graph.pool() == pool
    graph.instantiate()
    graph.replay()
    assert y.tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="simulated GPU does not have"):
        graph.raw_cuda_graph()
    path = tmp_path / f"graph{rank}.dot"
    graph.debug_dump(str(path))
    assert "aten.mul.Tensor" in path.read_text()
