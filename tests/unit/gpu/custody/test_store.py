"""The custody records in the state directory (gpu/custody/store.py): written only under the
host lock and whole, an unreadable one never read as free, every change logged."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmsandbox.config import Config
from vmsandbox.errors import Internal
from vmsandbox.gpu.custody import state
from vmsandbox.gpu.custody.state import Custody
from vmsandbox.gpu.custody.store import CustodyStore
from vmsandbox.lock import host_lock

BDF = "0000:01:00.0"


@pytest.fixture
def config(tmp_path: Path) -> Config:
    (tmp_path / "state").mkdir()
    return Config.load(path="/nonexistent", state_dir=tmp_path / "state")


def test_writes_need_the_host_lock(config: Config) -> None:
    store = CustodyStore(config)
    with pytest.raises(Internal, match="outside the host lock"):
        store.put(Custody(BDF), "test")
    with host_lock(config.lock_path):
        store.put(Custody(BDF, state=state.QUARANTINED, reason="AER"), "test")
    assert store.get(BDF).reason == "AER"
    assert [e["cause"] for e in store.read_log()] == ["test"]


def test_a_gpu_without_a_record_is_free(config: Config) -> None:
    assert CustodyStore(config).get(BDF).state == state.FREE
    assert CustodyStore(config).all() == {}


def test_an_unreadable_record_reads_as_quarantined(config: Config) -> None:
    store = CustodyStore(config)
    store.gpus.mkdir(parents=True)
    (store.gpus / f"{BDF}.json").write_text("{half a rec")
    record = store.all()[BDF]
    assert record.state == state.QUARANTINED and "cannot be read" in record.reason


def test_change_applies_a_transition_and_none_changes_nothing(config: Config) -> None:
    store = CustodyStore(config)
    with host_lock(config.lock_path):
        assert store.change(BDF, lambda r: None, "nothing") is None
        record = store.change(BDF, state.released, "released")
    assert record is not None and store.get(BDF).state == state.SANITIZING
