"""The cost model of the simulated clock, on its own: kernels by FLOPs and bytes, NCCL's collectives, the clock.

Each figure is checked against the formula it stands for (the card's datasheet peak, NCCL's bus
bandwidth), so a change to the model that moves a prediction shows here.
"""

import math

import pytest
import torch

from accel.sim.cuda.gpus import cards
from accel.sim.cuda.timing import clock as clocks
from accel.sim.cuda.timing import collectives, costs
from accel.sim.cuda.timing.units import parse_network

aten = torch.ops.aten
H100, A100 = cards.resolve("H100"), cards.resolve("A100-80GB")


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_a_large_matmul_runs_at_the_cards_dense_peak_times_cublas_efficiency():
    a, b = _meta(8192, 8192), _meta(8192, 8192)
    out = a @ b
    for card in (H100, A100):
        seconds, flops = costs.duration(card, aten.mm.default, "matmul", (a, b), {}, out)
        assert flops == 2 * 8192**3
        tiles = 64 * 64
        use = tiles / (math.ceil(tiles / card.multi_processor_count) * card.multi_processor_count)
        assert seconds == pytest.approx(flops / (card.speeds.peak("bf16") * costs.EFFICIENCY["matmul"] * use))
    h100, _ = costs.duration(H100, aten.mm.default, "matmul", (a, b), {}, out)
    a100, _ = costs.duration(A100, aten.mm.default, "matmul", (a, b), {}, out)
    assert 2.5 < a100 / h100 < 3.5  # 989 against 312 dense TFLOPS, less the waves' fill


def test_a_matmul_whose_tiles_do_not_fill_the_sms_is_slower_per_flop():
    big = costs.duration(H100, aten.mm.default, "matmul", (_meta(4096, 4096),) * 2, {}, _meta(4096, 4096))
    # 133 tiles on 132 SMs: one tile more than fits needs a second wave, half empty
    odd_rows = 128 * 133
    odd_out = _meta(odd_rows, 128)
    odd = costs.duration(H100, aten.mm.default, "matmul", (_meta(odd_rows, 4096), _meta(4096, 128)), {}, odd_out)
    assert odd[0] / odd[1] > 1.9 * big[0] / big[1]


def test_fp32_matmuls_run_at_tf32_only_when_torch_allows_it():
    a = _meta(4096, 4096, dtype=torch.float32)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        fp32, _ = costs.duration(H100, aten.mm.default, "matmul", (a, a), {}, a)
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32, _ = costs.duration(H100, aten.mm.default, "matmul", (a, a), {}, a)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert fp32 / tf32 == pytest.approx(494.7 / 66.9)


def test_pointwise_ops_move_their_bytes_at_the_memory_bandwidth_and_views_launch_nothing():
    x = _meta(64 << 20, dtype=torch.float32)  # 256 MiB
    seconds, flops = costs.duration(H100, aten.add.Tensor, "memory", (x, x), {}, x)
    assert flops == 0
    assert seconds == pytest.approx(3 * x.nbytes / (3.35e12 * costs.EFFICIENCY["memory"]))
    tiny, _ = costs.duration(H100, aten.add.Tensor, "memory", (_meta(4), _meta(4)), {}, _meta(4))
    assert tiny == costs.MIN_KERNEL_S
    assert costs.kind_of(aten.view.default) is None and costs.kind_of(aten.empty.memory_format) is None
    # a view in all but its schema (the result of `reshape` and `matmul` on a contiguous tensor): no kernel on a GPU
    assert costs.kind_of(aten._unsafe_view.default) is None
    assert costs.kind_of(aten.add.Tensor) == "memory" and costs.kind_of(aten.addmm.default) == "matmul"
    assert costs.kind_of(aten._scaled_dot_product_flash_attention_backward.default) == "flash_backward"
    assert costs.kind_of(torch.ops._c10d_functional.all_reduce.default) is None  # the group times it


def test_attention_costs_its_flops_at_its_backends_share_of_the_peak():
    q = _meta(4, 32, 4096, 128)
    op = aten._scaled_dot_product_flash_attention.default
    out = (_meta(4, 32, 4096, 128),)
    forward, flops = costs.duration(H100, op, costs.kind_of(op), (q, q, q), {}, out)
    assert flops == 4 * 4 * 32 * 4096 * 4096 * 128  # torch's count: two matmuls of 2*s*s*d per head
    assert forward == pytest.approx(flops / (989.4e12 * costs.ATTENTION[("flash", True)][0]))


