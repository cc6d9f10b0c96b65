"""The caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``) as torch 2.13 reads them.

A real CUDA process reads its allocator settings when CUDA starts (its first use of a GPU):
``PYTORCH_CUDA_ALLOC_CONF`` if set, else ``PYTORCH_ALLOC_CONF`` (c10/cuda/CUDAAllocatorConfig.h,
`CUDAAllocatorConfig::instance`; c10/core/AllocatorConfig.cpp, `AcceleratorAllocatorConfig::instance`,
which also accepts ``PYTORCH_HIP_ALLOC_CONF`` in between). `torch.cuda.memory._set_allocator_settings(...)`
(torch's ``_accelerator_setAllocatorSettings``) changes them while the process runs. A simulated GPU
rank does the same: `start` reads the environment when CUDA starts in the rank, `set_at_run_time`
takes the run-time calls (`accel.sim.cuda.memory.allocator` routes torch's to it).

The text is a list of ``key:value`` pairs separated by commas, a list value in brackets
(``roundup_power2_divisions:[256:4,>:1]``); spaces are dropped. What the simulated allocator does
with each setting (`accel.sim.cuda.memory.allocator`):

* ``expandable_segments:True``: one segment per pool that grows by pages (2 MiB in the small pool,
  ``large_segment_size`` in the large one) and gives whole free pages back on `empty_cache`;
* ``max_split_size_mb:N`` (at least ``large_segment_size_mb``): cached blocks of N MiB or more are
  never split, and serve only requests of N MiB or more that leave less than
  ``max_non_split_rounding_mb`` unused;
* ``roundup_power2_divisions``: requests rounded up to one of N steps between two powers of two;
* ``garbage_collection_threshold:F`` (0 < F < 1, with a memory fraction set): before reserving
  more, free cached whole segments, the least recently reused first, down to F of the allowed memory;
* ``large_segment_size_mb:N`` (more than 10): the segment that serves requests of 1 to 10 MiB;
* ``per_process_memory_fraction:F``: the fraction the allocators start with.

Settings of pinned host memory, of the lock and of CUDA graphs are checked and kept, with no
effect here; ``backend:cudaMallocAsync`` is not simulated (memory is counted as the native
allocator counts it, with a warning). Invalid settings raise what torch raises, with its words.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import warnings
from collections.abc import Callable

from accel.sim.cuda.gpus.cards import MiB

#: what torch's settings hold when "unlimited" (`std::numeric_limits<size_t>::max()`)
SIZE_MAX = (1 << 64) - 1
K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
#: the default size of the segments (and, expandable, the pages) of the large pool
K_LARGE_BUFFER = 20 << 20
#: roundup_power2_divisions holds one setting per power of two from 1 MiB to 64 GiB
INTERVALS = 16

#: the variables CUDA's own settings are read from at start, in order (the first set wins) ...
CUDA_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
#: ... and the common settings (c10/core/AllocatorConfig.cpp also accepts HIP's name)
COMMON_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

#: keys of the settings every accelerator shares (c10/core/AllocatorConfig.cpp, `getMutableKeys`)
COMMON_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
)
#: keys CUDA adds (c10/cuda/CUDAAllocatorConfig.h, `getKeys`, torch 2.13)
CUDA_KEYS = (
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)
ALL_KEYS = frozenset(COMMON_KEYS + CUDA_KEYS)
#: the most threads the pinned allocator registers with (CUDAAllocatorConfig.h)
MAX_REGISTER_THREADS = 128


@dataclasses.dataclass
class AllocatorSettings:
    """The settings in force in a process; the defaults are torch's."""

    expandable_segments: bool = False
    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: list[int] = dataclasses.field(default_factory=lambda: [0] * INTERVALS)
    large_segment_size: int = K_LARGE_BUFFER
    per_process_memory_fraction: float = 1.0
    backend: str = "native"
    #: settings checked and kept without an effect on the simulated GPU (pinned memory, the lock, graphs)
    kept: dict[str, object] = dataclasses.field(default_factory=dict)
    #: the last text read (`torch._C._accelerator_getAllocatorSettings`)
    text: str = ""

    @property
    def plain(self) -> bool:
        """Whether the allocator follows its default rules (its fast path): nothing set changes them."""
        return (
            not self.expandable_segments
            and self.max_split_size == SIZE_MAX
            and self.garbage_collection_threshold == 0.0
            and self.large_segment_size == K_LARGE_BUFFER
            and max(self.roundup_power2_divisions) <= 1
        )

    def divisions(self, size: int) -> int:
        """The roundup_power2_divisions setting for a request of `size` bytes (by its power of two)."""
        index = min(max(size.bit_length() - 1 - 20, 0), INTERVALS - 1)
        return self.roundup_power2_divisions[index]

    def round_size(self, size: int) -> int:
        """A request as the allocator rounds it: 512 bytes at least, then a division of its power of two
        where roundup_power2_divisions asks it (CUDACachingAllocator.cpp, `round_size`), else 512-byte steps."""
        if size < K_MIN_BLOCK:
            return K_MIN_BLOCK
        divisions = self.divisions(size)
        if divisions > 1 and size > K_MIN_BLOCK * divisions:
            return next_division(size, divisions)
        return K_MIN_BLOCK * ((size + K_MIN_BLOCK - 1) // K_MIN_BLOCK)

    def allocation_size(self, size: int) -> int:
        """The segment the allocator asks the driver for to serve a (rounded) request (`get_allocation_size`)."""
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return self.large_segment_size
        return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)

    @property
    def max_split_stat(self) -> int:
        """`memory_stats()["max_split_size"]`: the setting as a signed 64-bit number (-1: unlimited)."""
        return self.max_split_size if self.max_split_size < 1 << 63 else self.max_split_size - (1 << 64)


