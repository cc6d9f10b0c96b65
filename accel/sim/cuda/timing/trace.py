"""A trace of one step per rank, as Perfetto and chrome://tracing open it, and a picture of it.

``ACCEL_SIM_TIMING_TRACE=PATH`` (`accel launch --timing_trace PATH`): each rank writes the last whole step
its clock saw as Chrome's trace-event JSON (one track per stream: the default stream, the streams the
program made, each NCCL group's), kernels and collectives named by their op and where they come from
(the module in forward, the autograd node in backward: `modules`); and beside it an SVG
picture of the same step (PATH with ``.svg``). `{rank}` in PATH is the rank; else ``.rankN`` goes before
the suffix when the world has more than one rank.
"""

from __future__ import annotations

import html
import json
import os
from typing import Any

from accel.sim.cuda.timing.clock import Clock

#: ``ACCEL_SIM_TIMING_TRACE``: where each rank writes the trace of its last whole step
TRACE_ENV = "ACCEL_SIM_TIMING_TRACE"
_COLOURS = {"compute": "#4878d0", "memory": "#82c6e2", "comm": "#ee854a"}


def path_for(path: str, rank: int, world_size: int) -> str:
    """This rank's file: `{rank}` filled in, else ``.rankN`` before the suffix on a world of several ranks."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size <= 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix or '.json'}"


def _tracks(spans: list) -> dict[Any, str]:
    """(gpu, stream) -> the track's name, in order of first use (NCCL groups numbered as they appear)."""
    names: dict[Any, str] = {}
    groups = 0
    for *_, key in spans:
        if key in names:
            continue
        gpu, stream = key
        if isinstance(stream, tuple):
            groups += 1
            names[key] = f"cuda:{gpu} NCCL group {groups}"
        else:
            names[key] = f"cuda:{gpu} stream {stream}" + (" (default)" if stream == 0 else "")
    return names


def events(clock: Clock, rank: int) -> list[dict[str, Any]]:
    """The last whole step's kernels as trace events (microseconds from the step's start), with track names."""
    if clock.last is None:
        return []
    begin, _, spans = clock.last
    names = _tracks(spans)
    tracks = {name: number for number, name in enumerate(dict.fromkeys(names.values()))}
    found: list[dict[str, Any]] = []
    for start, end, comm, name, key in spans:
        track = tracks[names[key]]
        op, _, where = (name or "kernel").partition(" (")
        found.append(
            {
                "name": name or "kernel",
                "args": {"op": op, "module": where[:-1]} if where else {"op": op},
                "cat": "nccl" if comm else "kernel",
                "ph": "X",
                "ts": (start - begin) * 1e6,
                "dur": (end - start) * 1e6,
                "pid": rank,
                "tid": track,
            }
        )
    meta = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} ({clock.card.name})"}}]
    meta += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": t, "args": {"name": n}} for n, t in tracks.items()]
    return meta + found


def svg(clock: Clock, rank: int, width: int = 1200) -> str:
    """A picture of the last whole step: one row per stream, each kernel a bar (collectives orange)."""
    if clock.last is None:
        return ""
    begin, end, spans = clock.last
    span = max(end - begin, 1e-12)
    names = _tracks(spans)
    rows = {name: number for number, name in enumerate(dict.fromkeys(names.values()))}
    left, row_h, top = 230, 26, 40
    height = top + row_h * len(rows) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<text x="10" y="20">rank {rank} on {html.escape(clock.card.name)}: one step, '
        f"{span * 1e3:.3f} ms predicted</text>",
    ]
    for name, row in rows.items():
        parts.append(f'<text x="10" y="{top + row * row_h + 16}">{html.escape(name)}</text>')
    scale = (width - left - 10) / span
    for start, stop, comm, name, key in spans:
        x = left + (max(start, begin) - begin) * scale
        w = max((stop - max(start, begin)) * scale, 0.5)
        colour = _COLOURS["comm" if comm else ("compute" if name.split(" (")[0] in _COMPUTE else "memory")]
        y = top + rows[names[key]] * row_h
        parts.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 6}" fill="{colour}">'
            f"<title>{html.escape(name)}: {(stop - start) * 1e6:.1f} us</title></rect>"
        )
    parts.append(f'<text x="{left}" y="{height - 8}">0 ms</text>')
    parts.append(f'<text x="{width - 80}" y="{height - 8}">{span * 1e3:.3f} ms</text>')
    parts.append("</svg>")
    return "\n".join(parts)


#: kernels drawn as compute (the rest move memory)
_COMPUTE = {
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
}  # fmt: skip


def write(path: str, clock: Clock, rank: int, world_size: int) -> str | None:
    """Write this rank's trace (and its picture beside it); the trace's path, or None without a whole step."""
    if clock.last is None:
        return None
    target = path_for(path, rank, world_size)
    with open(target, "w") as out:
        json.dump({"traceEvents": events(clock, rank), "displayTimeUnit": "ms"}, out)
    with open(os.path.splitext(target)[0] + ".svg", "w") as out:
        out.write(svg(clock, rank))
    return target
