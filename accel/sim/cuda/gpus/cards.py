"""Which GPU a simulated GPU is: a table of common cards and the figures CUDA reports for them.

`--gpu NAME` (`accel launch`), `@distributed_test(gpu=NAME)`, `accel.sim.launch(..., gpu=NAME)`
and the ``ACCEL_SIM_GPU`` environment variable name a card of `CARDS` (case and punctuation
do not matter: "h100", "A100-40GB", "rtx4090") or describe one:
``"memory=24GiB,capability=8.9[,name=My GPU][,sms=60]"``. What a card is decides what
`torch.cuda.get_device_properties` reports, the memory the simulated allocator may reserve
before it raises out-of-memory, and what depends on the compute capability (bf16 support,
the attention kernels).

Torch-free: `accel launch --help` and argument checks read it without importing torch.
"""

from __future__ import annotations

import dataclasses
import os
import re

#: the environment variable naming the card of every simulated GPU of a rank
GPU_ENV = "ACCEL_SIM_GPU"
MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """One kind of card, with the figures `cudaGetDeviceProperties` gives for it."""

    name: str
    total_memory: int  # bytes, as `total_memory` reports them (what the driver leaves to CUDA)
    major: int
    minor: int
    multi_processor_count: int
    l2_cache_size: int = 40 * MiB
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 65536
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_block_optin: int = 48 * 1024
    shared_memory_per_multiprocessor: int = 64 * 1024
    warp_size: int = 32
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    #: memory the CUDA context and driver take on the card, outside PyTorch's counters
    #: (a few hundred MiB on a real card; it shows in `mem_get_info` and out-of-memory)
    context_memory: int = 512 * MiB
    #: more memory outside PyTorch's counters as a process uses the GPU, read off a real H200
    #: (torch 2.11, CUDA 13): the kernels loaded at the first launch, cuBLAS's own at the first
    #: matrix product, and each NCCL communicator (the process's first, then each further one)
    kernels_memory: int = 96468992
    cublas_memory: int = 69206016
    nccl_memory: tuple[int, int] = (585105408, 406847488)

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


def _card(name: str, mib: float, cc: tuple[int, int], sms: int, l2_mib: float, smem_kib: int) -> GpuModel:
    """A table entry: `smem_kib` is the shared memory per SM; a block may opt in to all but 1 KiB of it."""
    threads = 1536 if cc in ((8, 6), (8, 9)) else 1024 if cc == (7, 5) else 2048
    return GpuModel(
        name=name,
        total_memory=int(mib * MiB),
        major=cc[0],
        minor=cc[1],
        multi_processor_count=sms,
        l2_cache_size=int(l2_mib * MiB),
        max_threads_per_multi_processor=threads,
        shared_memory_per_block_optin=(smem_kib - 1) * 1024 if cc >= (8, 0) else smem_kib * 1024,
        shared_memory_per_multiprocessor=smem_kib * 1024,
    )


