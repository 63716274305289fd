"""libvirt's domain events, fanned out to every open WatchSandboxes stream.

libvirt pushes events (no polling): the default event loop implementation is registered once
(``virEventRegisterDefaultImpl``) and run by one daemon thread; a connection of its own listens
for lifecycle events (defined, started, stopped, undefined, ...) and metadata changes (the
record SandboxManager rewrites when a sandbox becomes ready or fails). Each subscriber gets
every event of a ``vmsbx-`` domain as a ``DomainEvent`` on its own queue, naming the domain's
UUID (its identity: a name may be another sandbox's by the time the event is read). A lost
connection (libvirtd restarted) is reopened by the loop thread; subscribers are then told to
list everything again (an event with ``name`` None), since events in between were missed: a
stream announces what vanished meanwhile (watch.py). The driver announces changes libvirt does
not see (a workload launched in the guest) with ``changed``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Protocol

import libvirt

from vmsandbox.vm.connection import open_connection
from vmsandbox.vm.domain import DOMAIN_PREFIX

log = logging.getLogger(__name__)

_LOOP_STARTED = threading.Lock()
_loop_running = False
_RECONNECT_SECONDS = 2.0


@dataclass(frozen=True)
class DomainEvent:
    """One change: the domain's name without ``vmsbx-`` (None: list everything again), which
    is the sandbox's name or a claimed pooled guest's, its UUID (the service finds the sandbox
    by it, ``SandboxStore.by_domain``), and whether it was undefined (gone)."""

    name: str | None
    gone: bool = False
    uuid: str = ""


class EventSource(Protocol):
    """What the compute-driver service needs of ``DomainEvents``: a queue of events per watch
    stream (the unit tests, which open no watch, hand in one that never fills)."""

    def subscribe(self) -> queue.Queue[DomainEvent]: ...

    def unsubscribe(self, events: queue.Queue[DomainEvent]) -> None: ...

    def changed(self, name: str, uuid: str) -> None: ...


def _ensure_loop() -> None:
    """Register libvirt's default event loop and run it in a daemon thread, once per process.
    Must happen before the connection that wants events is opened."""
    global _loop_running
    with _LOOP_STARTED:
        if _loop_running:
            return
        libvirt.virEventRegisterDefaultImpl()

        def run() -> None:
            while True:
                libvirt.virEventRunDefaultImpl()

        threading.Thread(target=run, name="libvirt-events", daemon=True).start()
        _loop_running = True


class DomainEvents:
    """Subscribe to the sandbox events of one libvirt URI."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._subscribers: set[queue.Queue[DomainEvent]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conn: libvirt.virConnect | None = None
        _ensure_loop()
        self._connect()
        self._watchdog = threading.Thread(target=self._keep_connected, daemon=True)
        self._watchdog.start()

    def subscribe(self) -> queue.Queue[DomainEvent]:
        events: queue.Queue[DomainEvent] = queue.Queue()
        with self._lock:
            self._subscribers.add(events)
        return events

    def unsubscribe(self, events: queue.Queue[DomainEvent]) -> None:
        with self._lock:
            self._subscribers.discard(events)

    def changed(self, name: str, uuid: str) -> None:
        """Tell every subscriber that the sandbox of domain ``vmsbx-NAME`` (UUID ``uuid``)
        changed."""
        self._publish(DomainEvent(name, uuid=uuid))

    def close(self) -> None:
        self._stop.set()
        if self._conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self._conn.close()
            self._conn = None

    def _publish(self, event: DomainEvent) -> None:
        with self._lock:
            for events in self._subscribers:
                events.put(event)

    def _connect(self) -> None:
        conn = open_connection(self.uri)
        conn.setKeepAlive(5, 3)  # a dead libvirtd is noticed within ~15 s
        conn.domainEventRegisterAny(
            None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE, self._on_lifecycle, None
        )
        conn.domainEventRegisterAny(
            None, libvirt.VIR_DOMAIN_EVENT_ID_METADATA_CHANGE, self._on_metadata, None
        )
        self._conn = conn

    def _keep_connected(self) -> None:
        while not self._stop.wait(_RECONNECT_SECONDS):
            with contextlib.suppress(libvirt.libvirtError):
                if self._conn is not None and self._conn.isAlive():
                    continue
            try:
                self._connect()
            except Exception as exc:  # libvirtd still down: try again next round
                log.warning("libvirt events: reconnecting failed: %s", exc)
                continue
            log.info("libvirt events: reconnected to %s", self.uri)
            self._publish(DomainEvent(None))

    def _on_lifecycle(
        self, _conn: object, dom: libvirt.virDomain, event: int, _detail: int, _opaque: object
    ) -> None:
        name = dom.name()
        if name.startswith(DOMAIN_PREFIX):
            gone = event == libvirt.VIR_DOMAIN_EVENT_UNDEFINED
            uuid = dom.UUIDString()
            self._publish(DomainEvent(name.removeprefix(DOMAIN_PREFIX), gone=gone, uuid=uuid))

    def _on_metadata(
        self, _conn: object, dom: libvirt.virDomain, _kind: int, _ns: str, _opaque: object
    ) -> None:
        name = dom.name()
        if name.startswith(DOMAIN_PREFIX):
            uuid = dom.UUIDString()
            self._publish(DomainEvent(name.removeprefix(DOMAIN_PREFIX), uuid=uuid))
