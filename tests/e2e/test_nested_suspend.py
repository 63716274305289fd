"""A suspended GPU sandbox resumed onto another card of the same model, on real VFIO.

The nested GPU host with two Rage 128 Pros (``setup/nested.sh`` with
``VMSANDBOX_NESTED_CARDS=twin``, in a folder of its own): sandbox A with one card is suspended,
B is created on A's card, and A resumes onto the other card at its old guest slot, its memory
as it was (tests/framework/card_handover.py runs the step). The L1 is watched and the step run
again in a pristine L1 when the test host fails under it, as in tests/e2e/test_nested.py; the
module spends at most ``BUDGET`` seconds, L1's cold boot and snapshot not counted.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework.card_handover import (
    RAGE128P,
    HandOverRun,
    json_of,
    sandbox_of,
    suspend_onto_the_other_card,
)
from framework.nested_host import NestedHost, module_host, nested_env
from framework.paths import REPO

pytestmark = pytest.mark.timeout(3600)

NESTED = REPO / "setup" / "nested.sh"
STATE_DIR = Path(os.environ.get("VMSANDBOX_NESTED_TWIN_DIR", "/var/tmp/vmsandbox-nested-twin"))
LOG_DIR = (
    Path(os.environ.get("VMSANDBOX_NESTED_LOG_DIR", "/var/tmp/vmsandbox-nested-logs")) / "twin"
)
BUDGET = 600.0  # one step of two L2 boots (about 3 min here), and a retry


@pytest.fixture(scope="module")
def host() -> Iterator[NestedHost]:
    env = nested_env(VMSANDBOX_NESTED_CARDS="twin", VMSANDBOX_NESTED_DIR=str(STATE_DIR))
    yield from module_host(NESTED, env, STATE_DIR, LOG_DIR, BUDGET)


@pytest.fixture(scope="module")
def run(host: NestedHost) -> HandOverRun:
    return host.attempt("suspend onto the other card", lambda: suspend_onto_the_other_card(host))


def test_the_host_has_two_free_cards_of_one_model(run: HandOverRun) -> None:
    cards = run.inventory_after["gpus"]
    assert [(g["vendor_id"], g["device_id"]) for g in cards] == [RAGE128P, RAGE128P]
    assert all(g["custody"] == "free" and g["in_use_by"] is None for g in cards)


def test_suspend_gives_the_card_back_sanitized(run: HandOverRun) -> None:
    (card,) = sandbox_of(run.create_a)["gpus"]
    suspended = sandbox_of(run.suspend)
    assert suspended["state"] == "suspended" and suspended["gpus"] == []
    by_bdf = {g["bdf"]: g for g in run.inventory_suspended["gpus"]}
    assert by_bdf[card["bdf"]]["custody"] == "free"
    assert by_bdf[card["bdf"]]["in_use_by"] is None
    (entry,) = [e for e in run.sanitized if e["bdf"] == card["bdf"]]
    assert entry["ok"] and entry["notes"]["reset"] == "bus", entry


def test_another_sandbox_takes_the_suspended_ones_card(run: HandOverRun) -> None:
    (card_a,) = sandbox_of(run.create_a)["gpus"]
    (card_b,) = sandbox_of(run.create_b)["gpus"]
    assert card_b["bdf"] == card_a["bdf"]


def test_resume_takes_the_other_card_at_the_same_guest_slot(run: HandOverRun) -> None:
    (before,) = sandbox_of(run.create_a)["gpus"]
    resumed = sandbox_of(run.resume)
    assert resumed["state"] == "ready"
    (after,) = resumed["gpus"]
    assert after["bdf"] != before["bdf"]
    assert (after["vendor_id"], after["device_id"]) == RAGE128P
    slots = [g["guest_address"] for g in (sandbox_of(run.create_a), resumed)
             for g in g["verification"]["gpus"]]  # fmt: skip
    assert slots[0] == slots[1]
    assert resumed["verification"]["ok"] is True
    assert json_of(run.verify)["ok"] is True


def test_the_guest_keeps_its_memory_and_sees_the_new_card(run: HandOverRun) -> None:
    assert run.view_before is not None and run.view_after is not None
    assert run.view_before.token == run.token
    assert run.view_after.token == run.token  # kept in tmpfs: the guest's memory
    assert run.view_after.boot_id == run.view_before.boot_id  # restored, not rebooted
    assert run.view_after.ids.count(RAGE128P) == 1


def test_destroy_leaves_nothing_and_both_cards_free(run: HandOverRun) -> None:
    for name, done in run.destroys.items():
        assert done.returncode == 0, f"destroy {name}: {done.stdout}{done.stderr}"
    assert run.leftovers == []
    assert all(g["custody"] == "free" for g in run.inventory_after["gpus"])
