"""WatchSandboxes matches libvirt's events to sandboxes by domain UUID (openshell/watch.py): a
late undefine of a sandbox whose name a later sandbox took announces the old one deleted, never
the live one; after a libvirt reconnect, what vanished meanwhile is announced. Served in this
process on the fake hypervisor, the events published by the test as libvirt would send them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.openshell_client import Published, Watch, in_process, stub

from vmsandbox.openshell.events import DomainEvent
from vmsandbox.openshell.proto import compute_driver_pb2 as pb


@pytest.fixture
def events() -> Published:
    return Published()


@pytest.fixture
def socket_path(tmp_path: Path, hv: FakeHypervisor, events: Published) -> Iterator[Path]:
    with in_process(unit_config(tmp_path), hv, events) as path:
        yield path


def request(sandbox_id: str, name: str) -> pb.CreateSandboxRequest:
    template = pb.DriverSandboxTemplate(
        image="tiny", resources=pb.DriverResourceRequirements(memory_limit="256Mi")
    )
    spec = pb.DriverSandboxSpec(template=template)
    return pb.CreateSandboxRequest(sandbox=pb.DriverSandbox(id=sandbox_id, name=name, spec=spec))


def seen(watch: Watch, count: int) -> list[tuple[str, str]]:
    """The next ``count`` messages: ("sandbox", id) or ("deleted", id)."""
    found = []
    for _ in range(count):
        event = watch.events.get(timeout=30)
        kind = event.WhichOneof("payload")
        found.append(
            (kind, event.deleted.sandbox_id if kind == "deleted" else event.sandbox.sandbox.id)
        )
    return found


def watching(socket_path: Path, events: Published) -> Watch:
    watch = Watch(socket_path)
    deadline = time.monotonic() + 30
    while events.watchers() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return watch


def test_a_late_undefine_announces_the_old_sandbox_deleted_not_its_namesake(
    socket_path: Path, hv: FakeHypervisor, events: Published
) -> None:
    channel, client = stub(socket_path)
    with channel:
        client.CreateSandbox(request("a-1", "web"), timeout=60)
        uuid_a = hv.domains["vmsbx-web"].uuid
        watch = watching(socket_path, events)
        try:
            assert seen(watch, 1) == [("sandbox", "a-1")]
            client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id="a-1"), timeout=60)
            client.CreateSandbox(request("b-1", "web"), timeout=60)
            uuid_b = hv.domains["vmsbx-web"].uuid
            events.publish(DomainEvent("web", uuid=uuid_b))  # B defined
            assert seen(watch, 1) == [("sandbox", "b-1")]
            events.publish(DomainEvent("web", gone=True, uuid=uuid_a))  # A's late undefine
            events.publish(DomainEvent("web", uuid=uuid_b))  # B changes again
            assert seen(watch, 2) == [("deleted", "a-1"), ("sandbox", "b-1")]
        finally:
            watch.close()


def test_deletions_missed_while_libvirt_was_away_are_announced_after_the_reconnect(
    socket_path: Path, hv: FakeHypervisor, events: Published
) -> None:
    channel, client = stub(socket_path)
    with channel:
        client.CreateSandbox(request("c-1", "gone-meanwhile"), timeout=60)
        client.CreateSandbox(request("d-1", "stays"), timeout=60)
        watch = watching(socket_path, events)
        try:
            assert sorted(seen(watch, 2)) == [("sandbox", "c-1"), ("sandbox", "d-1")]
            client.DeleteSandbox(pb.DeleteSandboxRequest(sandbox_id="c-1"), timeout=60)
            events.publish(DomainEvent(None))  # reconnected: its undefine event was missed
            assert seen(watch, 2) == [("deleted", "c-1"), ("sandbox", "d-1")]
        finally:
            watch.close()
