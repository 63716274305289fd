"""Host CPU topology (vmsandbox.host.numa): cpulists, and the CPUs of each NUMA node from sysfs."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.gpu import passthrough
from vmsandbox.host.numa import format_cpuset, host_cpus_by_node, parse_cpulist


def test_parse_and_format_cpulists() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("\n") == []
    assert parse_cpulist("5") == [5]
    assert format_cpuset([11, 0, 1, 2, 3, 8, 10, 3]) == "0-3,8,10-11"
    assert format_cpuset([]) == ""
    for bad in ("3-1", "a", "1-2-3", "-1"):
        with pytest.raises(ValueError):
            parse_cpulist(bad)


@given(st.sets(st.integers(0, 300)))
def test_cpuset_round_trip(cpus: set[int]) -> None:
    assert parse_cpulist(format_cpuset(cpus)) == sorted(cpus)


def test_host_cpus_by_node_from_sysfs(tmp_path: Path) -> None:
    nodes = tmp_path / "devices" / "system" / "node"
    for name, cpulist in [("node0", "0-3,8-11\n"), ("node1", "4-7,12-15\n"), ("node10", "\n")]:
        (nodes / name).mkdir(parents=True)
        (nodes / name / "cpulist").write_text(cpulist)
    (nodes / "possible").write_text("0-1,10\n")
    (nodes / "power").mkdir()
    assert host_cpus_by_node(tmp_path) == {
        0: [0, 1, 2, 3, 8, 9, 10, 11],
        1: [4, 5, 6, 7, 12, 13, 14, 15],
        10: [],
    }
    assert host_cpus_by_node(tmp_path / "nowhere") == {}


def test_host_cpus_by_node_on_this_host() -> None:
    found = passthrough.host_cpus_by_node()  # the name the manager uses
    online = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert sorted(cpu for cpus in found.values() for cpu in cpus) == online
