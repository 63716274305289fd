"""The hypervisor seam: the few operations the manager needs, and their libvirt implementation.

The manager talks to ``Hypervisor`` only, by domain name and UUID, so its logic is unit-tested
against a fake (tests/framework/fake_hypervisor.py) while the end-to-end tests use the real
libvirtd. libvirt's failures become our error codes here.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import libvirt
from lxml import etree

from vmsandbox.vm import domain as domain_xml
from vmsandbox.vm.connection import is_alive, libvirt_errors, open_connection, translate


@dataclass(frozen=True)
class Stored:
    """A domain's vmsandbox metadata: the record as stored (None when the domain carries none,
    i.e. it is not ours) and the lifecycle state beside it; the domain's UUID, its immutable
    identity; and, from ``every_domain()``, the host PCI devices (BDFs) its XML holds."""

    domain: str
    data: dict[str, Any] | None
    state: str
    uuid: str = ""
    hostdevs: tuple[str, ...] = ()


class Hypervisor(Protocol):
    """What the manager asks of a hypervisor. Every method names the domain; ``stop``,
    ``shutdown`` (the guest's ACPI power button), ``undefine``, ``detach`` and
    ``discard_save`` succeed when there is nothing to do. ``attach``/``detach`` take a device's
    XML (a GPU-ready pooled guest's hostdevs, gpu/hotplug.py; a suspended GPU sandbox's).

    ``save`` is libvirt's managed save: the running guest's memory goes to a file libvirt
    keeps, QEMU ends, and the domain is off until ``start`` restores it (both through the
    host's page cache: a resume soon after reads the save back from memory); ``saved``
    says whether there is such a file and its size, ``discard_save`` removes it, and so does
    ``undefine``. A guest holding a PCI host device cannot be saved. ``channel_state`` is
    what libvirt knows of the guest's end of a running domain's virtio channel (a program in
    the guest has the port open: "connected"), None when it knows nothing.

    Every method of one domain also takes a ``uuid``: given one, it acts on (or reads) the
    domain with that UUID only, whatever its name, and finds nothing when there is none (as
    for an absent name: NOT_FOUND, None, False or nothing to do). A call that acts on what it
    looked up earlier passes the UUID it found, so it never reaches a domain another call made
    since under the same name. ``every_domain``, ``list`` and ``running`` fail closed: a
    libvirt error raises (UNAVAILABLE when libvirtd is gone), never a shorter list or a guess;
    only a domain that vanished while it was read is left out."""

    def define(self, xml: str) -> None: ...
    def start(self, domain: str, uuid: str | None = None) -> None: ...
    def save(self, domain: str, uuid: str | None = None) -> None: ...
    def saved(self, domain: str, uuid: str | None = None) -> int | None: ...
    def discard_save(self, domain: str, uuid: str | None = None) -> None: ...
    def stop(self, domain: str, uuid: str | None = None) -> None: ...
    def shutdown(self, domain: str, uuid: str | None = None) -> None: ...
    def undefine(self, domain: str, uuid: str | None = None) -> None: ...
    def running(self, domain: str, uuid: str | None = None) -> bool: ...
    def stop_reason(self, domain: str, uuid: str | None = None) -> str: ...
    def every_domain(self) -> list[Stored]: ...
    def list(self, prefix: str) -> list[Stored]: ...
    def metadata(self, domain: str, uuid: str | None = None) -> Stored | None: ...
    def definition(self, domain: str, uuid: str | None = None) -> str: ...
    def set_metadata(
        self, domain: str, data: dict[str, Any], state: str, uuid: str | None = None
    ) -> None: ...
    def lease_address(self, domain: str, uuid: str | None = None) -> str | None: ...
    def channel_state(self, domain: str, name: str, uuid: str | None = None) -> str | None: ...
    def hostdev_holders(self) -> dict[str, str]: ...
    def attach(self, domain: str, xml: str, uuid: str | None = None) -> None: ...
    def detach(self, domain: str, xml: str, uuid: str | None = None) -> None: ...
    def close(self) -> None: ...


# Why libvirt says a domain is shut off or crashed (virDomainShutoffReason, virDomainCrashedReason).
_SHUTOFF_REASONS = {
    libvirt.VIR_DOMAIN_SHUTOFF_SHUTDOWN: "the guest powered itself off",
    libvirt.VIR_DOMAIN_SHUTOFF_DESTROYED: "it was forced off (destroyed)",
    libvirt.VIR_DOMAIN_SHUTOFF_CRASHED: "QEMU crashed",
    libvirt.VIR_DOMAIN_SHUTOFF_FAILED: "QEMU failed to start or run",
    libvirt.VIR_DOMAIN_SHUTOFF_DAEMON: "libvirtd stopped it",
    libvirt.VIR_DOMAIN_SHUTOFF_SAVED: "its memory was saved to disk (suspended)",
}
# Where libvirt's QEMU driver keeps managed save files (its save_dir), per connection kind.
_SAVE_DIRS = {"qemu:///system": "/var/lib/libvirt/qemu/save"}


def _restore(dom: libvirt.virDomain) -> None:
    """Restore a domain's managed save. The save carries the domain's XML of the moment it was
    saved, metadata included, and libvirt runs the restored guest on it: what ``set_metadata``
    stored since (a resume's new GPUs, a lifetime extended while suspended) would be read back
    stale. So the guest is restored paused, the stored record is written onto it, and it runs
    (also when the write failed: the error is raised once its memory is live). A driver that
    cannot start a domain paused (libvirt's test driver) restores it running."""
    paused = True
    try:
        dom.createWithFlags(libvirt.VIR_DOMAIN_START_PAUSED)
    except libvirt.libvirtError as exc:
        if exc.get_error_code() != libvirt.VIR_ERR_INVALID_ARG:
            raise
        dom.createWithFlags(0)
        paused = False
    try:
        stored = domain_xml.read_metadata(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        if stored is not None:
            _write_metadata(dom, *stored, libvirt.VIR_DOMAIN_AFFECT_LIVE)
    finally:
        if paused:
            dom.resume()


def _write_metadata(dom: libvirt.virDomain, data: dict[str, Any], state: str, flags: int) -> None:
    """The record and state as our metadata element, the record's name as the title."""
    dom.setMetadata(
        libvirt.VIR_DOMAIN_METADATA_ELEMENT,
        domain_xml.metadata_xml(data, state),
        domain_xml.METADATA_KEY,
        domain_xml.METADATA_NS,
        flags,
    )
    dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_TITLE, str(data["name"]), None, None, flags)


class LibvirtHypervisor:
    """``Hypervisor`` on one libvirt connection, reopened when it has dropped."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._conn: libvirt.virConnect | None = None

    @property
    def conn(self) -> libvirt.virConnect:
        if not is_alive(self._conn):
            self._conn = open_connection(self.uri)
        assert self._conn is not None
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self._conn.close()
            self._conn = None

    def _domain(self, domain: str, uuid: str | None = None) -> libvirt.virDomain:
        """The domain (by ``uuid`` when given); NOT_FOUND when there is none."""
        with libvirt_errors(f"looking up {_what(domain)}"):
            return self._lookup(domain, uuid)

    def define(self, xml: str) -> None:
        name = etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=False)).findtext(
            "name", ""
        )
        with libvirt_errors(f"defining {_what(name)}"):
            self.conn.defineXML(xml)

    def start(self, domain: str, uuid: str | None = None) -> None:
        """Boot the domain, or restore its saved memory when it has a managed save, with the
        record and title last stored (``_restore``)."""
        dom = self._domain(domain, uuid)
        with libvirt_errors(f"starting {_what(domain)}"):
            if dom.hasManagedSaveImage(0):
                _restore(dom)
            else:
                dom.createWithFlags(0)

    def save(self, domain: str, uuid: str | None = None) -> None:
        """Save the running guest's memory (managed save, raw, through the page cache: the
        kernel writes it out and may drop it, it is cache and no process's memory); it
        restores running. FAILED_PRECONDITION for a domain that does not run or holds a host
        PCI device."""
        dom = self._domain(domain, uuid)
        with libvirt_errors(f"saving the memory of {_what(domain)}"):
            dom.managedSave(libvirt.VIR_DOMAIN_SAVE_RUNNING)

    def saved(self, domain: str, uuid: str | None = None) -> int | None:
        """The size in bytes of the domain's managed save; None when it has none (or the
        domain is gone); 0 when libvirt keeps it where no size can be read (not
        qemu:///system)."""
        try:
            dom = self._lookup(domain, uuid)
            if not dom.hasManagedSaveImage(0):
                return None
            name = str(dom.name())
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise translate(exc, f"reading whether {_what(domain)} is saved") from exc
        folder = _SAVE_DIRS.get(self.uri.split("?", 1)[0].replace("qemu+unix", "qemu"))
        try:
            return os.stat(f"{folder}/{name}.save").st_size if folder else 0
        except OSError:
            return 0

    def discard_save(self, domain: str, uuid: str | None = None) -> None:
        """Remove the domain's managed save (its next start boots afresh)."""
        try:
            self._lookup(domain, uuid).managedSaveRemove(0)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise translate(exc, f"discarding the saved memory of {_what(domain)}") from exc

    def _lookup(self, domain: str, uuid: str | None) -> libvirt.virDomain:
        """The domain by its UUID when one is given, else by name (libvirtError when none)."""
        if uuid:
            return self.conn.lookupByUUIDString(uuid)
        return self.conn.lookupByName(domain)

    def stop(self, domain: str, uuid: str | None = None) -> None:
        self._unless_stopped(domain, "stopping", lambda dom: dom.destroy(), uuid)

    def shutdown(self, domain: str, uuid: str | None = None) -> None:
        """Press the guest's power button (ACPI); it powers itself off, or ignores it."""
        self._unless_stopped(domain, "shutting down", lambda dom: dom.shutdown(), uuid)

    def _unless_stopped(
        self,
        domain: str,
        doing: str,
        act: Callable[[libvirt.virDomain], object],
        uuid: str | None = None,
    ) -> None:
        """``act`` on the domain; one that is gone or not running is already where it should be."""
        try:
            act(self._lookup(domain, uuid))
        except libvirt.libvirtError as exc:
            if exc.get_error_code() not in (
                libvirt.VIR_ERR_NO_DOMAIN,
                libvirt.VIR_ERR_OPERATION_INVALID,  # not running
            ):
                raise translate(exc, f"{doing} {_what(domain)}") from exc

    def undefine(self, domain: str, uuid: str | None = None) -> None:
        """Remove the definition; a guest that runs goes on, transient, until it stops. One
        already undefined has nothing left to remove (QEMU refuses to undefine it)."""
        try:
            dom = self._lookup(domain, uuid)
            if not dom.isPersistent():
                return
            dom.undefineFlags(
                libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
                | libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
            )
        except libvirt.libvirtError as exc:
            if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                raise translate(exc, f"removing {_what(domain)}") from exc

    def running(self, domain: str, uuid: str | None = None) -> bool:
        """Whether the domain runs; False when there is none, an error when libvirt cannot
        say (a caller must never take "cannot tell" for "stopped")."""
        try:
            active: int = self._lookup(domain, uuid).isActive()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return False
            raise translate(exc, f"reading the state of {_what(domain)}") from exc
        return active == 1

    def stop_reason(self, domain: str, uuid: str | None = None) -> str:
        try:
            state, reason = self._lookup(domain, uuid).state()
        except libvirt.libvirtError as exc:
            return f"its state cannot be read: {exc.get_error_message()}"
        if state == libvirt.VIR_DOMAIN_CRASHED:
            return "the guest crashed (panicked)"
        if state == libvirt.VIR_DOMAIN_SHUTOFF:
            return _SHUTOFF_REASONS.get(reason, f"libvirt gives shutoff reason {reason}")
        return f"libvirt gives state {state}, reason {reason}"

    def every_domain(self) -> list[Stored]:
        """Every domain of the connection with its metadata, UUID and held PCI devices: the
        whole view or an error (see the class docstring)."""
        return self._read_all(lambda _name: True, hostdevs=True)

    def list(self, prefix: str) -> list[Stored]:
        """The domains whose name starts with ``prefix``: all of them or an error."""
        return self._read_all(lambda name: name.startswith(prefix), hostdevs=False)

    def _read_all(self, wanted: Callable[[str], bool], *, hostdevs: bool) -> builtins.list[Stored]:
        with libvirt_errors("listing domains"):
            domains = self.conn.listAllDomains(0)
        found = []
        for dom in domains:
            name = dom.name()
            if not wanted(name):
                continue
            try:
                found.append(_stored(dom, hostdevs=hostdevs))
            except libvirt.libvirtError as exc:
                if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                    continue  # undefined between the listing and this read: it is gone
                raise translate(exc, f"reading {_what(name)} while listing domains") from exc
        return found

    def metadata(self, domain: str, uuid: str | None = None) -> Stored | None:
        try:
            return _stored(self._lookup(domain, uuid))
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            raise translate(exc, f"reading {_what(domain)}") from exc

    def definition(self, domain: str, uuid: str | None = None) -> str:
        """The domain's persistent XML (what ``define`` was given, as libvirt keeps it)."""
        dom = self._domain(domain, uuid)
        with libvirt_errors(f"reading the definition of {_what(domain)}"):
            return str(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))

    def set_metadata(
        self, domain: str, data: dict[str, Any], state: str, uuid: str | None = None
    ) -> None:
        """Store the record and state; the title follows the record's name (a claimed pooled
        guest's domain keeps its own name)."""
        dom = self._domain(domain, uuid)
        flags = libvirt.VIR_DOMAIN_AFFECT_CONFIG | (
            libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else 0
        )
        with libvirt_errors(f"updating the metadata of {_what(domain)}"):
            _write_metadata(dom, data, state, flags)

    def channel_state(self, domain: str, name: str, uuid: str | None = None) -> str | None:
        """The guest's end of virtio channel ``name`` of the running domain: "connected" or
        "disconnected" as QEMU last told libvirt; None when the domain does not run or is
        gone, has no such channel, or libvirt does not know (its test driver)."""
        try:
            dom = self._lookup(domain, uuid)
            if not dom.isActive():
                return None
            root = etree.fromstring(dom.XMLDesc(0).encode())
        except libvirt.libvirtError:
            return None
        for target in root.iterfind("devices/channel/target[@type='virtio']"):
            if target.get("name") == name:
                state = target.get("state")
                return None if state is None else str(state)
        return None

    def lease_address(self, domain: str, uuid: str | None = None) -> str | None:
        """The guest's IPv4 address from its network's DHCP leases, None while it has none."""
        try:
            addrs = self._lookup(domain, uuid).interfaceAddresses(
                libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE
            )
        except libvirt.libvirtError:
            return None
        for iface in addrs.values():
            for addr in iface.get("addrs") or []:
                if addr.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4:
                    return str(addr["addr"])
        return None

    def hostdev_holders(self) -> dict[str, str]:
        from vmsandbox.host import libvirt_hostdev_holders

        with libvirt_errors("reading which domains hold PCI devices"):
            return libvirt_hostdev_holders(self.conn)

    def attach(self, domain: str, xml: str, uuid: str | None = None) -> None:
        """Add device ``xml`` to the running domain and to its definition (a stopped and
        restarted sandbox keeps it, as a cold-made one keeps its hostdevs)."""
        dom = self._domain(domain, uuid)
        with libvirt_errors(f"attaching a device to {_what(domain)}"):
            dom.attachDeviceFlags(xml, _LIVE_AND_CONFIG)

    def detach(self, domain: str, xml: str, uuid: str | None = None) -> None:
        """Remove device ``xml`` from the running domain and its definition; libvirt gives a
        managed hostdev back to its host driver once the guest has let it go. Succeeds when
        the domain is gone or does not hold the device."""
        try:
            self._lookup(domain, uuid).detachDeviceFlags(xml, _LIVE_AND_CONFIG)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() not in (
                libvirt.VIR_ERR_NO_DOMAIN,
                libvirt.VIR_ERR_DEVICE_MISSING,
                libvirt.VIR_ERR_OPERATION_INVALID,  # not running
            ):
                raise translate(exc, f"detaching a device from {_what(domain)}") from exc


_LIVE_AND_CONFIG = libvirt.VIR_DOMAIN_AFFECT_LIVE | libvirt.VIR_DOMAIN_AFFECT_CONFIG


def _what(domain: str) -> str:
    """How messages name a domain: by its sandbox name when it is one."""
    if domain.startswith(domain_xml.DOMAIN_PREFIX):
        return f"sandbox {domain.removeprefix(domain_xml.DOMAIN_PREFIX)!r}"
    return f"domain {domain!r}"


def _stored(dom: libvirt.virDomain, *, hostdevs: bool = False) -> Stored:
    """The domain's metadata and UUID; with ``hostdevs``, also the PCI devices its persistent
    and (when it runs) live XML hold, as ``host.holders`` reads them."""
    xml = dom.XMLDesc(0)
    held: tuple[str, ...] = ()
    if hostdevs:
        from vmsandbox.host.holders import domain_hostdevs

        held = domain_hostdevs(dom)
    parsed = domain_xml.read_metadata(xml)
    data, state = parsed if parsed is not None else (None, "unknown")
    return Stored(dom.name(), data, state, dom.UUIDString(), held)
