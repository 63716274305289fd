"""Which NVSwitch fabric model this host runs, from the inventory and Fabric Manager's config.

Fabric Manager reads ``FABRIC_MODE`` from its config file (``fabricmanager.cfg``, by default
``/usr/share/nvidia/nvswitch/fabricmanager.cfg``): 0 bare metal or full passthrough (the
default when the key is absent), 1 shared NVSwitch, 2 vGPU. What vmsandbox makes of it:

- ``none``: no NVSwitch in the inventory; GPUs are placed one by one (``allocator.select``).
- ``full-passthrough``: NVSwitches, and no FM config here or ``FABRIC_MODE=0``. FM is not
  running for guests on this host: a guest with every GPU and every NVSwitch runs FM itself,
  or a guest takes one GPU without NVLink.
- ``shared-nvswitch``: ``FABRIC_MODE=1``. FM (on this host or in a service VM) owns the
  NVSwitches and offers fixed GPU partitions through ``fmpm``.
- ``vgpu``: ``FABRIC_MODE=2``, for NVIDIA vGPU; whole-GPU passthrough does not work with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmsandbox.errors import FailedPrecondition
from vmsandbox.host.model import Inventory

DEFAULT_FM_CONFIG = Path("/usr/share/nvidia/nvswitch/fabricmanager.cfg")
NONE, FULL_PASSTHROUGH, SHARED, VGPU = "none", "full-passthrough", "shared-nvswitch", "vgpu"
_BY_VALUE = {0: FULL_PASSTHROUGH, 1: SHARED, 2: VGPU}
_KEY = re.compile(r"^\s*FABRIC_MODE\s*=\s*(\S*)\s*$")


@dataclass(frozen=True)
class FabricMode:
    """The model (one of the names above), the NVSwitches, and where the model came from."""

    kind: str
    switches: tuple[str, ...] = ()
    source: str = ""
    fabric_mode: int | None = None  # FABRIC_MODE as read, if it was

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.kind,
            "nvswitches": list(self.switches),
            "source": self.source,
            "fabric_mode": self.fabric_mode,
        }


def read_fabric_mode(text: str, source: str = "fabricmanager.cfg") -> int:
    """``FABRIC_MODE`` of a fabricmanager.cfg text (0 when absent, as FM defaults)."""
    value = 0
    for line in text.splitlines():
        match = _KEY.match(line)
        if match:
            try:
                value = int(match[1])
            except ValueError:
                value = -1
            if value not in _BY_VALUE:
                raise FailedPrecondition(
                    f"{source}: FABRIC_MODE={match[1]!r} is not 0, 1 or 2",
                    details={"field": "FABRIC_MODE", "value": match[1], "file": source},
                )
    return value


def detect(inventory: Inventory, fm_config: Path = DEFAULT_FM_CONFIG) -> FabricMode:
    """The fabric model of the host whose ``inventory`` this is (see the module docstring)."""
    switches = tuple(device.bdf for device in inventory.fabric)
    if not switches:
        return FabricMode(NONE, source="no NVSwitch on this host")
    try:
        text = fm_config.read_text()
    except FileNotFoundError:
        return FabricMode(
            FULL_PASSTHROUGH,
            switches,
            f"{fm_config} does not exist: no Fabric Manager is set up on this host",
        )
    except OSError as exc:
        raise FailedPrecondition(
            f"Fabric Manager's config {fm_config} cannot be read: {exc.strerror or exc}",
            details={"field": "fabric_manager_config", "value": str(fm_config)},
        ) from exc
    value = read_fabric_mode(text, str(fm_config))
    return FabricMode(_BY_VALUE[value], switches, f"FABRIC_MODE={value} in {fm_config}", value)
