"""The simulated caching allocator keeps CUDA's books whatever the sequence of requests (properties)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.sim.cuda.gpus import cards as gpu_models
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.memory.allocator import K_SMALL_SIZE, DeviceMemory, round_size

MiB = 1 << 20
SIZES = st.one_of(
    st.integers(0, 4096),
    st.sampled_from([511, 512, 513, K_SMALL_SIZE - 1, K_SMALL_SIZE, K_SMALL_SIZE + 1, 10 * MiB - 1, 10 * MiB]),
    st.integers(K_SMALL_SIZE, 40 * MiB),
)
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("empty_cache"), st.just(0)),
    ),
    max_size=60,
)


def _check_books(memory: DeviceMemory, live: dict[int, tuple[cuda_memory.Block, int]]) -> None:
    blocks = [block for block, _ in live.values()]
    assert memory.allocated == sum(b.size for b in blocks)
    assert memory.stats[("requested_bytes", "all")].current == sum(n for _, n in live.values())
    assert memory.reserved == sum(head.segment_size for head in memory.segments)
    assert memory.allocated <= memory.reserved
    for block, nbytes in live.values():
        slack = block.size - round_size(nbytes)
        assert slack >= 0 and (slack < 512 if block.small else slack <= K_SMALL_SIZE)
    pooled = {id(entry[2]) for pool in memory.pools.values() for entry in pool.free}
    splits = 0
    for head in memory.segments:
        assert head.prev is None
        address, block, previous_free = head.addr, head, False
        while block is not None:
            assert block.addr == address
            assert block.allocated != (id(block) in pooled)  # free blocks, and only they, are cached
            assert not (previous_free and not block.allocated)  # free neighbours are merged
            previous_free = not block.allocated
            splits += (not block.allocated) and (block.prev is not None or block.next is not None)
            address += block.size
            block = block.next
        assert address == head.addr + head.segment_size  # the blocks tile the segment
    assert memory.nested_stats()["inactive_split"]["all"]["current"] == splits


@settings(max_examples=150, deadline=None)
@given(steps=STEPS)
def test_the_books_balance_after_any_sequence(steps):
    memory = DeviceMemory(0, gpu_models.resolve("memory=256MiB,capability=8.0"))
    live: dict[int, tuple[cuda_memory.Block, int]] = {}
    for serial, (kind, value) in enumerate(steps):
        if kind == "malloc":
            try:
                block = memory.malloc(value)
            except torch.OutOfMemoryError as error:
                assert "CUDA out of memory" in str(error)
                _check_books(memory, live)
                continue
            assert (block is None) == (value == 0)
            if block is not None:
                live[serial] = (block, value)
        elif kind == "free" and live:
            key = sorted(live)[value % len(live)]
            memory.free(live.pop(key)[0])
        elif kind == "empty_cache":
            memory.empty_cache()
        _check_books(memory, live)
    for block, _ in list(live.values()):
        memory.free(block)
    memory.empty_cache()
    assert memory.allocated == 0 and memory.reserved == 0 and not memory.segments


@pytest.mark.parametrize(
    ("size", "text"),
    [(0, "0 bytes"), (1024, "1024 bytes"), (1025, "1.00 KiB"), (MiB, "1024.00 KiB"), (20 * MiB, "20.00 MiB")],
)
def test_sizes_are_written_as_cuda_writes_them(size, text):
    assert cuda_memory.format_size(size) == text


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("h100", "NVIDIA H100 80GB HBM3"),
        ("A100-40GB", "NVIDIA A100-SXM4-40GB"),
        ("rtx 4090", "NVIDIA GeForce RTX 4090"),
    ],
)
def test_cards_are_found_however_they_are_spelled(spec, name):
    assert gpu_models.resolve(spec).name == name


def test_a_custom_card_reads_sizes_and_capabilities():
    card = gpu_models.resolve("memory=24GiB,capability=sm_89,sms=60")
    assert (card.total_memory, card.capability, card.multi_processor_count) == (24 << 30, (8, 9), 60)
    assert gpu_models.parse_size("512MiB") == 512 * MiB and gpu_models.parse_size("1000") == 1000


def test_the_docs_table_is_the_table_of_cards():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme, page = (root / "README.md").read_text(), (root / "docs" / "simulated-gpus.md").read_text()
    rows = [line for line in page.splitlines() if line.strip().startswith("| ") and "GiB |" in line]
    table = {}
    for row in rows:
        name, reported, memory, capability, sms = (cell.strip() for cell in row.strip().strip("|").split("|"))
        table[name.split(" ")[0]] = (reported, memory, capability, int(sms))
    assert set(table) == set(gpu_models.CARDS)
    for name, card in gpu_models.CARDS.items():
        memory = f"{card.total_memory / (1 << 30):.2f} GiB"
        assert table[name] == (card.name, memory, f"{card.major}.{card.minor}", card.multi_processor_count)
    assert gpu_models.DEFAULT_GPU == "H100" and "the default is an **H100**" in readme
    assert all(name in readme for name in gpu_models.CARDS)  # the README names them all
