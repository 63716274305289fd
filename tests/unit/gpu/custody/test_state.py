"""A GPU's custody states and the pure transitions between them (gpu/custody/state.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vmsandbox.gpu.custody import state
from vmsandbox.gpu.custody.state import Custody, CustodyRefused
from vmsandbox.vm.process import ProcessIdentity

BDF = "0000:01:00.0"
ME = ProcessIdentity.current()
GONE = ProcessIdentity(pid=1, start="0", boot="another boot")


def test_free_assigned_sanitizing_free() -> None:
    record = state.assigned(Custody(BDF), "domain-uuid", None)
    assert record.state == state.ASSIGNED
    record = state.released(record, partition=3)
    assert (record.state, record.partition) == (state.SANITIZING, 3)
    record = state.taken_up(record, ME)
    record = state.finished(record, True, "", {"reset": 1.5})
    assert (record.state, record.reason, dict(record.steps)) == (state.FREE, "", {"reset": 1.5})


def test_a_failed_sanitize_quarantines_with_the_steps_words() -> None:
    record = state.taken_up(state.released(Custody(BDF)), ME)
    record = state.finished(record, False, "alive: reads all ones", {"reset": 0.1})
    assert (record.state, record.reason) == (state.QUARANTINED, "alive: reads all ones")


def test_only_a_free_gpu_is_assigned() -> None:
    with pytest.raises(CustodyRefused, match="quarantined, not free"):
        state.assigned(Custody(BDF, state=state.QUARANTINED), "x", None)


def test_a_reset_class_fault_makes_it_suspect_and_its_release_resets_it_once() -> None:
    record = state.signalled(Custody(BDF), "aer", "AER: fatal", reset_cures=True)
    assert record is not None and record.state == state.SUSPECT
    record = state.released(record)
    assert record.state == state.RESETTING and record.auto_reset_at
    record = state.finished(state.taken_up(record, ME), True, "", {})
    assert record.state == state.FREE
    again = state.signalled(record, "aer", "AER: fatal again", reset_cures=True)
    assert again is not None and again.state == state.QUARANTINED
    assert "a second fault within a day" in again.reason


def test_a_failed_automatic_reset_is_failed() -> None:
    record = state.released(state.signalled(Custody(BDF), "vfio", "paused", True) or Custody(BDF))
    record = state.finished(state.taken_up(record, ME), False, "reset: refused", {})
    assert (record.state, record.reason) == (state.FAILED, "reset: refused")


def test_a_fault_a_reset_does_not_cure_quarantines_at_once() -> None:
    record = state.signalled(Custody(BDF), "xid", "Xid 79", reset_cures=False)
    assert record is not None and record.state == state.QUARANTINED
    assert state.signalled(record, "aer", "more", reset_cures=True) is None  # keeps its reason


def test_a_gpu_being_reset_ignores_signals() -> None:
    record = Custody(BDF, state=state.SANITIZING, worker=ME)
    assert state.signalled(record, "aer", "its own reset", reset_cures=True) is None


def test_work_is_taken_up_only_from_a_worker_that_is_gone() -> None:
    busy = Custody(BDF, state=state.SANITIZING, worker=ME)
    assert busy.worked_on
    with pytest.raises(CustodyRefused, match="being sanitizing by pid"):
        state.taken_up(busy, GONE)
    left = replace(busy, worker=GONE)
    assert not left.worked_on
    assert state.taken_up(left, ME).worker == ME


def test_check_and_forced_release_refuse_an_assigned_gpu() -> None:
    record = Custody(BDF, state=state.ASSIGNED, owner="uuid")
    with pytest.raises(CustodyRefused, match="release it first"):
        state.checking(record, ME, automatic=False)
    with pytest.raises(CustodyRefused, match="only a GPU that is out"):
        state.forced_free(record)
    failed = Custody(BDF, state=state.FAILED, reason="reset: refused")
    assert state.checking(failed, ME, automatic=False).state == state.RESETTING
    assert state.forced_free(failed).state == state.FREE


def test_records_round_trip_and_bad_states_are_refused() -> None:
    record = Custody(BDF, state=state.SANITIZING, worker=ME, companions=("0000:01:00.1",))
    assert Custody.from_dict(record.to_dict()) == record
    with pytest.raises(ValueError, match="unknown custody state"):
        Custody.from_dict({"bdf": BDF, "state": "sleepy"})


def test_shown_state_of_a_held_free_gpu_is_assigned() -> None:
    assert state.shown_state(None, "vmsbx-a") == state.ASSIGNED
    assert state.shown_state(Custody(BDF, state=state.QUARANTINED), "vmsbx-a") == "quarantined"
    assert state.shown_state(None, None) == state.FREE