#: the cards `--gpu` knows, by their short names; total memory as CUDA reports it on a typical driver
CARDS: dict[str, GpuModel] = {
    "H100": _card("NVIDIA H100 80GB HBM3", 81089, (9, 0), 132, 50, 228),
    "H100-PCIE": _card("NVIDIA H100 PCIe", 81080, (9, 0), 114, 50, 228),
    # read off a real H200 (torch 2.11, driver 580): total_memory 150109880320 B, 60 MB of L2, a 527 MiB context
    "H200": dataclasses.replace(_card("NVIDIA H200", 143155.9375, (9, 0), 132, 60, 228), context_memory=552402944),
    "A100-80GB": _card("NVIDIA A100-SXM4-80GB", 81050, (8, 0), 108, 40, 164),
    "A100-40GB": _card("NVIDIA A100-SXM4-40GB", 40354, (8, 0), 108, 40, 164),
    "L40S": _card("NVIDIA L40S", 45458, (8, 9), 142, 96, 100),
    "L4": _card("NVIDIA L4", 22559, (8, 9), 58, 48, 100),
    "A10G": _card("NVIDIA A10G", 22723, (8, 6), 80, 6, 100),
    "RTX4090": _card("NVIDIA GeForce RTX 4090", 24217, (8, 9), 128, 72, 100),
    "RTX3090": _card("NVIDIA GeForce RTX 3090", 24260, (8, 6), 82, 6, 100),
    "T4": _card("Tesla T4", 15102, (7, 5), 40, 4, 64),
    "V100": _card("Tesla V100-SXM2-16GB", 16160, (7, 0), 80, 6, 96),
    "V100-32GB": _card("Tesla V100-SXM2-32GB", 32501, (7, 0), 80, 6, 96),
}
#: other spellings people use for the same cards
ALIASES = {
    "H10080GB": "H100",
    "H100SXM": "H100",
    "A100": "A100-80GB",
    "A10080GB": "A100-80GB",
    "A10040GB": "A100-40GB",
    "4090": "RTX4090",
    "3090": "RTX3090",
    "V10016GB": "V100",
    "V10032GB": "V100-32GB",
}
#: the card a simulated GPU is when nothing says otherwise
DEFAULT_GPU = "H100"

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _key(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


def parse_size(text: str) -> int:
    """Bytes in "24GiB", "24 GB", "512MiB", "1e9"-free plain integers ("2000000000"); binary units either way."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read {text!r} as a memory size; write it as 24GiB, 512MiB or a number of bytes")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit if unit != "B" else ""])


def _custom(spec: str) -> GpuModel:
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep or not value.strip():
            raise ValueError(f"--gpu {spec!r}: {part!r} is not key=value (keys: memory, capability, name, sms)")
        fields[key.strip().lower()] = value.strip()
    unknown = sorted(set(fields) - {"memory", "capability", "name", "sms"})
    if unknown:
        raise ValueError(f"--gpu {spec!r}: unknown key {unknown[0]!r} (keys: memory, capability, name, sms)")
    if "memory" not in fields:
        raise ValueError(f"--gpu {spec!r}: a custom GPU needs memory=..., e.g. memory=24GiB,capability=8.9")
    capability = fields.get("capability", "8.0").lower().removeprefix("sm_").replace("_", ".")
    if "." not in capability and len(capability) == 2:
        capability = f"{capability[0]}.{capability[1]}"
    try:
        major, minor = (int(x) for x in capability.split("."))
    except ValueError:
        raise ValueError(f"--gpu {spec!r}: capability must read like 8.9 or sm_89") from None
    memory = parse_size(fields["memory"])
    if memory <= 0:
        raise ValueError(f"--gpu {spec!r}: memory must be positive")
    sms = int(fields.get("sms", "80"))
    name = fields.get("name", f"Simulated GPU ({memory / GiB:.0f}GB, sm_{major}{minor})")
    card = _card(name, memory // MiB, (major, minor), sms, 40, 100 if (major, minor) >= (8, 6) else 164)
    # a small custom card (a test's) keeps most of its memory for tensors: a small context, nothing more
    return dataclasses.replace(
        card,
        total_memory=memory,
        context_memory=min(card.context_memory, memory // 16),
        kernels_memory=0,
        cublas_memory=0,
        nccl_memory=(0, 0),
    )


def resolve(spec: str | GpuModel | None = None) -> GpuModel:
    """The card `spec` names (a `CARDS` name or alias, or a custom description).

    None: the card ``ACCEL_SIM_GPU`` names, else the default.
    """
    if isinstance(spec, GpuModel):
        return spec
    if spec is None:
        spec = os.environ.get(GPU_ENV) or DEFAULT_GPU
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a GPU is named by a string such as 'H100' or 'memory=24GiB,capability=8.9', got {spec!r}")
    if "=" in spec:
        return _custom(spec)
    keys = {_key(name): name for name in CARDS}
    key = _key(spec)
    name = keys.get(key) or ALIASES.get(key)
    if name is None:
        raise ValueError(
            f"unknown GPU {spec!r}; choose one of {', '.join(CARDS)} or describe one as "
            "'memory=24GiB,capability=8.9[,name=...][,sms=...]'"
        )
    return CARDS[name]


def check(spec: str | None) -> str | None:
    """`spec` unchanged once it names a card (raises ValueError naming the choices otherwise)."""
    if spec is not None:
        resolve(spec)
    return spec