def next_division(size: int, divisions: int) -> int:
    """`size` rounded up to the next of `divisions` equal steps between its two powers of two
    (`roundup_power2_next_division`): 1200 with 4 divisions of 1024..2048 gives 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


# -- the text, as torch's ConfigTokenizer reads it ------------------------------------------------------


def _internal_assert(condition: str, where: str, message: str) -> RuntimeError:
    """torch's TORCH_INTERNAL_ASSERT failure, which is what a malformed settings text meets."""
    return RuntimeError(f'{condition} INTERNAL ASSERT FAILED at "{where}", please report a bug to PyTorch. {message}')


class _Tokens:
    """The text cut at ',', ':', '[' and ']' (each kept as a token), spaces dropped (c10's ConfigTokenizer)."""

    def __init__(self, text: str) -> None:
        self.items = [item for item in re.split(r"([,:\[\]])", "".join(text.split())) if item]

    def __len__(self) -> int:
        return len(self.items)

    def at(self, i: int) -> str:
        if i >= len(self.items):
            raise _internal_assert(
                "i < config_.size()", "c10/core/AllocatorConfig.h", "Index out of bounds in ConfigTokenizer"
            )
        return self.items[i]

    def size_t(self, i: int) -> int:
        return _stoull(self.at(i))

    def double(self, i: int) -> float:
        return _stod(self.at(i))

    def boolean(self, i: int) -> bool:
        token = self.at(i)
        if token not in ("True", "False"):
            raise ValueError(f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{token}'")
        return token == "True"

    def skip_key(self, i: int) -> int:
        """The index of the value of the key at `i` (of its closing ']' for a list)."""
        self.at(i + 1)  # the ':' (torch checks only that a token is there)
        i += 2
        if self.at(i) != "[":
            return i
        i += 1
        while i < len(self.items) and self.items[i] != "]":
            i += 1
        if i >= len(self.items):
            raise _internal_assert(
                "i < config_.size()",
                "c10/core/AllocatorConfig.h",
                "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
            )
        return i


_INTEGER = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:inf(?:inity)?|nan|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)", re.IGNORECASE)


def _stoull(token: str) -> int:
    """C++'s std::stoull: the leading integer (a '-' wraps around), ValueError / IndexError as torch maps them."""
    match = _INTEGER.match(token)
    if match is None:
        raise ValueError("stoull")
    value = int(match.group())
    if abs(value) > SIZE_MAX:
        raise IndexError("stoull")
    return value % (1 << 64)


def _stod(token: str) -> float:
    """C++'s std::stod: the leading number; out of a double's range is an IndexError (std::out_of_range)."""
    match = _FLOAT.match(token)
    if match is None:
        raise ValueError("stod")
    value = float(match.group())
    text = match.group().lower().lstrip("+-")
    if not text.startswith(("inf", "nan")) and (value in (float("inf"), float("-inf")) or _underflows(value, text)):
        raise IndexError("stod")
    return value


