"""The caching allocator's settings on simulated GPUs: ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``
and `torch.cuda.memory._set_allocator_settings`, read and applied as torch 2.13's allocator does.

Each test sets the variable at the top of its body, before CUDA starts (as a script sets it
before its first GPU tensor); the numbers follow from CUDACachingAllocator.cpp's rules
(see accel/sim/cuda/memory/configured.py).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.sim.core import torch_internals
from accel.sim.cuda.gpus import cards as gpu_models
from accel.sim.cuda.memory import allocator as cuda_memory
from accel.sim.cuda.memory import settings as alloc_config
from harness import distributed_test

MiB = 1 << 20
GiB = 1 << 30


def _uint8(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


# -- expandable segments --------------------------------------------------------------------------------


@pytest.mark.parametrize("expandable", [False, True])
@distributed_test(world_size=[2], device="cuda")
def test_expandable_segments_grow_by_pages_where_fixed_segments_fragment(expandable):
    if expandable:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    # a batch grows a little: four 10 MiB tensors, freed, then four of 12 MiB
    first = [_uint8(10 * MiB) for _ in range(4)]
    del first
    second = [_uint8(12 * MiB) for _ in range(4)]
    stats = torch.cuda.memory_stats()
    assert torch.cuda.memory_allocated() == 48 * MiB
    if expandable:
        # one segment mapped in 20 MiB pages: 40 MiB for the 10 MiB tensors, which the 12 MiB ones
        # tile again (12+12+12, the fourth takes the 4 MiB left and one more page)
        assert torch.cuda.memory_reserved() == 60 * MiB
        assert (stats["segment.all.current"], stats["num_device_alloc"]) == (0, 3)  # pages are not segments
    else:
        # a cached 10 MiB segment cannot hold 12 MiB: four new segments
        assert torch.cuda.memory_reserved() == 88 * MiB
        assert (stats["segment.all.current"], stats["num_device_alloc"]) == (8, 8)
    assert stats["inactive_split.all.current"] == 0
    del second[0], second[0], second[1]  # the third stays (24..36 MiB into the segment)
    torch.cuda.empty_cache()
    segments = torch.cuda.memory_snapshot()
    if expandable:
        # only whole free pages are given back: the page of 20..40 MiB holds the live tensor
        assert torch.cuda.memory_reserved() == 20 * MiB and torch.cuda.memory_stats()["num_device_free"] == 2
        assert [(s["total_size"], s["is_expandable"]) for s in segments] == [(20 * MiB, True)]
        blocks = [(b["size"] // MiB, b["state"]) for b in segments[0]["blocks"]]
        assert blocks == [(4, "inactive"), (12, "active_allocated"), (4, "inactive")]
    else:
        assert torch.cuda.memory_reserved() == 12 * MiB
        assert [(s["total_size"], s["is_expandable"]) for s in segments] == [(12 * MiB, False)]
    del second
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0


@distributed_test(world_size=[2], device="cuda")
def test_expandable_segments_can_be_turned_off_and_on_at_run_time():
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # the newer name reads the same
    a = _uint8(12 * MiB)
    assert torch.cuda.memory_reserved() == 20 * MiB  # one page
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the name, not the call
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    assert torch._C._accelerator_getAllocatorSettings() == "expandable_segments:False"
    b = _uint8(4 * MiB)  # the segment's free 8 MiB are passed over: a new 20 MiB segment
    assert torch.cuda.memory_reserved() == 40 * MiB and torch.cuda.memory_stats()["segment.all.current"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    # best fit counts a free block of an expandable segment as large as it can grow: the other
    # segment's 16 MiB serve
    c = _uint8(8 * MiB)
    assert torch.cuda.memory_reserved() == 40 * MiB and torch.cuda.memory_allocated() == 24 * MiB
    del a, b, c


# -- max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold -----------------------------


@pytest.mark.parametrize("conf", [None, "max_split_size_mb:20"])
@distributed_test(world_size=[2], device="cuda")
def test_blocks_above_max_split_size_are_never_split(conf):
    if conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    x = _uint8(40 * MiB)
    del x  # a cached 40 MiB segment
    y = _uint8(30 * MiB)
    stats = torch.cuda.memory_stats()
    if conf:
        # the 40 MiB block serves the 30 MiB request whole (less than 20 MiB over), unsplit
        assert torch.cuda.memory_allocated() == 40 * MiB
        assert stats["max_split_size"] == 20 * MiB
        assert (stats["oversize_allocations.current"], stats["oversize_segments.current"]) == (1, 1)
    else:
        assert torch.cuda.memory_allocated() == 30 * MiB
        assert stats["max_split_size"] == -1
        assert (stats["oversize_allocations.current"], stats["oversize_segments.current"]) == (0, 0)
    del y
    z = _uint8(5 * MiB)  # below max_split_size: the oversize block may not serve it
    stats = torch.cuda.memory_stats()
    if conf:
        assert torch.cuda.memory_reserved() == 60 * MiB  # a 20 MiB segment of its own, oversize as well
        assert stats["oversize_segments.current"] == 2 and stats["oversize_allocations.peak"] == 1
    else:
        assert torch.cuda.memory_reserved() == 40 * MiB  # split off the cached 40 MiB
    del z


@pytest.mark.parametrize(
    ("conf", "rounded"),
    [
        (None, {100_000: 100_352, 5 * MiB + 1: 5 * MiB + 512, 1200: 1536}),
        # four steps between powers of two everywhere: 100000 -> 98304 + 16384, 5 MiB + 1 -> 6 MiB
        ("roundup_power2_divisions:4", {100_000: 114_688, 5 * MiB + 1: 6 * MiB, 1200: 1536}),
        # two steps below 2 MiB, four above: 100000 -> 65536 + 65536
        ("roundup_power2_divisions:[1:2,>:4]", {100_000: 131_072, 5 * MiB + 1: 6 * MiB, 1200: 1536}),
    ],
)
@distributed_test(world_size=[2], device="cuda")
def test_roundup_power2_divisions_round_requests(conf, rounded):
    if conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    for nbytes, block in rounded.items():
        before = torch.cuda.memory_allocated()
        x = _uint8(nbytes)
        assert torch.cuda.memory_allocated() - before == block, nbytes
        del x


@pytest.mark.parametrize("conf", [None, "garbage_collection_threshold:0.5"])
@distributed_test(world_size=[2], device="cuda", gpu="memory=1GiB,capability=8.0")
def test_garbage_collection_frees_the_oldest_cached_segments_above_the_threshold(conf):
    if conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    torch.cuda.set_per_process_memory_fraction(0.5)  # 512 MiB allowed; collected above 256 MiB
    a, b = _uint8(100 * MiB), _uint8(110 * MiB)
    del a, b
    c = _uint8(120 * MiB)  # reserved 210 MiB, under the threshold: nothing collected
    del c
    d = _uint8(130 * MiB)
    if conf:
        # at 330 MiB reserved, the segments cached longest (100 and 110 MiB, older than the average
        # age) are freed before d's segment is made; the 120 MiB one, younger, stays
        assert torch.cuda.memory_reserved() == 250 * MiB and torch.cuda.memory_stats()["num_device_free"] == 2
    else:
        assert torch.cuda.memory_reserved() == 460 * MiB and torch.cuda.memory_stats()["num_device_free"] == 0
    del d


@distributed_test(world_size=[2], device="cuda", gpu="memory=1GiB,capability=8.0")
def test_oversize_cached_segments_are_freed_before_out_of_memory():
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:100"
    big, keep = _uint8(700 * MiB), _uint8(150 * MiB)
    del big  # cached, oversize (the card leaves 960 MiB beside the context)
    x = _uint8(200 * MiB)  # does not fit beside it: the cached 700 MiB segment is freed, no retry counted
    stats = torch.cuda.memory_stats()
    assert torch.cuda.memory_reserved() == 350 * MiB
    assert (stats["num_device_free"], stats["num_alloc_retries"], stats["num_ooms"]) == (1, 0, 0)
    del x, keep


@distributed_test(world_size=[2], device="cuda")
def test_the_memory_fraction_setting_is_the_allocators_start():
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "per_process_memory_fraction:0.25,release_lock_on_cudamalloc:True"
    assert torch.cuda.get_per_process_memory_fraction() == 0.25
    x = _uint8(MiB)
    with pytest.raises(torch.OutOfMemoryError, match="allowed"):
        _uint8(30 * GiB)
    del x


# -- invalid settings -----------------------------------------------------------------------------------------


@distributed_test(world_size=[2], device="cuda")
def test_invalid_settings_raise_torchs_errors_when_cuda_starts_or_at_run_time():
    from accel.sim.cuda import fake as fake_cuda

    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:true"
    with pytest.raises(ValueError, match="Expected 'True' or 'False' at index 2 in ConfigTokenizer but got 'true'"):
        torch.empty(1, device="cuda")  # the first use of the GPU reads them
    cases = {
        "foo:1": (ValueError, "Unrecognized key 'foo' in CUDA allocator config."),
        "max_split_size_mb:10": (ValueError, "CachingAllocator option max_split_size_mb too small, must be >= 20"),
        "garbage_collection_threshold:1.5": (
            ValueError,
            r"garbage_collect_threshold is invalid, set it in \(0.0, 1.0\)",
        ),
        "roundup_power2_divisions:3": (ValueError, "For roundups, the divisions has to be power of 2"),
        "max_split_size_mb": (RuntimeError, "Index out of bounds in ConfigTokenizer"),
        "large_segment_size_mb:8": (ValueError, "CachingAllocator option large_segment_size_mb must be > 10 MB"),
    }
    for text, (error, message) in cases.items():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = text
        with pytest.raises(error, match=message):
            fake_cuda.reconfigure()  # CUDA starting again reads them again
    del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    fake_cuda.reconfigure()
    with pytest.raises(ValueError, match="Unrecognized key 'bar' in Accelerator allocator config."):
        torch._C._accelerator_setAllocatorSettings("bar:1")
    with pytest.raises(RuntimeError, match="allocator backend parsed at load time, cudaMallocAsync != native"):
        torch._C._accelerator_setAllocatorSettings("backend:cudaMallocAsync")
    assert torch._C._accelerator_getAllocatorSettings() == ""  # nothing taken


# -- the settings text, as torch reads it --------------------------------------------------------------------

TEXTS = [
    "expandable_segments:True",
    "expandable_segments:true",
    "expandable_segments",
    "max_split_size_mb:abc",
    "max_split_size_mb:19",
    "max_split_size_mb:-5",
    "max_split_size_mb:1e3",
    "max_split_size_mb:99999999999999999999999",
    "max_split_size_mb=30",
    "max_split_size_mb:100,",
    "expandable_segments,True",
    "garbage_collection_threshold: 0.5",
    "garbage_collection_threshold:0.5x",
    "garbage_collection_threshold:nan",
    "garbage_collection_threshold:1e-400",
    "roundup_power2_divisions:[256:4,>:1]",
    "roundup_power2_divisions:[3:4]",
    "roundup_power2_divisions:[256:3]",
    "roundup_power2_divisions:[256:4",
    "roundup_power2_divisions:[128:2:4]",
    "roundup_power2_divisions:[]",
    "roundup_power2_divisions:0",
    "max_non_split_rounding_mb:10",
    "large_segment_size_mb:40,max_split_size_mb:30",
    "max_split_size_mb:30",  # large_segment_size_mb stays 40 from the text before, as in torch
    "large_segment_size_mb:20",
    "pinned_use_background_threads:yes",
    "pinned_max_cached_size_mb:5",
    "",
]


def _outcome(parse, text: str) -> tuple[str, str]:
    try:
        parse(text)
    except Exception as error:  # the type and message are what is compared
        message = str(error).splitlines()[0]
        if "INTERNAL ASSERT FAILED" in message:  # the source path and line differ; the condition and words do not
            message = message.split(" at ")[0] + " ... " + message.rsplit("PyTorch. ", 1)[-1]
        return type(error).__name__, message
    return "ok", ""


def test_the_settings_text_is_read_as_torchs_own_parser_reads_it():
    # torch's parser of this process (a CPU build checks the keys every accelerator shares, and no others)
    kept = alloc_config.AllocatorSettings()  # large_segment_size_mb carries over from one text to the next

    def ours(text: str) -> None:
        tokens = alloc_config._Tokens(text)
        alloc_config._parse_common(tokens, kept, "Accelerator" if torch.backends.cuda.is_built() else None)

    try:
        for text in TEXTS:
            assert _outcome(ours, text) == _outcome(torch_internals.torch_parses_allocator_settings, text), text
    finally:
        torch_internals.torch_parses_allocator_settings("large_segment_size_mb:20")


# -- the books balance under any settings (the allocator alone, no rank) --------------------------------------

SETTINGS = [
    "expandable_segments:True",
    "max_split_size_mb:20",
    "roundup_power2_divisions:[1:4,>:8],max_split_size_mb:40,expandable_segments:True",
    "garbage_collection_threshold:0.3",
    "large_segment_size_mb:32,expandable_segments:True",
]
SIZES = st.one_of(
    st.integers(1, 4096), st.integers(4096, MiB), st.integers(MiB, 12 * MiB), st.integers(10 * MiB, 60 * MiB)
)
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("empty_cache"), st.just(0)),
        st.tuples(st.just("settings"), st.integers(0, len(SETTINGS))),
    ),
    max_size=80,
)


def _check_books(memory: cuda_memory.DeviceMemory, live: dict[int, cuda_memory.Block]) -> None:
    """Allocated is the live blocks; reserved, the segments and the mapped pages; each expandable segment's
    blocks tile its address space, free ones cached, unmapped ones listed, no two free neighbours of a kind."""
    assert memory.allocated == sum(block.size for block in live.values()) <= memory.reserved
    cached = {id(entry[2]) for pool in memory.pools.values() for entry in pool.free}
    unmapped = {id(entry[1]) for pool in memory.pools.values() for entry in pool.unmapped}
    mapped = 0
    for segment in memory.expandables:
        block, address, previous = segment.head, segment.base, None
        while block is not None:
            assert block.addr == address and block.prev is previous and block.segment is segment
            assert (id(block) in unmapped) == (not block.mapped)
            assert (id(block) in cached) == (block.mapped and not block.allocated)
            if previous is not None and not previous.allocated and not block.allocated:
                assert previous.mapped != block.mapped  # free neighbours of a kind are merged
            mapped += block.size if block.mapped else 0
            address, previous, block = address + block.size, block, block.next
        assert address == segment.base + segment.size
    assert memory.reserved == sum(head.segment_size for head in memory.segments) + mapped


@settings(max_examples=120, deadline=None)
@given(first=st.sampled_from(SETTINGS), steps=STEPS)
def test_the_books_balance_under_any_settings(first, steps):
    def conf(text: str) -> alloc_config.AllocatorSettings:
        return alloc_config.parsed(text, alloc_config.AllocatorSettings())

    memory = cuda_memory.DeviceMemory(0, gpu_models.resolve("memory=512MiB,capability=8.0"), conf(first))
    memory.fraction = 0.6  # garbage collection needs a fraction
    live: dict[int, cuda_memory.Block] = {}
    for serial, (kind, value) in enumerate(steps):
        if kind == "malloc":
            try:
                live[serial] = memory.malloc(value)
            except torch.OutOfMemoryError as error:
                assert "CUDA out of memory" in str(error)
        elif kind == "free" and live:
            memory.free(live.pop(sorted(live)[value % len(live)]))
        elif kind == "empty_cache":
            memory.empty_cache()
        elif kind == "settings":  # at run time, as torch.cuda.memory._set_allocator_settings does
            memory.configure(conf(SETTINGS[value]) if value < len(SETTINGS) else alloc_config.AllocatorSettings())
        _check_books(memory, live)
    for block in live.values():
        memory.free(block)
    memory.empty_cache()
    assert memory.allocated == memory.reserved == 0 and not memory.segments and not memory.expandables
