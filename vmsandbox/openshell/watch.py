"""One WatchSandboxes stream: the caller's sandboxes, then what changes, by domain UUID.

A stream first sends a snapshot of every sandbox of its caller (openshell/caller.py), then one
snapshot per libvirt event of one of them (``events.DomainEvent``) and a deleted event when
its domain is undefined. Events are matched to sandboxes by their domain's UUID, never its
name: a late undefine of a sandbox whose name a later one took names the old sandbox's id, and
the live one is never announced deleted. The stream remembers which sandbox id it announced
for each UUID (an undefined domain's record cannot be read any more), and forgets it once it
announced the deletion; an id that another live sandbox of the caller has by then (the gateway
used it again) is not announced deleted.

After libvirtd restarted (an event with no name: events in between were missed), the stream
lists its caller's sandboxes again, sends each, and announces deleted every sandbox it had
announced that the complete listing no longer has. A listing that fails ends the stream with
its error (the gateway watches again): deletions are never announced on a partial view.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from vmsandbox.openshell.events import DomainEvent
from vmsandbox.openshell.proto import compute_driver_pb2 as pb

# (domain UUID, snapshot) of every sandbox of the caller: the whole view, or an error.
Listing = Callable[[], list[tuple[str, pb.DriverSandbox]]]
# The snapshot of the caller's sandbox of domain UUID (and name); None when it is not one.
One = Callable[[str, str], pb.DriverSandbox | None]


class Stream:
    """What one stream announced; ``events`` turns one event into the messages to send."""

    def __init__(self, listing: Listing, one: One) -> None:
        self._listing = listing
        self._one = one
        self.announced: dict[str, str] = {}  # domain UUID -> sandbox id

    def start(self) -> Iterator[pb.WatchSandboxesEvent]:
        """Every sandbox of the caller (the stream's first messages)."""
        yield from self._resync()

    def events(self, event: DomainEvent) -> Iterator[pb.WatchSandboxesEvent]:
        if event.name is None:
            yield from self._resync()
            return
        if event.gone:
            sandbox_id = self.announced.pop(event.uuid, None)
            if sandbox_id and sandbox_id not in self.announced.values():
                yield deleted(sandbox_id)
            return
        snap = self._one(event.uuid, event.name)
        if snap is not None:
            self.announced[event.uuid] = snap.id
            yield sandbox(snap)

    def _resync(self) -> Iterator[pb.WatchSandboxesEvent]:
        listed = self._listing()  # complete, or it raises before anything is announced
        now = {uuid: snap.id for uuid, snap in listed}
        vanished = {i for uuid, i in self.announced.items() if uuid not in now} - set(now.values())
        self.announced = now
        for sandbox_id in sorted(vanished):
            yield deleted(sandbox_id)
        for _uuid, snap in listed:
            yield sandbox(snap)


def sandbox(snap: pb.DriverSandbox) -> pb.WatchSandboxesEvent:
    return pb.WatchSandboxesEvent(sandbox=pb.WatchSandboxesSandboxEvent(sandbox=snap))


def deleted(sandbox_id: str) -> pb.WatchSandboxesEvent:
    return pb.WatchSandboxesEvent(deleted=pb.WatchSandboxesDeletedEvent(sandbox_id=sandbox_id))
