"""What simulated ranks print, relayed live to the parent's terminal.

Ranks write to per-rank files (see `accel.sim.runtime.worker`); the parent reads what is new
every few milliseconds and hands it to an `OutputRelay`, which writes it on the
parent's stdout/stderr:

* whole lines at once, prefixed ``[rank N] `` (unless a single rank is shown);
* carriage-return updates (tqdm, rich progress bars) as they come, each redrawn in
  place behind its prefix, so that a bar moves live instead of arriving glued to one
  line at the end;
* only the ranks asked for (``accel launch --local_ranks_filter 0``, as torchrun's).

A line another source interrupts is ended first, so that two ranks never write on the
same terminal line. This module is free of torch (it runs in the parent).
"""

from __future__ import annotations

import codecs
import dataclasses
import re
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

#: control sequences a progress bar sends at the start of a line (erase the line, hide or
#: show the cursor): they go before our prefix, or they would erase it or split it from the text
_LEADING_CONTROLS = re.compile(r"^(?:\x1b\[[0-2]?K|\x1b\[\?25[hl])+")
_TERMINATORS = re.compile(r"[\r\n]")


@dataclasses.dataclass(frozen=True)
class OutputSettings:
    """How rank output is shown: which ranks (None: all) and whether lines get a rank prefix.

    `prefix=None` prefixes lines unless exactly one rank is shown.
    """

    ranks: frozenset[int] | None = None
    prefix: bool | None = True


_settings = OutputSettings()


def configure(ranks: Iterable[int] | None = None, prefix: bool | None = True) -> None:
    """Set how the pools started from now on show their ranks' output (process-wide)."""
    global _settings
    _settings = OutputSettings(frozenset(ranks) if ranks is not None else None, prefix)


def settings() -> OutputSettings:
    """The current output settings."""
    return _settings


def parse_ranks(text: str) -> frozenset[int]:
    """Ranks from torchrun's filter syntax: "0", "0,2", "1-3" or a mix ("0,4-5")."""
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        try:
            if dash:
                low, high = int(first), int(last)
                if low > high:
                    raise ValueError
                ranks.update(range(low, high + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise ValueError(f"rank filter {text!r}: {part!r} is not a rank or a range such as 0-3") from None
    if any(rank < 0 for rank in ranks):
        raise ValueError(f"rank filter {text!r}: ranks are 0 or more")
    return frozenset(ranks)


class _Source:
    """One rank's stdout or stderr, as the relay tracks it."""

    __slots__ = ("decoder", "held", "mid_line", "after_cr")

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        #: the start of a line not ended yet, kept until its end arrives
        self.held = ""
        #: the terminal shows an unfinished line of this source (a progress bar)
        self.mid_line = False
        #: the last thing this source wrote was "\r": its next text redraws the line
        self.after_cr = False


class OutputRelay:
    """Writes the output of `world_size` ranks on `streams` (default: our stdout, stderr)."""

    def __init__(
        self,
        world_size: int,
        streams: tuple[TextIO | None, TextIO | None] | None = None,
        options: OutputSettings | None = None,
        names: Sequence[int] | None = None,
    ) -> None:
        options = options or _settings
        #: the rank each source is shown as (`names[k]` for source k: ranks that stand in for others)
        self._names = list(names) if names is not None else list(range(world_size))
        self._shown = options.ranks if options.ranks is not None else frozenset(self._names)
        shown_here = [rank for rank in self._names if rank in self._shown]
        self._prefixed = options.prefix if options.prefix is not None else len(shown_here) != 1
        self._streams = streams
        self._sources: dict[tuple[int, int], _Source] = {}
        #: the source whose unfinished line the terminal shows, if any
        self._open: tuple[int, int] | None = None

    def shows(self, rank: int) -> bool:
        """Whether this rank's output is shown."""
        return rank in self._shown

    def feed(self, rank: int, stream: int, data: bytes, final: bool = False) -> None:
        """Relay what source `rank` wrote on `stream` (0: stdout, 1: stderr); `final`: nothing more will come."""
        rank = self._names[rank]
        if not self.shows(rank):
            return
        source = self._sources.setdefault((rank, stream), _Source())
        text = source.held + source.decoder.decode(data, final=final)
        source.held = ""
        out: list[str] = []
        position = 0
        for match in _TERMINATORS.finditer(text):
            self._piece(rank, stream, source, text[position : match.start()], out)
            if match.group() == "\n":
                self._end_line(rank, stream, source, out)
            else:
                source.after_cr = True
            position = match.end()
        rest = text[position:]
        if rest:
            if source.after_cr or source.mid_line or final:
                self._piece(rank, stream, source, rest, out)
            else:
                source.held = rest  # a line whose end is still to come
        if final and source.mid_line:
            self._end_line(rank, stream, source, out)
        self._write(stream, "".join(out))

    def _piece(self, rank: int, stream: int, source: _Source, piece: str, out: list[str]) -> None:
        if not piece:
            return
        if self._open is not None and self._open != (rank, stream):
            self._close_other(out, stream)
        prefix = f"[rank {rank}] " if self._prefixed else ""
        if source.mid_line and not source.after_cr:
            out.append(piece)
        else:
            controls = _LEADING_CONTROLS.match(piece)
            lead = controls.group() if controls else ""
            out.append(("\r" if source.after_cr else "") + lead + prefix + piece[len(lead) :])
        source.after_cr = False
        source.mid_line = True
        self._open = (rank, stream)

    def _end_line(self, rank: int, stream: int, source: _Source, out: list[str]) -> None:
        if source.mid_line:
            if self._open == (rank, stream):
                out.append("\n")
                self._open = None
        elif not source.after_cr:
            # An empty line of its own.
            if self._open is not None:
                self._close_other(out, stream)
            out.append((f"[rank {rank}] " if self._prefixed else "") + "\n")
        source.mid_line = False
        source.after_cr = False

    def _close_other(self, out: list[str], stream: int) -> None:
        """End the unfinished line another source left, before writing anything else."""
        assert self._open is not None
        other_rank, other_stream = self._open
        if other_stream == stream:
            out.append("\n")
        else:
            self._write(other_stream, "\n")
        # Its next text starts a new line of its own, prefix included.
        self._sources[(other_rank, other_stream)].mid_line = False
        self._open = None

    def _write(self, stream: int, text: str) -> None:
        if not text:
            return
        streams = self._streams if self._streams is not None else (sys.stdout, sys.stderr)
        target = streams[stream]
        if target is None:
            return
        target.write(text)
        target.flush()
