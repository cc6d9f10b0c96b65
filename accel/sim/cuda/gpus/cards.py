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
class Speeds:
    """How fast a card computes and moves data: the vendor's datasheet figures, dense (half the
    "with sparsity" figures NVIDIA quotes for tensor cores), in TFLOPS, TB/s and GB/s.

    `tflops` maps a kind of math to its peak: "fp8", "bf16", "fp16" (tensor cores, FP32 accumulate),
    "tf32" (tensor cores, FP32 matmuls allowed to use them), "fp32" (CUDA cores), "fp64".
    """

    tflops: tuple[tuple[str, float], ...]
    memory_tbps: float  # HBM/GDDR bandwidth
    nvlink_gbps: float = 0.0  # NVLink per GPU, one direction (0: none, peers over PCIe)
    pcie_gbps: float = 32.0  # host link, one direction (PCIe 4 x16: 32, PCIe 5 x16: 64)
    network_gbits: float = 100.0  # the NIC per GPU that a typical cluster of this card has, Gb/s
    watts: int = 0

    def peak(self, kind: str) -> float:
        """FLOP/s of `kind` ("bf16", "tf32", ...); a kind the card lacks runs at its FP32 rate."""
        table = dict(self.tflops)
        return 1e12 * table.get(kind, table["fp32"])


def _speeds(
    fp8: float, bf16: float, fp16: float, tf32: float, fp32: float, fp64: float, tbps: float, **links: float
) -> Speeds:
    kinds = (("fp8", fp8), ("bf16", bf16), ("fp16", fp16), ("tf32", tf32), ("fp32", fp32), ("fp64", fp64))
    return Speeds(tflops=tuple((k, v) for k, v in kinds if v), memory_tbps=tbps, **links)  # type: ignore[arg-type]


#: datasheet figures, dense (see docs/planning.md for the sources): H100 SXM5, H100 PCIe, H200 SXM, A100 SXM4,
#: L40S, L4, A10G, GeForce RTX 4090 / 3090 (FP16/BF16 with FP32 accumulate), T4, V100 SXM2
_HOPPER = dict(fp8=1978.9, bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9, fp64=66.9)
#: H100 NVL (the same GH100 with 132 SMs at 350-400 W), dense, from its datasheet
_HOPPER_NVL = dict(fp8=1670.5, bf16=835.5, fp16=835.5, tf32=417.5, fp32=60.0, fp64=60.0)
_A100 = dict(fp8=0.0, bf16=312.0, fp16=312.0, tf32=156.0, fp32=19.5, fp64=19.5)


def _power_capped(watts: float) -> dict[str, float]:
    """An H100 SXM held to `watts`: its sustained clocks, so its peaks, lie between the NVL's datasheet figures at
    400 W and the SXM's at 700 W; taken linearly in power (no datasheet exists for the capped card)."""
    share = (watts - 400.0) / (700.0 - 400.0)
    return {kind: round(_HOPPER_NVL[kind] + share * (_HOPPER[kind] - _HOPPER_NVL[kind]), 1) for kind in _HOPPER}


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
    #: how fast it computes and moves data (the clock of `accel.sim.cuda.timing`); an A100's when not known
    speeds: Speeds = dataclasses.field(
        default_factory=lambda: _speeds(**_A100, tbps=2.039, nvlink_gbps=300, network_gbits=200, watts=400)
    )

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


