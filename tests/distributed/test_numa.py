"""NUMA placement: MAP_NUMA_NODE, sysfs parsing against a fake tree, and real pinning."""

import psutil
import pytest

from cvllm.config import ConfigError
from cvllm.distributed import numa


def _fake_sysfs(tmp_path, nodes, pci=None):
    for n, cpulist in nodes.items():
        d = tmp_path / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for bus_id, node in (pci or {}).items():
        d = tmp_path / "bus/pci/devices" / bus_id
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return str(tmp_path)


@pytest.mark.parametrize("text, cpus", [
    ("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]),
    ("5", [5]),
    ("0-7:2", [0, 2, 4, 6]),
    ("", []),
    (" 2,0-1\n", [0, 1, 2]),
])
def test_parse_cpulist(text, cpus):
    assert numa.parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a-b", "3-1", "1-", "0-3:0", "99999999"])
def test_parse_cpulist_rejects(text):
    with pytest.raises(ValueError):
        numa.parse_cpulist(text)


def test_format_cpulist():
    assert numa.format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_map_numa_node():
    env = {"MAP_NUMA_NODE": "0,0,1,1"}
    assert [numa.numa_node_for(r, "cuda:0", environ=env) for r in range(4)] == [0, 0, 1, 1]
    assert numa.numa_node_for(2, "cpu", environ=env) == 1  # also on a CPU run
    with pytest.raises(ConfigError, match="local rank 4 has no entry"):
        numa.numa_node_for(4, "cuda:0", environ=env)
    for bad in ("0,x", "0,,1", "-1", "0;1", "5000"):
        with pytest.raises(ConfigError, match="is not a NUMA node number"):
            numa.numa_node_for(0, "cuda:0", environ={"MAP_NUMA_NODE": bad})


def test_cpu_run_without_map_is_not_pinned():
    assert numa.numa_node_for(0, "cpu", environ={}) is None
    line = numa.pin_to_numa_node(0, "cpu", environ={})
    assert line.endswith("no NUMA information: not pinned")


def test_sysfs_parsing(tmp_path):
    root = _fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"},
                       pci={"0000:1b:00.0": 1, "0000:3d:00.0": -1})
    assert numa.node_cpus(1, root) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert numa.pci_numa_node("0000:1b:00.0", root) == 1
    assert numa.pci_numa_node("0000:3d:00.0", root) is None  # -1: firmware does not say
    assert numa.pci_numa_node("0000:99:00.0", root) is None  # no such device
    with pytest.raises(ConfigError, match="NUMA node 2 does not exist"):
        numa.node_cpus(2, root)


def test_gpu_node_from_sysfs(tmp_path, monkeypatch):
    root = _fake_sysfs(tmp_path, {0: "0-1"}, pci={"0000:1b:00.0": 0})
    monkeypatch.setattr(numa, "gpu_bus_id", lambda i: "0000:1b:00.0" if i == 1 else None)
    assert numa.numa_node_for(0, "cuda:1", environ={}, sysfs_root=root) == 0
    assert numa.numa_node_for(0, "cuda:0", environ={}, sysfs_root=root) is None


def test_normalize_bus_id():
    assert numa.normalize_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert numa.normalize_bus_id("1b:00.0") == "0000:1b:00.0"
    with pytest.raises(ValueError):
        numa.normalize_bus_id("garbage")


def test_pin_on_this_machine_and_restore():
    proc = psutil.Process()
    before = proc.cpu_affinity()
    try:
        line = numa.pin_to_numa_node(0, "cpu", environ={"MAP_NUMA_NODE": "0"})
        pinned = proc.cpu_affinity()
        assert "pinned to NUMA node 0" in line
        assert set(pinned) == set(numa.node_cpus(0)) & set(before)
    finally:
        proc.cpu_affinity(before)
    assert proc.cpu_affinity() == before


def test_pin_with_fake_node_outside_allowed_cpus(tmp_path):
    root = _fake_sysfs(tmp_path, {0: "60000-60001"})
    before = psutil.Process().cpu_affinity()
    line = numa.pin_to_numa_node(0, "cpu", environ={"MAP_NUMA_NODE": "0"}, sysfs_root=root)
    assert "not pinned" in line and psutil.Process().cpu_affinity() == before