def _underflows(value: float, text: str) -> bool:
    # strtod reports ERANGE for a nonzero number too small for a double (it rounds to 0 or a subnormal)
    return abs(value) < 2.2250738585072014e-308 and any(digit in "123456789" for digit in text.split("e")[0])


# -- the settings every accelerator shares (c10/core/AllocatorConfig.cpp, `parseArgs`) ---------------------


def _parse_common(tokens: _Tokens, settings: AllocatorSettings, unknown: str | None) -> None:
    """Apply the common keys of `tokens` (the others are CUDA's); `unknown`: the name unknown keys are refused in.

    As torch does: max_split_size, roundup_power2_divisions and garbage_collection_threshold go
    back to their defaults unless given; large_segment_size_mb is read first (the others are
    checked against it) and, like expandable_segments, keeps its value unless given.
    """
    settings.max_split_size = SIZE_MAX
    settings.roundup_power2_divisions = [0] * INTERVALS
    settings.garbage_collection_threshold = 0.0
    i = 0
    while i < len(tokens):
        if tokens.items[i] == "large_segment_size_mb":
            i = _large_segment_size(tokens, i, settings)
        i += 1
    settings.max_non_split_rounding_size = settings.large_segment_size
    _apply(tokens, _COMMON_PARSERS, settings, unknown)


def _after_value(tokens: _Tokens, i: int) -> int:
    """Past the ',' after a value (torch steps over whatever token is there) and onto the next key."""
    if i + 1 < len(tokens):
        i += 1
    return i + 1


