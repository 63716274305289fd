"""The NVSwitch fabric's test pieces: the fake fmpm (tests/fixtures/fmpm), its state folder
(``fm``), the HGX H100 board as umockdev discovery sees it (``hgx``), and inventories with GPUs
marked held. The fixtures are registered for every test by tests/conftest.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from framework.inventories import discover_hosts
from framework.paths import FIXTURES

from vmsandbox.gpu.fabric import state
from vmsandbox.gpu.fabric.fmpm import Fmpm
from vmsandbox.gpu.fabric.mode import SHARED, FabricMode
from vmsandbox.gpu.fabric.state import Fabric
from vmsandbox.host.model import Inventory

FAKE_FMPM = FIXTURES / "fmpm" / "fmpm"


@pytest.fixture(scope="module")
def hgx(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    return discover_hosts({"hgx": ("hgx_h100", case)})["hgx"]


def shared(table_owner: Fmpm, inventory: Inventory) -> Fabric:
    table = table_owner.list()
    return Fabric(FabricMode(SHARED, ("x",)), table, state.owners(table, inventory))


def held(inventory: Inventory, **holders: str) -> Inventory:
    """``inventory`` with GPUs (bus -> domain, e.g. b41="dom") held by domains."""
    by_bdf = {f"0000:{bus[1:]}:00.0": name for bus, name in holders.items()}
    return replace(
        inventory,
        gpus=tuple(replace(gpu, in_use_by=by_bdf.get(gpu.bdf)) for gpu in inventory.gpus),
    )


@pytest.fixture
def fm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake FM's state folder (H100 table, nothing active)."""
    folder = tmp_path / "fm"
    folder.mkdir()
    monkeypatch.setenv("FAKE_FMPM_STATE", str(folder))
    return folder


def fmpm() -> Fmpm:
    return Fmpm(binary=str(FAKE_FMPM))
