"""PyTorch's memory tracker on simulated GPUs: `torch.cuda.memory._record_memory_history`, `_snapshot`,
`_dump_snapshot`, read by torch's own viewer (`torch.cuda._memory_viz`), in torch's format
(c10/cuda/CUDACachingAllocator.cpp's trace entries, memory_snapshot.cpp's keys).
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist
import torch.nn as nn

from harness import distributed_test

MiB = 1 << 20
HERE = os.path.abspath(__file__)


def _made_here(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _block(segments: list[dict], requested: int) -> dict:
    """The one live block of `requested` bytes in a snapshot's segments."""
    (found,) = [
        b
        for s in segments
        for b in s["blocks"]
        if b["state"] == "active_allocated" and b["requested_size"] == requested
    ]
    return found


def _trace() -> list[dict]:
    snapshot = torch.cuda.memory._snapshot()
    return snapshot["device_traces"][torch.cuda.current_device()]


@distributed_test(world_size=[2], device="cuda")
def test_history_records_each_action_with_the_programs_stack():
    torch.cuda.memory._record_memory_history(max_entries=1000)
    x = _made_here(4000)
    del x
    snapshot = torch.cuda.memory._snapshot()
    assert set(snapshot) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert len(snapshot["device_traces"]) == torch.cuda.device_count()
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    # a new 2 MiB segment of the small pool, the block (torch's entry names the size asked for), its free
    assert [(e["action"], e["size"]) for e in trace] == [
        ("segment_alloc", 2 * MiB),
        ("alloc", 4000),
        ("free_requested", 4000),
        ("free_completed", 4000),
    ]
    # the block starts its segment; torch's addresses are the card's (here, the simulated allocator's)
    assert trace[1]["addr"] == trace[0]["addr"] == trace[2]["addr"] and trace[1]["stream"] == 0
    assert {"compile_context", "user_metadata", "time_us", "frames"} <= set(trace[1])
    assert trace[0]["time_us"] <= trace[3]["time_us"]
    # stacks innermost first, the program's frames only (no simulator frame sits between it and the GPU)
    frames = trace[1]["frames"]
    assert (frames[0]["filename"], frames[0]["name"]) == (HERE, "_made_here")
    assert frames[1]["name"] == "test_history_records_each_action_with_the_programs_stack"
    assert set(frames[0]) == {"filename", "line", "name"} and isinstance(frames[0]["line"], int)
    assert not any(os.sep + os.path.join("accel", "sim") + os.sep in f["filename"] for e in trace for f in e["frames"])
    # the next snapshot shows this one taken (active bytes then: none)
    assert _trace()[-1]["action"] == "snapshot" and _trace()[-2]["size"] == 0


@distributed_test(world_size=[2], device="cuda")
def test_snapshot_blocks_carry_the_stack_they_were_allocated_at():
    kept_before = _made_here(3 * MiB)  # before history: no stack
    torch.cuda.memory._record_memory_history()
    kept = _made_here(18 * MiB)  # more than the 17 MiB left after it: a segment of its own
    snapshot = torch.cuda.memory._snapshot()
    assert _block(snapshot["segments"], 3 * MiB)["frames"] == []
    live = _block(snapshot["segments"], 18 * MiB)
    assert live["state"] == "active_allocated"
    assert live["frames"][0]["name"] == "_made_here"
    segment = next(s for s in snapshot["segments"] if s["address"] == live["address"])
    assert segment["frames"][0]["name"] == "_made_here" and segment["segment_type"] == "large"
    assert sum(s["allocated_size"] for s in snapshot["segments"]) == torch.cuda.memory_allocated()
    # torch.cuda.memory_snapshot() lists the same segments, stacks included
    assert torch.cuda.memory_snapshot() == snapshot["segments"]
    # turned off: the trace goes, live blocks keep their stacks
    torch.cuda.memory._record_memory_history(enabled=None)
    _made_here(1000)
    later = torch.cuda.memory._snapshot()
    assert later["device_traces"][torch.cuda.current_device()] == []
    assert _block(later["segments"], 18 * MiB)["frames"][0]["name"] == "_made_here"
    del kept, kept_before


@distributed_test(world_size=[2], device="cuda")
def test_history_options_max_entries_state_context_skip_and_clear():
    torch.cuda.memory._record_memory_history(max_entries=3)
    for _ in range(4):
        _made_here(1000)
    # the ring keeps the newest three: the last allocation and its free
    assert [e["action"] for e in _trace()] == ["alloc", "free_requested", "free_completed"]
    assert [e["action"] for e in _trace()] == ["free_requested", "free_completed", "snapshot"]
    # "state": one entry kept (torch's ring of one), stacks still kept for live blocks
    torch.cuda.memory._record_memory_history(enabled="state", clear_history=True)
    kept = _made_here(2000)
    assert len(_trace()) == 1
    assert _block(torch.cuda.memory_snapshot(), 2000)["frames"][0]["name"] == "_made_here"
    # context=None: entries without stacks, blocks with none
    torch.cuda.memory._record_memory_history(context=None, clear_history=True)
    other = _made_here(3000)
    entry = next(e for e in _trace() if e["action"] == "alloc")
    assert "frames" not in entry and entry["size"] == 3000
    assert _block(torch.cuda.memory_snapshot(), 3000)["frames"] == []
    # context="alloc": frees carry the allocation's stack, not their own
    torch.cuda.memory._record_memory_history(context="alloc", clear_history=True)
    del other
    third = _made_here(512)
    del third
    freed = [e for e in _trace() if e["action"] == "free_requested"]
    assert freed[-1]["frames"][0]["name"] == "_made_here"
    # skipped actions are not recorded
    torch.cuda.memory._record_memory_history(skip_actions=["free_requested", "free_completed"], clear_history=True)
    del kept
    _made_here(100)
    assert {e["action"] for e in _trace()} <= {"alloc", "snapshot"}


