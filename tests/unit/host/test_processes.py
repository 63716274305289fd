"""Host processes holding /dev/nvidiaN (vmsandbox.host.processes), on a fake /proc."""

from __future__ import annotations

import os
from pathlib import Path

from vmsandbox.host.processes import device_node_holders, nvidia_minors, process_name


def make_proc(root: Path) -> Path:
    gpus = root / "driver" / "nvidia" / "gpus"
    for bdf, text in [
        ("0000:41:00.0", "Model: \t\t NVIDIA H100 80GB HBM3\nDevice Minor: \t 2\n"),
        ("0000:42:00.0", "Model: \t\t NVIDIA H100 80GB HBM3\nDevice Minor: \t 3\n"),
        ("0000:43:00.0", "Model: \t\t no minor line\n"),
        ("0000:44:00.0", "Device Minor: \t unknown\n"),
    ]:
        (gpus / bdf).mkdir(parents=True)
        (gpus / bdf / "information").write_text(text)
    for pid, comm, targets in [
        ("100", "python3", ["/dev/nvidia2", "/dev/nvidiactl", "socket:[1234]"]),
        ("200", "nvidia-persiste", ["/dev/nvidia2", "/dev/nvidia3"]),
    ]:
        (root / pid / "fd").mkdir(parents=True)
        (root / pid / "comm").write_text(comm + "\n")
        for fd, target in enumerate(targets):
            os.symlink(target, root / pid / "fd" / str(fd))
    (root / "300").mkdir()  # gone before its fd directory was read
    (root / "sys").mkdir()
    return root


def test_minors_from_driver_information(tmp_path: Path) -> None:
    proc = str(make_proc(tmp_path))
    bdfs = ["0000:41:00.0", "0000:42:00.0", "0000:43:00.0", "0000:44:00.0", "0000:45:00.0"]
    assert nvidia_minors(bdfs, proc) == {"0000:41:00.0": 2, "0000:42:00.0": 3}


def test_holders_of_device_nodes(tmp_path: Path) -> None:
    proc = str(make_proc(tmp_path))
    holders = device_node_holders(["/dev/nvidia2", "/dev/nvidia3", "/dev/nvidia4"], proc)
    assert holders == {"/dev/nvidia2": {100, 200}, "/dev/nvidia3": {200}, "/dev/nvidia4": set()}
    assert device_node_holders([], proc) == {}
    assert device_node_holders(["/dev/nvidia0"], str(tmp_path / "absent")) == {
        "/dev/nvidia0": set()
    }


def test_process_names(tmp_path: Path) -> None:
    proc = str(make_proc(tmp_path))
    assert process_name(200, proc) == "nvidia-persiste"
    assert process_name(300, proc) is None