def _card(
    name: str, mib: float, cc: tuple[int, int], sms: int, l2_mib: float, smem_kib: int, speeds: Speeds | None = None
) -> GpuModel:
    """A table entry: `smem_kib` is the shared memory per SM; a block may opt in to all but 1 KiB of it."""
    threads = 1536 if cc in ((8, 6), (8, 9)) else 1024 if cc == (7, 5) else 2048
    card = GpuModel(
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
    return card if speeds is None else dataclasses.replace(card, speeds=speeds)


#: the cards `--gpu` knows, by their short names; total memory as CUDA reports it on a typical driver
CARDS: dict[str, GpuModel] = {
    "H100": _card(
        "NVIDIA H100 80GB HBM3", 81089, (9, 0), 132, 50, 228,
        _speeds(**_HOPPER, tbps=3.35, nvlink_gbps=450, pcie_gbps=64, network_gbits=400, watts=700),
    ),
    # Meta's Grand Teton hosts (most published torchtitan runs): HBM2e, 2.4 TB/s, capped at 500 W
    "H100-96GB": _card(
        "NVIDIA H100", 97280, (9, 0), 132, 50, 228,
        _speeds(**_power_capped(500), tbps=2.4, nvlink_gbps=450, pcie_gbps=64, network_gbits=400, watts=500),
    ),
    "H100-PCIE": _card(
        "NVIDIA H100 PCIe", 81080, (9, 0), 114, 50, 228,
        _speeds(fp8=1513.0, bf16=756.5, fp16=756.5, tf32=378.0, fp32=51.2, fp64=51.2, tbps=2.0,
                nvlink_gbps=300, pcie_gbps=64, network_gbits=200, watts=350),
    ),
    # read off a real H200 (torch 2.11, driver 580): total_memory 150109880320 B, 60 MB of L2, a 527 MiB context
    "H200": dataclasses.replace(
        _card("NVIDIA H200", 143155.9375, (9, 0), 132, 60, 228,
              _speeds(**_HOPPER, tbps=4.8, nvlink_gbps=450, pcie_gbps=64, network_gbits=400, watts=700)),
        context_memory=552402944,
    ),
    "A100-80GB": _card(
        "NVIDIA A100-SXM4-80GB", 81050, (8, 0), 108, 40, 164,
        _speeds(**_A100, tbps=2.039, nvlink_gbps=300, network_gbits=200, watts=400),
    ),
    "A100-40GB": _card(
        "NVIDIA A100-SXM4-40GB", 40354, (8, 0), 108, 40, 164,
        _speeds(**_A100, tbps=1.555, nvlink_gbps=300, network_gbits=200, watts=400),
    ),
    "L40S": _card(
        "NVIDIA L40S", 45458, (8, 9), 142, 96, 100,
        _speeds(fp8=733.0, bf16=362.05, fp16=362.05, tf32=183.0, fp32=91.6, fp64=0.0, tbps=0.864, watts=350),
    ),
    "L4": _card(
        "NVIDIA L4", 22559, (8, 9), 58, 48, 100,
        _speeds(fp8=242.5, bf16=121.0, fp16=121.0, tf32=60.0, fp32=30.3, fp64=0.0, tbps=0.3, watts=72),
    ),
    "A10G": _card(
        "NVIDIA A10G", 22723, (8, 6), 80, 6, 100,
        _speeds(fp8=0.0, bf16=70.0, fp16=70.0, tf32=35.0, fp32=31.2, fp64=0.0, tbps=0.6, watts=300),
    ),
    "RTX4090": _card(
        "NVIDIA GeForce RTX 4090", 24217, (8, 9), 128, 72, 100,
        _speeds(fp8=330.3, bf16=165.2, fp16=165.2, tf32=82.6, fp32=82.6, fp64=0.0, tbps=1.008, watts=450),
    ),
    "RTX3090": _card(
        "NVIDIA GeForce RTX 3090", 24260, (8, 6), 82, 6, 100,
        _speeds(fp8=0.0, bf16=71.0, fp16=71.0, tf32=35.6, fp32=35.6, fp64=0.0, tbps=0.936, nvlink_gbps=56.25,
                watts=350),
    ),
    "T4": _card(
        "Tesla T4", 15102, (7, 5), 40, 4, 64,
        _speeds(fp8=0.0, bf16=0.0, fp16=65.0, tf32=0.0, fp32=8.1, fp64=0.0, tbps=0.32, pcie_gbps=16, watts=70),
    ),
    "V100": _card(
        "Tesla V100-SXM2-16GB", 16160, (7, 0), 80, 6, 96,
        _speeds(fp8=0.0, bf16=0.0, fp16=125.0, tf32=0.0, fp32=15.7, fp64=7.8, tbps=0.9, nvlink_gbps=150,
                pcie_gbps=16, watts=300),
    ),
    "V100-32GB": _card(
        "Tesla V100-SXM2-32GB", 32501, (7, 0), 80, 6, 96,
        _speeds(fp8=0.0, bf16=0.0, fp16=125.0, tf32=0.0, fp32=15.7, fp64=7.8, tbps=0.9, nvlink_gbps=150,
                pcie_gbps=16, watts=300),
    ),
}  # fmt: skip
#: other spellings people use for the same cards
ALIASES = {
    "H10080GB": "H100",
    "H100SXM": "H100",
    "H10096GB": "H100-96GB",
    "H100HBM2E": "H100-96GB",
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