def _ring_all_reduce_bus(n, nbytes=8 << 30, gpus_per_node=8):
    links = collectives.Links(intra_gbps=450 * collectives.NVLINK_USABLE, nic_gbps=50, gpus_per_node=gpus_per_node)
    seconds = collectives.seconds("all_reduce", nbytes, n, links)
    return collectives.bus_bandwidth("all_reduce", nbytes, n, seconds)


def test_a_large_all_reduce_in_one_node_runs_at_ncclS_nvlink_bus_bandwidth():
    # NCCL's own figure for an H100's 18 NVLinks: 18 x 20.6 = 370.8 GB/s of bus bandwidth (ring, Simple)
    assert _ring_all_reduce_bus(8) == pytest.approx(370.8, rel=0.02)
    assert _ring_all_reduce_bus(2) == pytest.approx(370.8, rel=0.02)


def test_across_nodes_the_nics_of_a_node_together_bound_a_ring():
    # 16 ranks on 2 nodes: each ring crosses the boundary on its own NIC, 8 x 50 GB/s > 370.8: NVLink bounds
    assert _ring_all_reduce_bus(16) == pytest.approx(370.8, rel=0.35)
    # one GPU per node: the NIC alone
    assert _ring_all_reduce_bus(8, gpus_per_node=1) < 50
    assert _ring_all_reduce_bus(64) < _ring_all_reduce_bus(8)


def test_small_collectives_cost_their_latency_and_trees_win_at_scale():
    links = collectives.Links(intra_gbps=370.8, nic_gbps=50)
    small = collectives.seconds("all_reduce", 1024, 8, links)
    assert 5e-6 < small < 30e-6  # NCCL's LL base latency and a few NVLink hops
    # at 128 ranks a ring's 254 steps cost more latency than a tree's 2 log2(16) network hops
    per_step = collectives.seconds("all_reduce", 1 << 20, 128, links)
    ring_only = min(collectives._ring("all_reduce", 1 << 20, 128, links, p) for p in range(3)) * 1e-6
    assert per_step < ring_only
    gather_2 = collectives.seconds("all_gather", 1 << 30, 2, links)
    gather_8 = collectives.seconds("all_gather", 1 << 30, 8, links)
    assert gather_8 / gather_2 == pytest.approx((7 / 8) / (1 / 2), rel=0.05)  # (n-1)/n of the whole buffer