@distributed_test(world_size=[2], device="cuda")
def test_bad_history_arguments_are_refused_by_name():
    for kwargs, words in (
        ({"enabled": "yes"}, "enabled"),
        ({"context": "some"}, "context"),
        ({"stacks": "cpp"}, "stacks"),
        ({"skip_actions": ["alloc", "malloc"]}, "malloc"),
    ):
        try:
            torch.cuda.memory._record_memory_history(**kwargs)
        except ValueError as error:
            assert words in str(error)
        else:
            raise AssertionError(f"{kwargs} was accepted")


@distributed_test(world_size=[2], device="cuda")
def test_the_older_form_and_out_of_memory():
    torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100, trace_alloc_record_context=True)
    torch.cuda.set_per_process_memory_fraction(0.01)
    request = 3 * (1 << 30) + 100
    try:
        _made_here(request)
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        raise AssertionError("no out-of-memory")
    oom = _trace()[-1]
    assert oom["action"] == "oom" and "addr" not in oom
    assert oom["size"] == request + 412  # rounded to 512 bytes, as torch records it
    assert oom["device_free"] == torch.cuda.mem_get_info()[0]
    assert oom["frames"][0]["name"] == "_made_here"
    torch.cuda.memory._record_memory_history(False)
    assert _trace() == []


@distributed_test(world_size=[2], device="cuda")
def test_expandable_segments_record_pages_mapped_and_unmapped():
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    torch.cuda.memory._record_memory_history()
    x = _made_here(30 * MiB)
    del x
    torch.cuda.empty_cache()
    actions = [(e["action"], e["size"]) for e in _trace()]
    assert actions == [
        ("segment_map", 40 * MiB),  # two 20 MiB pages
        ("alloc", 30 * MiB),
        ("free_requested", 30 * MiB),
        ("free_completed", 30 * MiB),
        ("segment_unmap", 40 * MiB),
    ]
    settings = torch.cuda.memory._snapshot()["allocator_settings"]
    assert settings["expandable_segments"] is True
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


@distributed_test(world_size=[2, 4], device="cuda")
def test_a_ddp_step_traced_adds_up_to_what_the_allocator_holds():
    torch.cuda.memory._record_memory_history()
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda(), device_ids=[torch.cuda.current_device()]
    )
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(16, 64, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    trace = _trace()
    # every block allocated since history began, less those freed, is what the allocator counts as requested
    live: dict[int, int] = {}
    for entry in trace:
        if entry["action"] == "alloc":
            live[entry["addr"]] = entry["size"]
        elif entry["action"] == "free_completed":
            assert live.pop(entry["addr"]) == entry["size"]
    assert sum(live.values()) == torch.cuda.memory_stats()["requested_bytes.all.current"]
    reserved = sum(e["size"] for e in trace if e["action"] == "segment_alloc")
    assert reserved == torch.cuda.memory_reserved()
    # the stacks name the program's calls (optimizer step, backward through DDP)
    names = {f["name"] for e in trace if e["action"] == "alloc" for f in e.get("frames", [])}
    assert {"step", "backward"} <= names
    dist.barrier()


@distributed_test(world_size=[2], device="cuda")
def test_torchs_viewer_reads_the_dump(tmp_path):
    torch.cuda.memory._record_memory_history()
    kept = [_made_here(n) for n in (1000, 3 * MiB, 25 * MiB)]
    path = os.path.join(str(tmp_path), f"rank{dist.get_rank()}.pickle")
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    from torch.cuda import _memory_viz

    text = _memory_viz.trace(snapshot)
    assert "cudaMalloc" in text and "25.0MiB" in text
    assert "total_allocated" in _memory_viz.segsum(snapshot)
    html = _memory_viz.trace_plot(snapshot)
    assert "MemoryViz.js" in html and len(html) > 1000
    assert _made_here.__name__ in _memory_viz.memory(snapshot, format_flamegraph=lambda lines: lines)
    del kept


@distributed_test(world_size=[2], device="cuda")
def test_entries_carry_the_threads_metadata():
    import threading

    torch.cuda.memory._record_memory_history()
    torch.cuda.memory._set_memory_metadata("step 3")
    _made_here(1000)
    assert torch.cuda.memory._get_memory_metadata() == "step 3"
    seen = []
    other = threading.Thread(target=lambda: seen.append(torch.cuda.memory._get_memory_metadata()))
    other.start()
    other.join()
    assert seen == [""]  # per thread, as torch keeps it
    torch.cuda.memory._set_memory_metadata("")
    _made_here(2000)
    allocs = [e for e in _trace() if e["action"] == "alloc"]
    assert [(e["size"], e["user_metadata"]) for e in allocs] == [(1000, "step 3"), (2000, "")]
