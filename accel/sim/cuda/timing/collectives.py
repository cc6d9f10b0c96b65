"""How long an NCCL collective takes: NCCL's own cost model (its `src/graph/tuning.cc`, v2.30), reduced to
rings and trees over NVLink within a node and one NIC per GPU between nodes.

NCCL times each algorithm and protocol as `latency + bytes / bandwidth` and runs the fastest; so do we.
A ring's latency is a base plus one hop per step (NVLink hops within a node, network hops where the ring
crosses nodes); its bus bandwidth is the slowest link a step crosses: NVLink within a node, and between
nodes the node's NICs together (each ring crosses a node boundary through its own NIC), so
`min(nvlink, gpus_per_node * nic)`. The bus bandwidth turns into the collective's own by nccl-tests'
factors: an all-reduce moves `2(n-1)/n` of its buffer over each link, all-gather and reduce-scatter
`(n-1)/n` of the whole gathered buffer. All-to-all is a send and a receive per peer; send/recv one hop.
"""

from __future__ import annotations

import dataclasses
import math

# tuning.cc's latencies (microseconds), per protocol [LL, LL128, Simple]
_BASE = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4)}
_NVLINK_HOP = {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)}
_NET_HOP = {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)}
_NET_OVERHEAD = (1.0, 1.0, 3.0)  # per network-ring step (Intel hosts)
#: the share of the raw bus bandwidth each protocol carries (LL: half its lines are flags; LL128: 120 of 128 B)
_PROTOCOL_SHARE = (0.5, 0.92, 1.0)
#: LL's ceiling (GB/s): one Hopper node, and across 2 / more nodes
_LL_MAX_ONE_NODE, _LL_MAX_TWO_NODES, _LL_MAX_MORE = 141.0, 39.0, 20.4
#: NCCL counts an NVLink 4 link as 20.6 GB/s of the 25 it is rated for (topo.h), an NVLink 3 link 20 of 25
NVLINK_USABLE = 0.824
#: what a point-to-point transfer costs to start (NCCL has no model for it: a ring base and one hop, estimated)
_P2P_LATENCY_US = 8.4 + 3.4
_P2P_NET_LATENCY_US = 8.4 + 14.0


@dataclasses.dataclass(frozen=True)
class Links:
    """The links between a group's GPUs: NVLink (or PCIe) within a node, a NIC per GPU between nodes."""

    intra_gbps: float  # GB/s one direction, per GPU, within a node
    nic_gbps: float  # GB/s one direction, per GPU's NIC
    gpus_per_node: int = 8


def _spread(n: int, links: Links) -> tuple[int, int]:
    """(GPUs of the group per node, nodes the group spans), the group's ranks filling nodes in order."""
    per_node = max(1, min(links.gpus_per_node, n))
    return per_node, math.ceil(n / per_node)


def bottleneck(n: int, links: Links) -> str:
    """The link that bounds a collective over `n` ranks: "nvlink" within a node (or where NVLink is slower than
    the node's NICs together), else "network"; collectives bound by the same link share it."""
    per_node, nodes = _spread(n, links)
    if nodes == 1 or (per_node > 1 and links.intra_gbps <= per_node * links.nic_gbps):
        return "nvlink"
    return "network"


def _ring(name: str, nbytes: float, n: int, links: Links, protocol: int) -> float:
    per_node, nodes = _spread(n, links)
    bus = links.intra_gbps if nodes == 1 else min(links.intra_gbps, per_node * links.nic_gbps)
    if nodes > 1 and per_node == 1:
        bus = links.nic_gbps
    steps = 2 * (n - 1) if name == "all_reduce" else n - 1
    crossing = 0 if nodes == 1 else (2 * (nodes - 1) if name == "all_reduce" else nodes - 1)
    intra = _NVLINK_HOP["ring"][protocol]
    if nodes > 1:
        intra = max(intra, _NET_OVERHEAD[protocol])
    inter = (_NET_HOP["tree"] if per_node == 1 else _NET_HOP["ring"])[protocol]
    latency = _BASE["ring"][protocol] + (steps - crossing) * intra + crossing * inter
    bandwidth = bus * _PROTOCOL_SHARE[protocol]
    if protocol == 0:
        bandwidth = min(bandwidth, _ll_ceiling(nodes))
    algorithm_bw = bandwidth * n / steps
    if name == "all_reduce" and protocol == 2 and nodes > 1:
        latency *= 1.4  # tuning.cc's "plateau" of large multi-node all-reduces
    return latency + nbytes / (1000 * algorithm_bw)


