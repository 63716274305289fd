"""The sandbox record: round trip, records of before versions existed, refusing newer ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vmsandbox.errors import FailedPrecondition
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.sandbox import credential
from vmsandbox.sandbox.record import SCHEMA_VERSION, HotplugRecord, SandboxRecord
from vmsandbox.sandbox.suspension import Suspension

# A record as vmsandbox wrote it before the schema had a version (state inside, no "version").
VERSION_1 = {
    "mac": "52:54:00:12:34:56",
    "keys": "/var/lib/vmsandbox/sandboxes/old",
    "host_key_alias": "vmsbx-old",
    "created_at": "2026-11-01T10:00:00Z",
    "creator": {"pid": 42, "start": "1234", "boot": "b00t"},
    "name": "old",
    "image": "minimal",
    "image_id": "d58b858b523f31aa",
    "cpus": 2,
    "memory_mib": 1024,
    "disk_gib": 4,
    "virt_type": "qemu",
    "network": "user",
    "ssh": {"host": "127.0.0.1", "port": 40022, "user": "sandbox"},
    "labels": {"team": "a"},
    "gpus": [
        {
            "bdf": "0000:18:00.0",
            "vendor": "nvidia",
            "vendor_id": "10de",
            "device_id": "2330",
            "name": "H100",
            "memory_mib": 81559,
            "numa_node": 0,
            "companions": [],
            "companion_ids": [],
        }
    ],
    "state": "creating",
}


def test_a_version_1_record_reads_and_writes_back_as_the_current_version() -> None:
    record = SandboxRecord.from_dict(VERSION_1)
    assert record.ssh.port == 40022 and record.creator is not None and record.creator.pid == 42
    assert record.gpus == (
        GpuRecord("0000:18:00.0", "nvidia", "10de", "2330", "H100", 81559, 0, (), ()),
    )
    data = record.to_dict()
    assert data["version"] == SCHEMA_VERSION and "state" not in data
    assert SandboxRecord.from_dict(data) == record


def test_a_minimal_old_record_gets_the_defaults() -> None:
    record = SandboxRecord.from_dict({"name": "bare"})
    assert record.host_key_alias == "vmsbx-bare"
    assert record.ssh.port is None and record.gpus == () and record.creator is None


def test_a_record_of_a_newer_vmsandbox_is_refused() -> None:
    with pytest.raises(FailedPrecondition, match="newer vmsandbox"):
        SandboxRecord.from_dict({**VERSION_1, "version": SCHEMA_VERSION + 1})


def test_the_fabric_fields_round_trip_and_old_records_hold_none() -> None:
    old = SandboxRecord.from_dict(VERSION_1)
    assert old.fabric_partition is None and old.switches == () and not old.on_fabric
    pair = {**VERSION_1, "gpus": VERSION_1["gpus"] * 2}
    shared = SandboxRecord.from_dict({**pair, "version": SCHEMA_VERSION, "fabric_partition": 3})
    assert shared.fabric_partition == 3 and shared.on_fabric
    assert SandboxRecord.from_dict(shared.to_dict()) == shared
    single = SandboxRecord.from_dict({**VERSION_1, "fabric_partition": 7})
    assert not single.on_fabric  # one GPU: no NVLink to check
    board = SandboxRecord.from_dict({**VERSION_1, "switches": ["0000:07:00.0", "0000:08:00.0"]})
    assert board.switches == ("0000:07:00.0", "0000:08:00.0") and board.on_fabric
    assert board.to_dict()["switches"] == ["0000:07:00.0", "0000:08:00.0"]


def test_a_version_3_record_reads_unclaimed_and_a_claim_round_trips() -> None:
    """Version 3 (stop/start's ``failure`` and ``starter``) has no ``guest``: the sandbox's
    domain and files carry its name. Version 4 adds the pooled guest a sandbox was claimed
    from; the domain and files then carry the guest's name."""
    failure = {"code": "DEADLINE_EXCEEDED", "message": "no SSH"}
    old = SandboxRecord.from_dict({**VERSION_1, "version": 3, "failure": failure})
    assert (old.guest, old.stem, old.domain, old.failure) == (None, "old", "vmsbx-old", failure)
    claimed = SandboxRecord.from_dict({**old.to_dict(), "guest": "pool-1234abcd"})
    assert (claimed.stem, claimed.domain) == ("pool-1234abcd", "vmsbx-pool-1234abcd")
    assert SandboxRecord.from_dict(claimed.to_dict()) == claimed
    assert claimed.to_dict()["version"] == SCHEMA_VERSION


def test_a_version_4_record_reads_without_a_credential_and_version_5_keeps_its_digest() -> None:
    """Version 5 adds ``credential``, the salted digest of the OpenShell sandbox token."""
    old = SandboxRecord.from_dict({**VERSION_1, "version": 4, "guest": None})
    assert old.credential is None and old.to_dict()["credential"] is None
    stored = credential.digest("eyJ0eXAiOiJKV1QifQ.record.signature")
    new = SandboxRecord.from_dict({**old.to_dict(), "credential": stored})
    assert new.credential == stored and SandboxRecord.from_dict(new.to_dict()) == new
    assert new.to_dict()["version"] == SCHEMA_VERSION


def test_a_version_4_record_has_no_spare_ports_and_a_gpu_ready_guest_round_trips() -> None:
    """Version 6 adds the spare root ports of a GPU-ready pooled guest (gpu/hotplug.py)."""
    old = SandboxRecord.from_dict({**VERSION_1, "version": 4, "guest": "pool-1"})
    assert old.hotplug is None and old.to_dict()["hotplug"] is None
    ready = replace(old, hotplug=HotplugRecord(buses=(1, 2), firmware="bios"))
    assert ready.to_dict()["hotplug"] == {"buses": [1, 2], "firmware": "bios"}
    assert SandboxRecord.from_dict(ready.to_dict()) == ready


def test_a_version_6_record_has_no_generation_and_a_restarted_one_round_trips() -> None:
    """Version 7 adds ``generation``, the OpenShell gateway's last start generation."""
    old = SandboxRecord.from_dict({**VERSION_1, "version": 6, "hotplug": None})
    assert old.generation is None and old.to_dict()["generation"] is None
    restarted = replace(old, generation="gen-2")
    assert SandboxRecord.from_dict(restarted.to_dict()) == restarted
    assert restarted.to_dict()["version"] == SCHEMA_VERSION


def test_a_version_7_record_has_no_owner_and_an_owned_one_round_trips() -> None:
    """Version 8 adds ``owner``, the gateway that asked through the OpenShell driver; a
    version 7 record reads with none (the driver reads its owner from its labels)."""
    old = SandboxRecord.from_dict({**VERSION_1, "version": 7, "generation": "gen-1"})
    assert old.owner is None and old.to_dict()["owner"] is None
    owned = replace(old, owner="uid:1001/gw-a")
    assert SandboxRecord.from_dict(owned.to_dict()) == owned
    assert owned.to_dict()["version"] == SCHEMA_VERSION


def test_a_version_8_record_has_no_boot_seconds_and_a_booted_one_keeps_them() -> None:
    """Version 9 adds ``boot_seconds``: ``show`` says how long the last boot took, as create
    did."""
    old = SandboxRecord.from_dict({**VERSION_1, "version": 8, "generation": None})
    assert old.boot_seconds is None and old.to_dict()["boot_seconds"] is None
    booted = replace(old, boot_seconds=12.5)
    assert SandboxRecord.from_dict(booted.to_dict()) == booted


def test_a_version_9_record_has_no_lifetime_and_an_expiry_round_trips() -> None:
    """Version 10 adds ``expires_at``, the end of a sandbox's lifetime (``create --ttl``)."""
    old = SandboxRecord.from_dict({**VERSION_1, "version": 9, "generation": None})
    assert old.expires_at is None and old.to_dict()["expires_at"] is None
    mortal = replace(old, expires_at="2026-11-01T12:00:00Z")
    assert SandboxRecord.from_dict(mortal.to_dict()) == mortal
    assert mortal.to_dict()["version"] == SCHEMA_VERSION


def test_a_version_10_record_is_not_suspended_and_a_suspension_round_trips() -> None:
    """Version 11 adds ``suspended``: the GPUs a suspended sandbox takes again (by model and
    count), their guest buses, what the guest quiesced, the size of the saved memory and of
    the Fabric Manager partition it gave back. A version 10 record reads as never suspended."""
    old = SandboxRecord.from_dict({**VERSION_1, "version": 10, "expires_at": None})
    assert old.suspended is None and old.to_dict()["suspended"] is None
    gpu = GpuRecord("0000:41:00.0", "nvidia", "0x10de", "0x2330", name="NVIDIA H100")
    suspended = replace(
        old,
        suspended=Suspension(
            at="2026-11-26T21:00:00Z",
            gpus=(gpu,),
            buses=(7,),
            firmware="uefi",
            guest={"checkpointed": [412], "unloaded": ["nvidia"]},
            save_bytes=123 << 20,
            partition_size=1,
        ),
    )
    assert SandboxRecord.from_dict(suspended.to_dict()) == suspended
    assert suspended.to_dict()["version"] == SCHEMA_VERSION == 11
    assert suspended.suspended is not None and suspended.suspended.checkpointed == [412]
    assert suspended.suspended.shown()["gpus"][0]["bdf"] == "0000:41:00.0"