@pytest.mark.parametrize("n", [2, 8, 16, 64])
@pytest.mark.parametrize(
    "name, moved",
    [("all_reduce", lambda n: 2 * (n - 1) / n), ("all_gather", lambda n: (n - 1) / n),
     ("reduce_scatter", lambda n: (n - 1) / n)],
)  # fmt: skip
def test_large_collectives_move_nccl_tests_bytes_at_the_bus_bandwidth_of_their_links(n, name, moved):
    # 1 GiB by ring, Simple protocol (tuning.cc): base 8.4 us, 3.4 us per NVLink step, 14 us per network step; bus
    # bandwidth NVLink's within a node, the node's NICs' together (8 x 25 GB/s) where they are slower
    links = collectives.Links(intra_gbps=370.8, nic_gbps=25)
    nodes = max(1, n // 8)
    bus = 370.8 if nodes == 1 else min(370.8, 8 * 25)
    steps = 2 * (n - 1) if name == "all_reduce" else n - 1
    crossings = (2 if name == "all_reduce" else 1) * (nodes - 1)
    latency = 8.4e-6 + (steps - crossings) * 3.4e-6 + crossings * 14e-6
    seconds = collectives.seconds(name, 1 << 30, n, links)
    expected = latency + (1 << 30) * moved(n) / (bus * 1e9)
    if name == "all_reduce" and n > 8:
        assert expected < seconds < 2 * expected  # NCCL's tree may win; never above the ring's plateau
    else:
        assert seconds == pytest.approx(expected, rel=0.02)
    assert collectives.bottleneck(n, links) == ("nvlink" if n <= 8 else "network")


def test_all_to_all_across_nodes_is_bound_by_the_nic():
    links = collectives.Links(intra_gbps=370.8, nic_gbps=50)
    one_node = collectives.seconds("all_to_all", 1 << 30, 8, links)
    two_nodes = collectives.seconds("all_to_all", 1 << 30, 16, links)
    assert two_nodes == pytest.approx((1 << 30) * 8 / 16 / 50e9, rel=0.01)
    assert two_nodes > 4 * one_node  # half of it over a NIC of 50 GB/s, not 7/8 over NVLink


def test_the_clock_runs_a_stream_in_order_and_streams_side_by_side():
    clock = clocks.Clock(H100)
    first = clock.launch(0, 0, 1.0)
    second = clock.launch(0, 0, 1.0)
    assert first == pytest.approx(1.0) and second == pytest.approx(2.0)
    side = clock.launch(0, 1, 0.5)  # another stream starts once the host issues it, not after the first
    assert side == pytest.approx(2 * clocks.HOST_OP_S + 0.5)
    clock.wait(0, 1, second)
    assert clock.launch(0, 1, 1.0) == pytest.approx(3.0)
    assert clock.host < 1e-3  # the host ran ahead
    clock.host_waits(clock.drained(0))
    assert clock.host == pytest.approx(3.0)


def test_a_step_counts_the_communication_no_compute_hides():
    clock = clocks.Clock(H100)
    clock.end_step()
    clock.launch(0, 0, 1.0, flops=10)
    clock.launch(0, "nccl", 1.5, comm=True)  # overlaps the compute but for its last half
    clock.end_step()
    (step,) = clock.steps
    assert step.time_s == pytest.approx(1.5, abs=1e-4)
    assert step.compute_s == pytest.approx(1.0, abs=1e-4) and step.comm_s == pytest.approx(1.5)
    assert step.exposed_comm_s == pytest.approx(0.5, abs=1e-4) and step.flops == 10


def test_the_first_optimizer_marks_the_steps():
    clock = clocks.Clock(H100)
    main, other = object(), object()
    for _ in range(3):
        clock.launch(0, 0, 1.0)
        clock.optimizer_stepped(main)
        clock.optimizer_stepped(other)
    assert [round(s.time_s, 3) for s in clock.steps] == [1.0, 1.0]


@pytest.mark.parametrize("text, gbits", [("400Gbps", 400), ("200 Gb/s", 200), ("100", 100), ("3.2Gbit", 3.2)])
def test_network_bandwidths_read_as_people_write_them(text, gbits):
    assert parse_network(text) == gbits


@pytest.mark.parametrize("text", ["fast", "-5Gbps", "0"])
def test_a_network_that_is_not_a_bandwidth_is_refused(text):
    with pytest.raises(ValueError, match="400Gbps"):
        parse_network(text)


def test_the_cards_peaks_are_dense_and_every_card_has_them():
    assert H100.speeds.peak("bf16") == 989.4e12 and H100.speeds.peak("fp8") == 1978.9e12
    assert cards.resolve("V100").speeds.peak("bf16") == 15.7e12  # no BF16 tensor cores: its FP32 rate
    meta = cards.resolve("H100-96GB")
    assert meta.total_memory / 2**30 == pytest.approx(95.0) and meta.speeds.memory_tbps == 2.4
    assert meta.speeds.watts == 500
    # held to 500 W: a third of the way from the 400 W NVL's peaks to the 700 W SXM's
    nvl, sxm = 835.5e12, H100.speeds.peak("bf16")
    assert meta.speeds.peak("bf16") == pytest.approx(nvl + (sxm - nvl) / 3, rel=1e-3)
    assert nvl < meta.speeds.peak("fp8") / 2 < sxm / 1
    for card in cards.CARDS.values():
        assert card.speeds.peak("fp32") > 0 and card.speeds.memory_tbps > 0


@pytest.mark.parametrize(
    "tflops, text", [(412.3, "412 TFLOPS"), (4.891, "4.89 TFLOPS"), (0.5, "500 GFLOPS"), (1.09e-6, "1.09 MFLOPS")]
)
def test_the_end_of_run_line_prints_flops_per_second_in_a_unit_without_exponent(tflops, text):
    from accel.sim.cuda.timing import report

    assert report._flops_per_s(tflops) == text
