"""An in-memory ``Hypervisor`` for the manager's unit tests: domains are XML strings and a
running flag; failures are injected per operation. The end-to-end tests use the real libvirtd.

It keeps libvirt's semantics where the manager could tell the difference, and
tests/libvirt/test_hypervisor.py holds it to them: the same promises run against it and against
``LibvirtHypervisor`` on libvirt's test driver."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from uuid import uuid4

from framework import fake_sysfs
from lxml import etree

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound
from vmsandbox.vm import domain as domain_xml
from vmsandbox.vm.hypervisor import Stored

_SANDBOX = f"{{{domain_xml.METADATA_NS}}}sandbox"


@dataclass
class FakeDomain:
    """One domain, as libvirt keeps it: ``xml`` with ``data`` and ``state`` (its record) is
    what the domain runs with, or will start with when it is off; ``next_xml`` a definition
    given while it runs (libvirt's next config: what ``definition`` returns, in effect once the
    guest is off). Devices attached with ``attach`` are in both (AFFECT_LIVE | AFFECT_CONFIG);
    ``attached`` lists those attached to the running guest since it started. ``saved``: the
    size of its managed save (None: none), made by ``save``, restored by ``start``."""

    xml: str
    data: dict[str, Any] | None
    state: str
    uuid: str = ""
    running: bool = False
    reason: str = "never started"
    ignores_acpi: bool = False
    attached: list[str] = field(default_factory=list)  # device XMLs attached live, this boot
    persistent: bool = True  # False once undefined while running: gone when it stops
    next_xml: str | None = None
    saved: int | None = None

    def change(self, edit: Callable[[etree._Element], None]) -> None:
        """Apply ``edit`` to the running and the next definition alike."""
        self.xml = _edited(self.xml, edit)
        if self.next_xml is not None:
            self.next_xml = _edited(self.next_xml, edit)


@dataclass
class FakeHypervisor:
    domains: dict[str, FakeDomain] = field(default_factory=dict)
    leases: dict[str, str] = field(default_factory=dict)
    # domain name -> what its guest's end of each virtio channel is (by channel name), as the
    # QEMU driver reports it; unknown (None) otherwise, as libvirt's test driver reports it
    channels: dict[str, dict[str, str]] = field(default_factory=dict)
    # operation name -> called with the domain name before the operation; may raise
    before: dict[str, Callable[[str], None]] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def _hook(self, operation: str, domain: str) -> None:
        self.calls.append((operation, domain))
        if operation in self.before:
            self.before[operation](domain)

    def _get(self, domain: str, uuid: str | None = None) -> FakeDomain:
        name = self._named(domain, uuid)
        if name is None:
            raise NotFound(f"no domain {domain!r}" + (f" with uuid {uuid}" if uuid else ""))
        return self.domains[name]

    def define(self, xml: str) -> None:
        """As libvirt: a definition replaces the one of the domain with its name and UUID (a
        running guest runs on, on the old one, until it is off); a name held under another
        UUID, or a UUID under another name, is refused."""
        root = etree.fromstring(xml.encode())
        name = root.findtext("name")
        self._hook("define", name)
        old = self.domains.get(name)
        uuid = root.findtext("uuid") or (old.uuid if old else "") or str(uuid4())
        if old is not None and old.uuid and old.uuid != uuid:
            raise FailedPrecondition(f"domain {name!r} already exists with uuid {old.uuid}")
        namesake = next((n for n, d in self.domains.items() if d.uuid == uuid and n != name), None)
        if namesake is not None:
            raise FailedPrecondition(f"domain {namesake!r} is already defined with uuid {uuid}")
        if old is not None and old.running:
            old.next_xml, old.persistent = xml, True
            return
        data, state = _record(xml)
        if old is None:
            self.domains[name] = FakeDomain(xml, data, state, uuid)
        else:
            self.domains[name] = replace(old, xml=xml, data=data, state=state, persistent=True)

    def _named(self, domain: str, uuid: str | None) -> str | None:
        """The name of the domain with ``uuid`` (when given), else ``domain`` if it exists."""
        if uuid:
            return next((n for n, d in self.domains.items() if d.uuid == uuid), None)
        return domain if domain in self.domains else None

    def start(self, domain: str, uuid: str | None = None) -> None:
        """Boot, or restore the managed save (which is then gone), as libvirt's create."""
        self._hook("start", domain)
        dom = self._get(domain, uuid)
        if dom.running:
            raise FailedPrecondition(f"starting domain {domain!r}: domain is already running")
        dom.running, dom.saved = True, None

    # The bytes a fake save takes: a guest's memory as it would be saved (a tenth, touched).
    SAVE_FRACTION = 10

    def save(self, domain: str, uuid: str | None = None) -> None:
        """As libvirt's managed save: a running guest only, and none holding a host PCI
        device (QEMU cannot migrate one); it is off afterwards, its devices kept."""
        self._hook("save", domain)
        dom = self._get(domain, uuid)
        if not dom.running:
            raise FailedPrecondition(f"saving domain {domain!r}: domain is not running")
        if etree.fromstring(dom.xml.encode()).find("devices/hostdev") is not None:
            raise FailedPrecondition(
                f"saving domain {domain!r}: libvirt refused: Requested operation is not valid: "
                "domain has assigned non-USB host devices"
            )
        memory = int(etree.fromstring(dom.xml.encode()).findtext("memory") or 0)
        dom.running, dom.reason = False, "its memory was saved to disk (suspended)"
        dom.saved = memory * 2**20 // self.SAVE_FRACTION
        dom.attached.clear()

    def saved(self, domain: str, uuid: str | None = None) -> int | None:
        self._hook("saved", domain)
        name = self._named(domain, uuid)
        return None if name is None else self.domains[name].saved

    def discard_save(self, domain: str, uuid: str | None = None) -> None:
        self._hook("discard_save", domain)
        name = self._named(domain, uuid)
        if name is not None:
            self.domains[name].saved = None

    def _powered_off(self, name: str, reason: str) -> None:
        """As libvirt when a guest is off: its live devices are given back, a domain
        undefined while it ran (transient) is gone, and a definition given while it ran is
        the one it starts with next."""
        dom = self.domains[name]
        dom.running, dom.reason = False, reason
        dom.attached.clear()  # the definition keeps what was attached with AFFECT_CONFIG
        if not dom.persistent:
            del self.domains[name]
        elif dom.next_xml is not None:
            dom.xml, dom.next_xml = dom.next_xml, None
            dom.data, dom.state = _record(dom.xml)

    def stop(self, domain: str, uuid: str | None = None) -> None:
        self._hook("stop", domain)
        name = self._named(domain, uuid)
        if name is not None and self.domains[name].running:
            self._powered_off(name, "it was forced off (destroyed)")

    def shutdown(self, domain: str, uuid: str | None = None) -> None:
        """The ACPI button: a fake guest powers off at once unless it ``ignores_acpi``."""
        self._hook("shutdown", domain)
        name = self._named(domain, uuid)
        dom = self.domains[name] if name is not None else None
        if name is not None and dom is not None and dom.running and not dom.ignores_acpi:
            self._powered_off(name, "the guest powered itself off")

    def undefine(self, domain: str, uuid: str | None = None) -> None:
        """As libvirt: a running guest runs on without a definition until it is off."""
        self._hook("undefine", domain)
        name = self._named(domain, uuid)
        if name is None:
            return
        if self.domains[name].running:
            self.domains[name].persistent, self.domains[name].next_xml = False, None
        else:
            del self.domains[name]

    def running(self, domain: str, uuid: str | None = None) -> bool:
        self._hook("running", domain)
        name = self._named(domain, uuid)
        return name is not None and self.domains[name].running

    def stop_reason(self, domain: str, uuid: str | None = None) -> str:
        """Never raises, as ``LibvirtHypervisor``'s: it words an error already being raised."""
        name = self._named(domain, uuid)
        if name is None:
            return f"its state cannot be read: no domain {domain!r}"
        return self.domains[name].reason

    def every_domain(self) -> list[Stored]:
        self._hook("every_domain", "")
        return [
            Stored(name, dom.data, dom.state, dom.uuid, self._hostdevs(dom))
            for name, dom in self.domains.items()
        ]

    def list(self, prefix: str) -> list[Stored]:
        """Without hostdevs: only ``every_domain`` reads them (``Stored``)."""
        self._hook("list", prefix)
        return [
            replace(stored, hostdevs=())
            for stored in self.every_domain()
            if stored.domain.startswith(prefix)
        ]

    def metadata(self, domain: str, uuid: str | None = None) -> Stored | None:
        self._hook("metadata", domain)
        name = self._named(domain, uuid)
        if name is None:
            return None
        dom = self.domains[name]
        return Stored(name, dom.data, dom.state, dom.uuid)

    def definition(self, domain: str, uuid: str | None = None) -> str:
        """The persistent definition: the next one, while a guest runs on an older one."""
        self._hook("definition", domain)
        dom = self._get(domain, uuid)
        return dom.next_xml if dom.next_xml is not None else dom.xml

    def set_metadata(
        self, domain: str, data: dict[str, Any], state: str, uuid: str | None = None
    ) -> None:
        """The record, state and title, in the definition too (AFFECT_LIVE | AFFECT_CONFIG)."""
        self._hook("set_metadata", domain)
        dom = self._get(domain, uuid)
        dom.data, dom.state = data, state
        dom.change(lambda root: _set_record(root, data, state))

    def lease_address(self, domain: str, uuid: str | None = None) -> str | None:
        name = self._named(domain, uuid)
        return self.leases.get(name) if name is not None else None

    def channel_state(self, domain: str, name: str, uuid: str | None = None) -> str | None:
        named = self._named(domain, uuid)
        if named is None or not self.domains[named].running:
            return None
        return self.channels.get(named, {}).get(name)

    @staticmethod
    def _hostdevs(dom: FakeDomain) -> tuple[str, ...]:
        """What the running guest holds and what its definitions name, as libvirt's live and
        inactive XML."""
        from vmsandbox.host.holders import hostdev_addresses

        found: dict[str, None] = {}
        for xml in (dom.next_xml, dom.xml):  # the inactive XML first, as libvirt is read
            if xml is not None:
                found.update(dict.fromkeys(hostdev_addresses(xml)))
        return tuple(found)

    def hostdev_holders(self) -> dict[str, str]:
        """BDF -> domain for the hostdevs of every domain's XML and of what was attached."""
        holders: dict[str, str] = {}
        for stored in self.every_domain():
            for bdf in stored.hostdevs:
                holders.setdefault(bdf, stored.domain)
        return holders

    def attach(self, domain: str, xml: str, uuid: str | None = None) -> None:
        """To the running guest and to its definition (AFFECT_LIVE | AFFECT_CONFIG): a stopped
        and restarted domain keeps the device."""
        self._hook("attach", domain)
        dom = self._get(domain, uuid)
        if not dom.running:
            raise FailedPrecondition(f"domain {domain!r} is not running")
        dom.attached.append(xml)
        dom.change(lambda root: _devices(root).append(etree.fromstring(xml.encode())))

    def detach(self, domain: str, xml: str, uuid: str | None = None) -> None:
        """From the running guest and its definition, a host device found by its source
        address as libvirt finds it (attached live or defined at boot). As libvirt 9.0: one
        function of a multifunction slot cannot be hot-unplugged; a guest that is not running,
        or does not hold the device, is left as it is."""
        self._hook("detach", domain)
        name = self._named(domain, uuid)
        dom = self.domains[name] if name is not None else None
        if dom is None or not dom.running:
            return
        held = _hostdev(etree.fromstring(dom.xml.encode()), xml)
        if held is None:
            return
        slot = _guest_slot(etree.tostring(held, encoding="unicode"))
        live = etree.fromstring(dom.xml.encode()).iterfind("devices/hostdev")
        shared = sum(1 for other in live if _guest_slot(etree.tostring(other).decode()) == slot)
        if slot != (None, None) and shared > 1:
            raise FailedPrecondition(
                f"detaching a device from domain {domain!r}: libvirt refused: cannot hot "
                "unplug multifunction PCI device"
            )
        dom.attached[:] = [other for other in dom.attached if _source(other) != _source(xml)]
        dom.change(lambda root: _remove_hostdev(root, xml))

    def close(self) -> None:
        """Nothing to close."""


