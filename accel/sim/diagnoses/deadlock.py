"""Seeing, from the parent, that ranks wait in a collective that can no longer complete.

Each rank writes to a small board file (`accel.sim.diagnoses.collectives`) which collective it is
waiting in (its group, its number in that group), and how many collectives it entered
per group; when the call returns the board says "idle" but keeps those numbers.

The ranks still running are deadlocked when every one of them waits in a collective
(or a blocking send/recv) and none of those can complete. Collective number s of group
G can complete once every rank of G has reached it (entered s or more collectives of
G), whether that rank still runs or has finished the task; a send/recv can complete
while its peer still runs. So a rank alone in a collective its returned peers never
entered is a deadlock, and so are ranks waiting for each other in collectives of
different groups (rank 0 in the default group, rank 1 in a subgroup, each first). The
verdict also waits `SETTLE` seconds with nothing moving, as a margin for boards read
while being written.

Torch-free: the parent (pytest, `accel launch`) imports it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Any

from accel.sim import real_time

#: seconds the ranks must stay waiting, unchanged, before they are called deadlocked
SETTLE = 0.3
#: bytes of a rank's board file
BOARD_SIZE = 4096

_FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+)')


def board_path(workdir: str, rank: int) -> str:
    """The file where `rank` says which collective it waits in."""
    return os.path.join(workdir, f"rank{rank}.board")


def read_board(path: str, waiting_only: bool = True) -> dict[str, Any] | None:
    """What a rank's board says (see `accel.sim.diagnoses.collectives`) while it waits in a collective, else None.

    `waiting_only=False` reads the last call's board of an idle rank too. A board read
    while the rank rewrites it may not parse: that reads as None.
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read(BOARD_SIZE)
    except OSError:
        return None
    if not data or (waiting_only and data[0] != ord("W")):
        return None
    try:
        board = json.loads(data[1:].split(b"\0", 1)[0])
    except ValueError:
        return None
    return board if isinstance(board, dict) else None


class Watch:
    """Watches the boards of one task's ranks for a deadlock."""

    def __init__(self, world_size: int, workdir: str, task: int) -> None:
        self._paths = [board_path(workdir, rank) for rank in range(world_size)]
        self._task = task
        self._seen: dict[int, int] | None = None
        self._since = 0.0

    def stuck(self, pending: list[int], finished: set[int]) -> dict[int, dict[str, Any]]:
        """rank -> board of every pending rank, when they are deadlocked (else empty)."""
        boards = {rank: read_board(self._paths[rank]) for rank in pending}
        waiting = {rank: board for rank, board in boards.items() if board is not None}
        if len(waiting) < len(pending):
            self._seen = None
            return {}
        reached: dict[int, dict[str, int]] = {rank: board.get("seqs", {}) for rank, board in waiting.items()}
        for rank in finished:
            last = read_board(self._paths[rank], waiting_only=False)
            reached[rank] = last.get("seqs", {}) if last is not None and last.get("task") == self._task else {}
        if any(self._can_complete(board, reached, finished) for board in waiting.values()):
            self._seen = None
            return {}
        snapshot = {rank: board.get("call", 0) for rank, board in waiting.items()}
        now = real_time.monotonic()
        if snapshot != self._seen:
            self._seen, self._since = snapshot, now
            return {}
        return waiting if now - self._since >= SETTLE else {}

    @staticmethod
    def _can_complete(board: dict[str, Any], reached: dict[int, dict[str, int]], finished: set[int]) -> bool:
        ranks = board.get("ranks", ())
        if board.get("op") in ("send", "recv"):
            return not set(ranks) & finished
        group, seq = board.get("group", ""), board.get("seq", 0)
        return all(reached.get(rank, {}).get(group, 0) >= seq for rank in ranks)


def _library_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep]  # accel
    for name in ("torch", "harness"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.abspath(path) + os.sep for path in spec.submodule_search_locations)
    return tuple(dirs)


def user_location(stack: str) -> str:
    """file:line of the innermost frame of a faulthandler stack outside torch, accel and harness."""
    frames = [(m["path"], m["line"]) for m in map(_FRAME.match, stack.splitlines()) if m]
    if not frames:
        return "an unknown location"
    library = _library_dirs()
    for path, line in frames:
        if not os.path.abspath(path).startswith(library):
            return f"{path}:{line}"
    return f"{frames[0][0]}:{frames[0][1]}"


def describe_wait(board: dict[str, Any], stack: str) -> str:
    """e.g. "waits in all_reduce (its collective #3) at /path/test_x.py:12"."""
    op, count, ranks = board.get("op", "a collective"), board.get("count", "?"), board.get("ranks", [])
    if op in ("send", "recv"):
        peer = f" {'to' if op == 'send' else 'from'} rank {ranks[0]}" if len(ranks) == 1 else ""
        return f"waits in {op}{peer} at {user_location(stack)}"
    return f"waits in {op} (its collective #{count}) at {user_location(stack)}"


def ranges(ranks: Any) -> str:
    """1, 2, 3, 5 -> "1–3, 5"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans)
