"""`torch.cuda.Stream` and `torch.cuda.Event` on simulated GPUs: which stream is current, and events.

Work on a simulated GPU is computed when it is issued, so waits return at once and an event is
complete once recorded. Streams decide two things still: the caching allocator's pools (a freed block
stays cached for the stream it was allocated on), so each stream has an id (`Stream.sim_id`, 0 the
default stream) and `torch.cuda.stream` / `set_stream` make one current per GPU; and the simulated
clock (`accel.sim.cuda.timing`), where each stream runs its kernels in order, waits for events and
other streams as on the card, and a timing event's `elapsed_time` is simulated time.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

from accel.sim.cuda.gpus import state as cuda_state
from accel.sim.cuda.tensors import sync_debug
from accel.sim.cuda.timing import ops as timing


class Event:
    """`torch.cuda.Event`: work is computed when issued, so an event is complete once recorded.

    With the clock running, an event marks the simulated time its stream reaches it: streams that
    wait for it start no later work before, and `elapsed_time` between two is simulated time. Without
    it, recording reads the host clock (the time the work took to compute here).
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self.time: float | None = None
        #: the simulated time its stream reaches it (with the clock running)
        self.sim_time: float | None = None

    def record(self, stream: Any = None) -> None:
        self.time = time.perf_counter()
        if timing.running:
            stream = stream if stream is not None else current_stream()
            self.sim_time = timing.running[0].ready(stream.device.index, stream.sim_id)

    def wait(self, stream: Any = None) -> None:
        if timing.running and self.sim_time is not None:
            stream = stream if stream is not None else current_stream()
            timing.running[0].wait(stream.device.index, stream.sim_id, self.sim_time)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if timing.running and self.sim_time is not None:
            timing.running[0].host_waits(self.sim_time)

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event to `end_event`, as CUDA measures them (both recorded, both timing)."""
        if not (self.enable_timing and getattr(end_event, "enable_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.time is None or end_event.time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if self.sim_time is not None and end_event.sim_time is not None:
            return (end_event.sim_time - self.sim_time) * 1000.0
        return (end_event.time - self.time) * 1000.0


class Stream:
    """`torch.cuda.Stream`: a simulated GPU has one stream, in which work completes as it is issued."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = cuda_state.gpus().resolve("cuda" if device is None else device)
        self.priority = priority
        #: which stream this is, for the caching allocator's pools (each stream caches its own blocks);
        #: 0 is the default stream
        self.sim_id: int = kwargs.get("_sim_id", next(_stream_ids))

    def wait_stream(self, stream: Any) -> None:
        if timing.running:
            clock = timing.running[0]
            clock.wait(self.device.index, self.sim_id, clock.ready(stream.device.index, stream.sim_id))

    def wait_event(self, event: Any) -> None:
        event.wait(self)

    def record_event(self, event: Any = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        sync_debug.synchronizing()  # (a stream's synchronize is reported, as c10's stream_synchronize reports it)
        if timing.running:
            timing.running[0].host_waits(timing.running[0].ready(self.device.index, self.sim_id))

    def is_capturing(self) -> bool:
        return False  # no CUDA graphs on a simulated GPU

    @property
    def stream_id(self) -> int:
        return 0  # the default stream's (FSDP2 records its gradient outputs' stream by id from torch 2.15 on)

    @property
    def cuda_stream(self) -> int:
        """The stream's handle as CUDA's (`cudaStream_t`): 0 for the default stream, else one of its own."""
        return 0 if self.sim_id == 0 else (1 << 44) + self.sim_id

    @property
    def device_index(self) -> int:
        return self.device.index

    @property
    def device_type(self) -> int:
        return 1  # torch's DeviceType of CUDA

    def __enter__(self) -> Stream:
        self._outer = stream_context(self)
        self._outer.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._outer.__exit__(*exc)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.device == self.device and other.sim_id == self.sim_id

    def __hash__(self) -> int:
        return hash((self.device, self.sim_id))


_stream_ids = itertools.count(1)


def current_stream(device: Any = None) -> Stream:
    """`torch.cuda.current_stream`: the stream `torch.cuda.stream` made current on the GPU, else its default."""
    index = cuda_state.gpus().resolve("cuda" if device is None else device).index
    found = cuda_state.gpus().streams.get(index)
    return found if found is not None else Stream(index, _sim_id=0)


def set_stream(stream: Any) -> None:
    """`torch.cuda.set_stream`: make `stream` current on its GPU (None: no change)."""
    if stream is not None:
        cuda_state.gpus().streams[stream.device.index] = stream


@contextlib.contextmanager
def stream_context(stream: Any) -> Iterator[Any]:
    """`torch.cuda.stream`: `stream` is current on its GPU (and its GPU the current one) inside."""
    if stream is None:
        yield stream
        return
    gpus = cuda_state.gpus()
    before, before_device = current_stream(stream.device), gpus.current
    gpus.current = stream.device.index
    set_stream(stream)
    try:
        yield stream
    finally:
        set_stream(before)
        gpus.current = before_device