def _tree(nbytes: float, n: int, links: Links, protocol: int) -> float:
    """A double binary tree all-reduce: a chain within each node, trees across nodes."""
    per_node, nodes = _spread(n, links)
    bus = links.intra_gbps if nodes == 1 else min(links.intra_gbps, per_node * links.nic_gbps)
    hops = (per_node - 1) * _NVLINK_HOP["tree"][protocol] + math.log2(nodes) * _NET_HOP["tree"][protocol]
    latency = _BASE["tree"][protocol] + 2 * hops
    bandwidth = 0.92 * bus
    if protocol == 0:
        bandwidth = min(bandwidth / 3.8, _ll_ceiling(nodes))
    elif protocol == 1:
        bandwidth *= 7 / 9 if nodes == 1 else 120 / 128
    return latency + nbytes / (1000 * 0.5 * bandwidth)


def _ll_ceiling(nodes: int) -> float:
    return _LL_MAX_ONE_NODE if nodes == 1 else _LL_MAX_TWO_NODES if nodes == 2 else _LL_MAX_MORE


def seconds(name: str, nbytes: float, n: int, links: Links) -> float:
    """How long collective `name` takes over `n` ranks.

    `name`: "all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send".
    `nbytes`: the buffer as nccl-tests counts it: all-reduce, broadcast, reduce and send its one buffer;
    all-gather and reduce-scatter the whole gathered buffer (n times a rank's part); all-to-all what one
    rank sends in all.
    """
    if n <= 1 or nbytes <= 0:
        return _BASE["ring"][0] * 1e-6 if n > 1 else 0.0
    per_node, nodes = _spread(n, links)
    if name == "all_to_all":
        within, across = nbytes * (per_node - 1) / n, nbytes * (n - per_node) / n
        latency = _P2P_LATENCY_US if nodes == 1 else _P2P_NET_LATENCY_US
        return 1e-6 * (latency + max(within / (1000 * links.intra_gbps), across / (1000 * links.nic_gbps)))
    if name == "send":
        if nodes == 1:
            return 1e-6 * (_P2P_LATENCY_US + nbytes / (1000 * links.intra_gbps))
        return 1e-6 * (_P2P_NET_LATENCY_US + nbytes / (1000 * links.nic_gbps))
    if name in ("broadcast", "reduce"):
        # a pipelined ring: every byte crosses each link once, after one hop per rank
        bus = links.intra_gbps if nodes == 1 else min(links.intra_gbps, per_node * links.nic_gbps)
        hop = (_NET_HOP if nodes > 1 else _NVLINK_HOP)["ring"][2]
        return 1e-6 * (_BASE["ring"][2] + n * hop + nbytes / (1000 * bus))
    times = [_ring(name, nbytes, n, links, protocol) for protocol in range(3)]
    if name == "all_reduce":
        times += [_tree(nbytes, n, links, protocol) for protocol in range(3)]
    return 1e-6 * min(times)


def bus_bandwidth(name: str, nbytes: float, n: int, seconds_taken: float) -> float:
    """nccl-tests' bus bandwidth (GB/s) of a collective of `nbytes` over `n` ranks that took `seconds_taken`."""
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    return nbytes / seconds_taken / 1e9 * factor.get(name, (n - 1) / n if name == "all_to_all" else 1.0)
