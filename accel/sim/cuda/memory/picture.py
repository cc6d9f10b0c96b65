"""The memory of a simulated GPU over a step, by category, drawn as SVG (alone, or in an HTML page).

Torch-free (the launcher reads `REPORT_ENV` and checks paths before any rank starts). No plotting
library: the picture is SVG written by hand, a stacked area of the allocated memory
by category (the categories of `accel.sim.cuda.memory.report`) against the allocator's events,
with the reserved memory as a line and the peak marked. An HTML page holds one picture per GPU
followed, and the numbers at the peak in a table.
"""

from __future__ import annotations

import array
import dataclasses
import html
import os
from collections.abc import Callable

Scale = Callable[[float], float]

#: the environment variable that asks for the memory report (``1``, or the path of its picture)
REPORT_ENV = "ACCEL_SIM_MEMORY_REPORT"
#: what a picture may be written as
PICTURE_KINDS = (".html", ".svg")


def wanted() -> str | None:
    """What ``ACCEL_SIM_MEMORY_REPORT`` asks: None (no report), "" (the report), or a picture's path."""
    value = os.environ.get(REPORT_ENV, "").strip()
    if value.lower() in ("", "0", "false", "no", "off"):
        return None
    return "" if value.lower() in ("1", "true", "yes", "on") else value


def check_path(path: str) -> None:
    """Refuse a picture path of a kind that cannot be written (before a run, not after it)."""
    if not path.lower().endswith(PICTURE_KINDS):
        raise ValueError(f"the memory picture is HTML or SVG: give a path ending in .html or .svg, not {path!r}")


#: one colour per category, in `memory_report.CATEGORIES` order
COLOURS = ("#4e79a7", "#76b7b2", "#f28e2b", "#e15759", "#59a14f", "#edc948", "#b07aa1", "#9c755f")
WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 960, 360, 70, 40, 30
#: the most columns drawn (events are grouped; each group shows its highest point)
COLUMNS = 1200


@dataclasses.dataclass
class Series:
    """A GPU's timeline: the bytes by category at its start, then one event per storage made, freed or
    re-categorised (category, change, allocated and reserved bytes after it)."""

    title: str
    categories: tuple[str, ...]
    start: list[int]
    kinds: array.array
    changes: array.array
    allocated: array.array
    reserved: array.array
    peak_index: int
    capacity: int


def columns(series: Series) -> list[tuple[int, list[int], int]]:
    """(event index, bytes by category with "other" the untracked rest, reserved) of the highest event of each group."""
    sums = list(series.start)
    count = len(series.kinds)
    group = max(1, -(-count // COLUMNS))
    found: list[tuple[int, list[int], int]] = []
    best: tuple[int, list[int], int] | None = None
    for i in range(count):
        sums[series.kinds[i]] += series.changes[i]
        if best is None or series.allocated[i] > sum(best[1]):
            state = list(sums)
            state[-1] += series.allocated[i] - sum(sums)
            best = (i, state, series.reserved[i])
        if (i + 1) % group == 0 or i + 1 == count:
            found.append(best)
            best = None
    return found


def _gib(nbytes: float) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def svg(series: Series) -> str:
    """One picture: the stacked categories, the reserved line, the peak, axes and a legend."""
    points = columns(series)
    top = max([sum(state) for _, state, _ in points] + [reserved for _, _, reserved in points] + [1])
    span = max(len(series.kinds) - 1, 1)

    def x(index: float) -> float:
        return LEFT + (WIDTH - LEFT - 20) * index / span

    def y(nbytes: float) -> float:
        return TOP + (HEIGHT - TOP - BOTTOM) * (1 - nbytes / top)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT + 24 * 2}" font-family="sans-serif" '
        f'font-size="12"><text x="{LEFT}" y="18" font-size="14">{html.escape(series.title)}</text>'
    ]
    parts += _areas(series, points, x, y)
    reserved = " ".join(f"{x(i):.1f},{y(r):.1f}" for i, _, r in points)
    parts.append(f'<polyline points="{reserved}" fill="none" stroke="#333" stroke-dasharray="4 3"/>')
    if points and series.peak_index > 0:
        peak_x = x(series.peak_index - 1)
        parts.append(f'<line x1="{peak_x:.1f}" x2="{peak_x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#d00"/>')
        parts.append(f'<text x="{peak_x + 4:.1f}" y="{TOP + 12}" fill="#d00">peak</text>')
    parts += _axes(top, y)
    parts += _legend(series.categories)
    parts.append("</svg>")
    return "".join(parts)


