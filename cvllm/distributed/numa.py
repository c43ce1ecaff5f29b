"""NUMA placement of a rank: pin its CPU affinity to the NUMA node of its GPU.

Called once per rank by the composition root (``cli.py``), right after the launch
environment is known and before the model, the KV cache or any pinned host buffer is
allocated: Linux places a page on the node of the CPU that first touches it, so buffers
allocated after pinning live next to the GPU. The node comes from ``MAP_NUMA_NODE``
(candle-vllm's variable: a comma list indexed by local rank, e.g. ``0,0,1,1``) or, without
it, from the GPU's PCI device in sysfs (``/sys/bus/pci/devices/<bus id>/numa_node``). A
CPU run without ``MAP_NUMA_NODE`` is not pinned. Each rank logs the returned line.

``sysfs_root`` parameters exist so tests can point at a fake tree.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import List, Mapping, Optional

from cvllm.config import ConfigError

logger = logging.getLogger("cvllm.distributed")

MAX_NUMA_NODE = 1023
MAX_CPU = 1 << 16
_MAX_SYSFS_BYTES = 1 << 16


def parse_map_numa_node(text: str) -> List[int]:
    """``"0,0,1,1"`` -> ``[0, 0, 1, 1]`` (node of each local rank)."""
    nodes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) > MAX_NUMA_NODE:
            raise ConfigError(
                f"MAP_NUMA_NODE={text!r}: {part!r} is not a NUMA node number "
                "(expected a comma list like 0,0,1,1, one per local rank)"
            )
        nodes.append(int(part))
    return nodes


def parse_cpulist(text: str) -> List[int]:
    """Linux cpulist syntax: ``"0-3,8-11"``, ``"5"``, ``"0-7:2"`` (stride), ``""``."""
    cpus: List[int] = []
    text = text.strip()
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            span, _, stride = part.partition(":")
            lo, dash, hi = span.partition("-")
            first, last = int(lo), int(hi) if dash else int(lo)
            step = int(stride) if stride else 1
        except ValueError:
            raise ValueError(f"bad cpulist entry {part!r} in {text!r}") from None
        if not 0 <= first <= last < MAX_CPU or step < 1:
            raise ValueError(f"bad cpulist range {part!r} in {text!r}")
        cpus.extend(range(first, last + 1, step))
    return sorted(set(cpus))


def _read_small(path: Path) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_SYSFS_BYTES).decode("ascii", "replace")
    except OSError:
        return None


def node_cpus(node: int, sysfs_root: str = "/sys") -> List[int]:
    """CPUs of NUMA node ``node`` from ``/sys/devices/system/node/node<N>/cpulist``."""
    text = _read_small(Path(sysfs_root, "devices/system/node", f"node{node}", "cpulist"))
    if text is None:
        raise ConfigError(f"NUMA node {node} does not exist on this machine "
                          f"(no {sysfs_root}/devices/system/node/node{node}/cpulist)")
    return parse_cpulist(text)


def normalize_bus_id(bus_id: str) -> str:
    """nvidia-smi's ``00000000:1B:00.0`` -> sysfs's ``0000:1b:00.0``."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:
        parts.insert(0, "0")
    if len(parts) != 3:
        raise ValueError(f"bad PCI bus id {bus_id!r}")
    domain, bus, dev_fn = parts
    return f"{int(domain, 16):04x}:{bus}:{dev_fn}"


def gpu_bus_id(index: int) -> Optional[str]:
    """PCI bus id of CUDA device ``index`` (torch's properties, else nvidia-smi)."""
    try:
        import torch

        props = torch.cuda.get_device_properties(index)
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except (AttributeError, RuntimeError, AssertionError):
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader",
                              "-i", str(index)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    return normalize_bus_id(line) if line else None


def pci_numa_node(bus_id: str, sysfs_root: str = "/sys") -> Optional[int]:
    """The node sysfs gives a PCI device; None when unknown (-1) or absent."""
    text = _read_small(Path(sysfs_root, "bus/pci/devices", bus_id, "numa_node"))
    try:
        node = int(text.strip()) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def numa_node_for(local_rank: int, device, *, environ: Optional[Mapping[str, str]] = None,
                  sysfs_root: str = "/sys") -> Optional[int]:
    """This rank's NUMA node: ``MAP_NUMA_NODE[local_rank]``, else its GPU's sysfs node,
    else None (a CPU run without MAP_NUMA_NODE, or no NUMA information)."""
    environ = os.environ if environ is None else environ
    text = environ.get("MAP_NUMA_NODE", "").strip()
    if text:
        nodes = parse_map_numa_node(text)
        if not 0 <= local_rank < len(nodes):
            raise ConfigError(f"MAP_NUMA_NODE={text!r} names {len(nodes)} local ranks; "
                              f"local rank {local_rank} has no entry")
        return nodes[local_rank]
    dev_type, index = _device(device)
    if dev_type != "cuda":
        return None
    bus_id = gpu_bus_id(index)
    return pci_numa_node(bus_id, sysfs_root) if bus_id else None


def _device(device) -> tuple[str, int]:
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        return kind, int(idx or 0)
    return device.type, device.index or 0


def pin_to_numa_node(local_rank: int, device, *, environ: Optional[Mapping[str, str]] = None,
                     sysfs_root: str = "/sys") -> str:
    """Set this process's CPU affinity to its NUMA node's CPUs (those it may use) and
    return the line to log."""
    import psutil

    node = numa_node_for(local_rank, device, environ=environ, sysfs_root=sysfs_root)
    if node is None:
        return f"local rank {local_rank} ({device}): no NUMA information: not pinned"
    proc = psutil.Process()
    allowed = set(proc.cpu_affinity())
    cpus = [c for c in node_cpus(node, sysfs_root) if c in allowed]
    if not cpus:
        return (f"local rank {local_rank} ({device}): NUMA node {node} has none of this "
                f"process's allowed CPUs: not pinned")
    proc.cpu_affinity(cpus)
    return (f"local rank {local_rank} ({device}): pinned to NUMA node {node} "
            f"({len(cpus)} CPUs: {format_cpulist(cpus)})")


def format_cpulist(cpus: List[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(parts)