def _record(xml: str) -> tuple[dict[str, Any] | None, str]:
    parsed = domain_xml.read_metadata(xml)
    return parsed if parsed else (None, "unknown")


def _edited(xml: str, edit: Callable[[etree._Element], None]) -> str:
    root = etree.fromstring(xml.encode())
    edit(root)
    return etree.tostring(root, encoding="unicode")


def _devices(root: etree._Element) -> etree._Element:
    devices = root.find("devices")
    return devices if devices is not None else etree.SubElement(root, "devices")


def _set_record(root: etree._Element, data: dict[str, Any], state: str) -> None:
    """Our metadata element and the title, as ``virDomainSetMetadata`` sets them."""
    title = root.find("title")
    if title is None:
        title = etree.Element("title")
        anchor = next(
            (root.find(tag) for tag in ("uuid", "name") if root.find(tag) is not None), None
        )
        if anchor is not None:
            anchor.addnext(title)
        else:
            root.insert(0, title)
    title.text = str(data["name"])
    metadata = root.find("metadata")
    if metadata is None:
        metadata = etree.Element("metadata")
        title.addnext(metadata)
    for old in metadata.findall(_SANDBOX):
        metadata.remove(old)
    sandbox = etree.SubElement(
        metadata, _SANDBOX, nsmap={domain_xml.METADATA_KEY: domain_xml.METADATA_NS}
    )
    sandbox.set("state", state)
    sandbox.text = json.dumps(data, sort_keys=True)  # as domain_xml.metadata_xml