def _areas(series: Series, points: list[tuple[int, list[int], int]], x: Scale, y: Scale) -> list[str]:
    """One polygon per category, stacked in category order."""
    shapes = []
    below = [0] * len(points)
    for category, colour in enumerate(COLOURS[: len(series.categories)]):
        above = [low + state[category] for low, (_, state, _) in zip(below, points, strict=True)]
        if any(state[category] for _, state, _ in points):
            upper = [f"{x(i):.1f},{y(v):.1f}" for (i, _, _), v in zip(points, above, strict=True)]
            lower = [f"{x(i):.1f},{y(v):.1f}" for (i, _, _), v in zip(points, below, strict=True)]
            shapes.append(f'<polygon points="{" ".join(upper + lower[::-1])}" fill="{colour}" fill-opacity="0.85"/>')
        below = above
    return shapes


def _axes(top: int, y: Scale) -> list[str]:
    """The memory axis (five steps) and the event axis's name."""
    parts = [f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" stroke="#000"/>']
    for step in range(5):
        value = top * step / 4
        height = y(value)
        parts.append(f'<text x="{LEFT - 6}" y="{height + 4:.1f}" text-anchor="end">{_gib(value)}</text>')
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - 20}" y1="{height:.1f}" y2="{height:.1f}" stroke="#eee"/>')
    parts.append(
        f'<text x="{(LEFT + WIDTH) / 2:.0f}" y="{HEIGHT - 12}" text-anchor="middle">'
        "allocator events (storages made and freed), in order; dashed: reserved</text>"
    )
    return parts


def _legend(categories: tuple[str, ...]) -> list[str]:
    parts, left = [], LEFT
    for name, colour in zip(categories, COLOURS, strict=False):
        parts.append(f'<rect x="{left}" y="{HEIGHT + 4}" width="12" height="12" fill="{colour}"/>')
        parts.append(f'<text x="{left + 16}" y="{HEIGHT + 14}">{html.escape(name)}</text>')
        left += 28 + 7 * len(name)  # about a character's width each at 12px
    return parts


def page(all_series: list[Series]) -> str:
    """An HTML page: each picture, and a table of the bytes by category at its peak."""
    body = []
    for series in all_series:
        body.append(svg(series))
        points = columns(series)
        at_peak = max(points, key=lambda point: sum(point[1]))[1] if points else [0] * len(series.categories)
        rows = "".join(
            f"<tr><td>{html.escape(name)}</td><td>{_gib(nbytes)}</td></tr>"
            for name, nbytes in zip(series.categories, at_peak, strict=True)
        )
        body.append(f"<table><tr><th>at the peak</th><th></th></tr>{rows}</table>")
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>Simulated GPU memory</title>'
        "<style>body{font-family:sans-serif} td,th{padding:2px 12px;text-align:left}</style></head><body>"
        f"<h1>Simulated GPU memory over the step of the peak</h1>{''.join(body)}</body></html>"
    )


def write(path: str, all_series: list[Series]) -> None:
    """Write the pictures to `path`: an HTML page, or (``.svg``) the pictures one above the other."""
    if path.lower().endswith(".svg"):
        pictures = [svg(series) for series in all_series]
        text = pictures[0] if len(pictures) == 1 else _stacked(pictures)
    else:
        text = page(all_series)
    with open(path, "w", encoding="utf-8") as out:
        out.write(text)


def _stacked(pictures: list[str]) -> str:
    height = HEIGHT + 48
    inner = "".join(f'<g transform="translate(0,{i * height})">{p}</g>' for i, p in enumerate(pictures))
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height * len(pictures)}">{inner}</svg>'