def _large_segment_size(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    value = tokens.size_t(i + 2)
    least = K_MIN_LARGE_ALLOC // MiB
    if value <= least:
        raise ValueError(f"CachingAllocator option large_segment_size_mb must be > {least} MB")
    settings.large_segment_size = min(value, SIZE_MAX // MiB) * MiB
    return i + 2


def _at_least_large_segment(tokens: _Tokens, i: int, settings: AllocatorSettings, option: str) -> tuple[int, int]:
    """A size in MiB that may not be below large_segment_size_mb (max_split_size_mb, max_non_split_rounding_mb)."""
    tokens.at(i + 1)
    value = tokens.size_t(i + 2)
    least = settings.large_segment_size // MiB
    if value < least:
        raise ValueError(f"CachingAllocator option {option} too small, must be >= {least}")
    return i + 2, min(value, SIZE_MAX // MiB) * MiB


def _max_split_size(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    i, settings.max_split_size = _at_least_large_segment(tokens, i, settings, "max_split_size_mb")
    return i


def _max_non_split_rounding(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    i, settings.max_non_split_rounding_size = _at_least_large_segment(tokens, i, settings, "max_non_split_rounding_mb")
    return i


def _garbage_collection_threshold(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    value = tokens.double(i + 2)
    if not 0.0 < value < 1.0:
        raise ValueError("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
    settings.garbage_collection_threshold = value
    return i + 2


def _expandable_segments(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    settings.expandable_segments = tokens.boolean(i + 2)
    return i + 2


def _kept_bool(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    settings.kept[tokens.items[i]] = tokens.boolean(i + 2)
    return i + 2


def _kept_megabytes(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    settings.kept[tokens.items[i]] = min(tokens.size_t(i + 2), SIZE_MAX // MiB) * MiB
    return i + 2


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _roundup_power2_divisions(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    """One number for every interval, or a list ``[MB:divisions, ..., >:divisions]`` (`parseRoundUpPower2Divisions`)."""
    tokens.at(i + 1)
    i += 2
    divisions = settings.roundup_power2_divisions
    if tokens.at(i) != "[":
        value = tokens.size_t(i)
        if not _power_of_two(value):
            raise ValueError("For roundups, the divisions has to be power of 2 ")
        divisions[:] = [value] * INTERVALS
        return i
    first, last = True, 0
    i += 1
    while i < len(tokens) and tokens.items[i] != "]":
        boundary_at = i
        tokens.at(i + 1)
        i += 2
        value = tokens.size_t(i)
        if value != 0 and not _power_of_two(value):
            raise ValueError("For roundups, the divisions has to be power of 2 or 0 to disable roundup ")
        if tokens.items[boundary_at] == ">":
            divisions[last + 1 :] = [value] * (INTERVALS - last - 1)
        else:
            last = _one_interval(tokens.size_t(boundary_at), value, divisions, first)
            first = False
        if tokens.at(i + 1) != "]":
            tokens.at(i + 1)
            i += 1
        i += 1
    if i >= len(tokens):
        raise _internal_assert(
            "i < tokenizer.size()",
            "c10/core/AllocatorConfig.cpp",
            "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
        )
    return i


def _one_interval(boundary: int, value: int, divisions: list[int], first: bool) -> int:
    """``MB:divisions`` of a list: the interval of `boundary` MiB (and, the first time, all below it); its index."""
    if not _power_of_two(boundary):
        raise ValueError("For roundups, the intervals have to be power of 2 ")
    index = min(boundary.bit_length() - 1, INTERVALS - 1)
    if first:
        divisions[:index] = [value] * index
    divisions[index] = value
    return index


_COMMON_PARSERS = {
    "large_segment_size_mb": lambda tokens, i, settings: tokens.skip_key(i),  # read before the others
    "max_split_size_mb": _max_split_size,
    "max_non_split_rounding_mb": _max_non_split_rounding,
    "garbage_collection_threshold": _garbage_collection_threshold,
    "roundup_power2_divisions": _roundup_power2_divisions,
    "expandable_segments": _expandable_segments,
    "pinned_use_background_threads": _kept_bool,
    "pinned_max_round_threshold_mb": _kept_megabytes,
    "pinned_max_cached_size_mb": _kept_megabytes,
}


# -- CUDA's own settings (c10/cuda/CUDAAllocatorConfig.cpp, `parseArgs`) -------------------------------------


def _parse_cuda(tokens: _Tokens, settings: AllocatorSettings, unknown: str | None) -> None:
    """Apply CUDA's keys of `tokens` (the common ones are skipped); `unknown`: the name unknown keys are refused in."""
    _apply(tokens, _CUDA_PARSERS, settings, unknown)


def _apply(
    tokens: _Tokens, parsers: dict[str, Callable[..., int]], settings: AllocatorSettings, unknown: str | None
) -> None:
    """Each key of `tokens` that `parsers` knows, parsed into `settings`; the others skipped, or refused
    naming `unknown` (the config's name) when no allocator knows them."""
    i = 0
    while i < len(tokens):
        key = tokens.at(i)
        parse = parsers.get(key)
        if parse is not None:
            i = parse(tokens, i, settings)
        else:
            if unknown is not None and key not in ALL_KEYS:
                raise ValueError(f"Unrecognized key '{key}' in {unknown} allocator config.")
            i = tokens.skip_key(i)
        i = _after_value(tokens, i)


def _backend(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    """``backend:native|cudaMallocAsync``: which allocator CUDA uses, fixed when it starts."""
    tokens.at(i + 1)
    value = tokens.at(i + 2)
    if value not in ("native", "cudaMallocAsync"):
        raise ValueError("Unknown allocator backend, options are native and cudaMallocAsync")
    settings.backend = value
    return i + 2


def _register_threads(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    value = tokens.size_t(i + 2)
    if not _power_of_two(value):
        raise ValueError(f"Number of register threads has to be power of 2, got {value}")
    if value > MAX_REGISTER_THREADS:
        raise ValueError(
            f"Number of register threads should be less than or equal to {MAX_REGISTER_THREADS}, got {value}"
        )
    settings.kept["pinned_num_register_threads"] = value
    return i + 2


def _reserve_segment_size(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    value = tokens.size_t(i + 2)
    if value == 0:
        raise ValueError("Pinned reserve segment size has to be greater than 0")
    settings.kept["pinned_reserve_segment_size_mb"] = value
    return i + 2


def _memory_fraction(tokens: _Tokens, i: int, settings: AllocatorSettings) -> int:
    tokens.at(i + 1)
    value = tokens.double(i + 2)
    if not 0.0 <= value <= 1.0:
        raise ValueError("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
    settings.per_process_memory_fraction = value
    return i + 2


_CUDA_PARSERS = {
    "backend": _backend,
    "release_lock_on_cudamalloc": _kept_bool,
    "release_lock_on_hipmalloc": _kept_bool,
    "pinned_use_cuda_host_register": _kept_bool,
    "pinned_use_hip_host_register": _kept_bool,
    "pinned_num_register_threads": _register_threads,
    "pinned_reserve_segment_size_mb": _reserve_segment_size,
    "graph_capture_record_stream_reuse": _kept_bool,
    "per_process_memory_fraction": _memory_fraction,
    "pinned_free_catch_all": _kept_bool,
    "throw_on_cudamalloc_oom": _kept_bool,
}


# -- the settings of this process -------------------------------------------------------------------------

#: the settings in force (replaced, not changed, when they change: allocators hold the object they follow)
_current: list[AllocatorSettings] = [AllocatorSettings()]
#: run-time settings given before CUDA started, applied when it starts (`start`)
_pending: list[str] = []


def current() -> AllocatorSettings:
    """The settings in force in this process."""
    return _current[0]


def snapshot_settings(settings: AllocatorSettings) -> dict[str, object]:
    """The settings as a memory snapshot lists them (`torch.cuda.memory._snapshot()["allocator_settings"]`)."""
    kept = settings.kept
    return {
        "PYTORCH_CUDA_ALLOC_CONF": settings.text,
        "max_split_size": settings.max_split_size,
        "garbage_collection_threshold": settings.garbage_collection_threshold,
        "expandable_segments": settings.expandable_segments,
        "pinned_num_register_threads": kept.get("pinned_num_register_threads", 1),
        "release_lock_on_cudamalloc": kept.get("release_lock_on_cudamalloc", False),
        "pinned_use_cuda_host_register": kept.get("pinned_use_cuda_host_register", False),
        "graph_capture_record_stream_reuse": kept.get("graph_capture_record_stream_reuse", False),
        # keyed by the power of two (in MiB) each interval starts at, as torch's
        "roundup_power2_divisions": {str(1 << i): n for i, n in enumerate(settings.roundup_power2_divisions)},
    }


def _first_set(names: tuple[str, ...]) -> str | None:
    return next((os.environ[name] for name in names if name in os.environ), None)


def from_environment() -> AllocatorSettings:
    """The settings CUDA starts with: CUDA's keys then the common ones, each from the first variable set."""
    settings = AllocatorSettings()
    cuda_text, common_text = _first_set(CUDA_ENV), _first_set(COMMON_ENV)
    if cuda_text is not None:
        _parse_cuda(_Tokens(cuda_text), settings, "CUDA")
        if settings.backend == "cudaMallocAsync":
            warnings.warn(
                "accel.sim: backend:cudaMallocAsync is not simulated: simulated GPUs count memory as "
                "the native caching allocator does",
                stacklevel=2,
            )
            settings.backend = "native"
    if common_text is not None:
        _parse_common(_Tokens(common_text), settings, None)
        settings.text = common_text
    return settings


def start() -> AllocatorSettings:
    """CUDA starts in this process: the settings of the environment, then those given at run time before."""
    settings = from_environment()
    pending, _pending[:] = list(_pending), []
    for text in pending:
        settings = parsed(text, settings)
    _current[0] = settings
    return settings


def parsed(text: str, settings: AllocatorSettings) -> AllocatorSettings:
    """`settings` changed by run-time `text`, as `_set_allocator_settings(text)` changes them (common keys first)."""
    new = copy.deepcopy(settings)
    tokens = _Tokens(text)
    _parse_common(tokens, new, "Accelerator")
    _parse_cuda(tokens, new, None)
    if new.backend != "native":  # the allocator was chosen when torch loaded: the native one, here
        raise _internal_assert(
            "tokenizer[i] == get()->name()",
            "c10/cuda/CUDAAllocatorConfig.cpp",
            f"Allocator backend parsed at runtime != allocator backend parsed at load time, {new.backend} != native",
        )
    new.text = text
    return new


def set_at_run_time(text: str, started: bool) -> AllocatorSettings:
    """`torch._C._accelerator_setAllocatorSettings(text)`: the new settings (kept for CUDA's start if not `started`)."""
    if not isinstance(text, str):
        raise TypeError(f"_accelerator_setAllocatorSettings(): argument 'env' must be str, not {type(text).__name__}")
    settings = parsed(text, current())
    if not started:
        _pending.append(text)
    _current[0] = settings
    return settings