def _canonical(element: etree._Element) -> bytes:
    return etree.tostring(element, method="c14n", exclusive=True, with_comments=False)


def _source(xml: str) -> str | None:
    """A hostdev's host address, as libvirt matches a device to detach."""
    address = etree.fromstring(xml.encode()).find("source/address")
    return None if address is None else _canonical(address).decode()


def _hostdev(root: etree._Element, xml: str) -> etree._Element | None:
    wanted = _source(xml)
    found = root.iterfind("devices/hostdev")
    return next((h for h in found if _source(etree.tostring(h).decode()) == wanted), None)


def _remove_hostdev(root: etree._Element, xml: str) -> None:
    found = _hostdev(root, xml)
    if found is not None:
        found.getparent().remove(found)


def _guest_slot(xml: str) -> tuple[str | None, str | None]:
    address = etree.fromstring(xml.encode()).find("address")
    return (address.get("bus"), address.get("slot")) if address is not None else (None, None)


def refuse(message: str) -> Callable[[str], None]:
    """A ``before`` hook that fails the operation as libvirt would."""

    def hook(_domain: str) -> None:
        raise FailedPrecondition(message)

    return hook


IMAGE_ID = "00000000000000aa"


def unit_config(tmp_path: Path, **overrides: object) -> Config:
    """A config for manager unit tests on the fake hypervisor: a state directory, an image
    store holding one 16 MiB qcow2 image, ``tiny``, and GPU custody's sysfs in a fake tree
    where every fake host's GPU resets well (framework/fake_sysfs.py)."""
    build = tmp_path / "images" / "tiny" / IMAGE_ID
    build.mkdir(parents=True)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(build / "disk.qcow2"), "16M"], check=True
    )
    meta = {"kind": "import", "name": "tiny", "id": IMAGE_ID, "virtual_size": 16 * 2**20}
    (build / "meta.json").write_text(json.dumps(meta))
    (build.parent / "current").symlink_to(IMAGE_ID)
    return Config.load(
        path="/nonexistent",
        uri="test:///fake",
        state_dir=tmp_path / "state",
        image_dir=tmp_path / "images",
        virt_type="qemu",
        **{"pci_sysfs": fake_sysfs.shared(), **overrides},
    )
