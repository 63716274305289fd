"""What a host can still place (gpu/capacity.py) when some GPUs' custody is not free: a GPU out
until it is well is no capacity, a GPU being sanitized is capacity that is not free yet."""

from __future__ import annotations

from dataclasses import replace

import pytest
from framework.inventories import HGX, discover_hosts

from vmsandbox.gpu.capacity import measure
from vmsandbox.host.model import Inventory


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Inventory:
    case = {"use_nvml": False, "proc_root": str(tmp_path_factory.mktemp("proc"))}
    return replace(discover_hosts({"hgx": ("hgx_h100", case)})["hgx"], fabric=())


def with_state(inventory: Inventory, bdf: str, state: str) -> Inventory:
    gpus = tuple(replace(g, custody=state) if g.bdf == bdf else g for g in inventory.gpus)
    return replace(inventory, gpus=gpus)


def test_a_quarantined_gpu_is_no_capacity_and_a_sanitizing_one_is_not_free(
    board: Inventory,
) -> None:
    whole = measure(board, None, 16)
    out = measure(with_state(board, HGX[0], "quarantined"), None, 16)
    assert (whole.total[1], out.total[1], out.free[1]) == (8, 7, 7)
    assert out.models_total != whole.models_total
    busy = measure(with_state(board, HGX[0], "sanitizing"), None, 16)
    assert (busy.total[1], busy.free[1]) == (8, 7)
