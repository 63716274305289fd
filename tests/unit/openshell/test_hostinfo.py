"""The host document (openshell/hostinfo.py) with GPU custody: each GPU's state and reason, the
capacity without a quarantined GPU, and the last sanitizes' seconds, on the in-memory
hypervisor and the HGX fake host's GPUs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.inventories import discover_hosts

from vmsandbox.gpu.custody.state import Custody
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.host.model import Inventory
from vmsandbox.lock import host_lock
from vmsandbox.openshell.caller import Caller
from vmsandbox.openshell.hostinfo import describe
from vmsandbox.sandbox import custody
from vmsandbox.sandbox.manager import SandboxManager


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    return replace(discover_hosts({"hgx": ("hgx_h100", case)})["hgx"], fabric=())


class BoardManager(SandboxManager):
    board: Inventory

    def gpus(self, in_use: Mapping[str, str] | None = None) -> Inventory:
        return custody.shown(self.config, self.board)


def test_gpus_carry_their_custody_and_a_quarantined_one_is_no_capacity(
    tmp_path: Path, board: Inventory
) -> None:
    BoardManager.board = board
    config = unit_config(tmp_path)
    config.state_dir.mkdir()
    bdf = board.gpus[0].bdf
    with host_lock(config.lock_path):
        CustodyStore(config).put(Custody(bdf, state="quarantined", reason="AER: fatal"), "test")
    CustodyStore(config).log({"bdf": bdf, "ok": True, "steps": {"reset": 0.5}}, "sanitize.jsonl")
    with BoardManager(config, hypervisor=FakeHypervisor(), reconcile=False) as manager:
        document = describe(manager, Caller(os.geteuid()))
    shown = {gpu["bdf"]: gpu for gpu in document["gpus"]}
    assert (shown[bdf]["custody"], shown[bdf]["custody_reason"]) == ("quarantined", "AER: fatal")
    assert document["capacity"]["total"]["1"] == len(board.gpus) - 1
    assert document["sanitize"] == [{"ok": True, "steps": {"reset": 0.5}}]
