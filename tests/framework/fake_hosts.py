"""Helpers for the host inventory tests: a fake NVML and discovery on a fake umockdev host.

``probe(host, cases)`` runs this file under ``umockdev-run`` with the host's device file, so
pyudev and plain sysfs reads see the fake host; each case is one ``discover()`` call and comes
back as ``{"inventory": Inventory.to_dict(), "table": render_table(...)}``. One subprocess per
host keeps the tests fast (about 0.2 s each).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vmsandbox.host.model import Bar, FabricDevice, Gpu, Inventory
from vmsandbox.host.nvml import NvmlError

# Not framework.paths: this file also runs as a script, under umockdev-run, without tests/ on
# its path.
HOSTS = Path(__file__).resolve().parents[1] / "fixtures" / "hosts"
MIB = 1024 * 1024
# umockdev-run builds the fake sysfs file by file: on tmpfs a 72-device host loads in 0.3 s,
# on this machine's disk in 2 s.
TESTBED_DIR = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
CHUNK = 16


class FakeNvml:
    """NvmlApi from a plain description, for tests.

    ``spec``: ``{"init_error": str}`` to fail at init, ``{"count_error": str}`` to fail when
    counting devices, or ``{"devices": [...]}`` where each device is
    ``{"bus_id", "name", "memory_mib", "uuid", "pids"}`` (``"memory_mib"`` and ``"pids"`` may
    be an error string) or ``{"error": str}``.
    """

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.calls: list[str] = []

    def _device(self, index: int) -> dict[str, Any]:
        device = self.spec["devices"][index]
        if "error" in device:
            raise NvmlError(device["error"])
        return device

    def init(self) -> None:
        self.calls.append("init")
        if "init_error" in self.spec:
            raise NvmlError(self.spec["init_error"])

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def device_count(self) -> int:
        if "count_error" in self.spec:
            raise NvmlError(self.spec["count_error"])
        return len(self.spec["devices"])

    def bus_id(self, index: int) -> str:
        return self._device(index)["bus_id"]

    def name(self, index: int) -> str:
        return self._device(index)["name"]

    def memory_total(self, index: int) -> int:
        memory = self._device(index)["memory_mib"]
        if isinstance(memory, str):
            raise NvmlError(memory)
        return memory * MIB

    def uuid(self, index: int) -> str:
        return self._device(index)["uuid"]

    def running_pids(self, index: int) -> list[int]:
        pids = self._device(index)["pids"]
        if isinstance(pids, str):
            raise NvmlError(pids)
        return pids


@contextlib.contextmanager
def umockdev_run(host: str) -> Iterator[tuple[list[str], dict[str, str]]]:
    """``umockdev-run`` argv prefix and environment that load fake host ``host``.

    umockdev-run parses a device file in time quadratic in its size (2 s for the 200-device
    host), so the file is handed over in chunks of 16 devices: 0.4 s.
    """
    devices = (HOSTS / f"{host}.umockdev").read_text().strip().split("\n\n")
    with tempfile.TemporaryDirectory(dir=TESTBED_DIR) as chunks:
        argv = ["umockdev-run"]
        for start in range(0, len(devices), CHUNK):
            chunk = Path(chunks) / f"{start:04d}.umockdev"
            chunk.write_text("\n\n".join(devices[start : start + CHUNK]) + "\n")
            argv += ["--device", str(chunk)]
        env = {**os.environ, "TMPDIR": TESTBED_DIR} if TESTBED_DIR else dict(os.environ)
        yield [*argv, "--"], env


def probe(host: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``discover()`` once per case on fake host ``host`` (a ``*.umockdev`` file name).

    A case may set ``in_use``, ``use_nvml``, ``proc_root`` and ``nvml`` (a FakeNvml spec).
    """
    with umockdev_run(host) as (argv, env):
        result = subprocess.run(
            [*argv, sys.executable, __file__],
            input=json.dumps(cases),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
        )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def inventory_from_dict(data: dict[str, Any]) -> Inventory:
    """An ``Inventory`` back from ``Inventory.to_dict()`` (what ``probe`` returns per case)."""
    host = data["host"]
    gpus = tuple(
        Gpu(
            **{
                **gpu,
                **{key: tuple(gpu[key]) for key in ("group_members", "companions", "reasons")},
                "companion_ids": tuple(tuple(pair) for pair in gpu["companion_ids"]),
                "bars": tuple(Bar(**bar) for bar in gpu["bars"]),
                "drm_cards": tuple(gpu["drm_cards"]),
            }
        )
        for gpu in data["gpus"]
    )
    return Inventory(
        gpus=gpus,
        fabric=tuple(FabricDevice(**device) for device in data["fabric"]),
        iommu=host["iommu"],
        pci_devices=host["pci_devices"],
        nvml=host["nvml"],
        notes=tuple(host["notes"]),
        unified_memory_mib=host["unified_memory_mib"],
    )


def _main() -> None:
    from vmsandbox.host import discover, render_table

    results = []
    for case in json.load(sys.stdin):
        inventory = discover(
            case.get("in_use"),
            use_nvml=case.get("use_nvml", True),
            proc_root=case.get("proc_root", "/proc"),
            nvml=FakeNvml(case["nvml"]) if "nvml" in case else None,
        )
        results.append({"inventory": inventory.to_dict(), "table": render_table(inventory)})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    _main()
