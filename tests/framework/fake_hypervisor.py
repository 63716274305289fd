"""An in-memory ``Hypervisor`` for the manager's unit tests: domains are XML strings and a
running flag; failures are injected per operation. The end-to-end tests use the real libvirtd."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

from lxml import etree

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound
from vmsandbox.vm import domain as domain_xml
from vmsandbox.vm.hypervisor import Stored


@dataclass
class FakeDomain:
    xml: str
    data: dict[str, Any] | None
    state: str
    uuid: str = ""
    running: bool = False
    reason: str = "never started"
    ignores_acpi: bool = False
    attached: list[str] = field(default_factory=list)  # device XMLs attached since define


@dataclass
class FakeHypervisor:
    domains: dict[str, FakeDomain] = field(default_factory=dict)
    leases: dict[str, str] = field(default_factory=dict)
    # operation name -> called with the domain name before the operation; may raise
    before: dict[str, Callable[[str], None]] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def _hook(self, operation: str, domain: str) -> None:
        self.calls.append((operation, domain))
        if operation in self.before:
            self.before[operation](domain)

    def _get(self, domain: str) -> FakeDomain:
        if domain not in self.domains:
            raise NotFound(f"no domain {domain!r}")
        return self.domains[domain]

    def define(self, xml: str) -> None:
        root = etree.fromstring(xml.encode())
        name = root.findtext("name")
        self._hook("define", name)
        parsed = domain_xml.read_metadata(xml)
        data, state = parsed if parsed else (None, "unknown")
        old = self.domains.get(name)
        uuid = root.findtext("uuid") or (old.uuid if old else "") or str(uuid4())
        if old is not None and old.uuid and old.uuid != uuid:
            raise FailedPrecondition(f"domain {name!r} already exists with uuid {old.uuid}")
        self.domains[name] = FakeDomain(
            xml, data, state, uuid, running=bool(old and old.running), attached=[]
        )

    def _named(self, domain: str, uuid: str | None) -> str | None:
        """The name of the domain with ``uuid`` (when given), else ``domain`` if it exists."""
        if uuid:
            return next((n for n, d in self.domains.items() if d.uuid == uuid), None)
        return domain if domain in self.domains else None

    def start(self, domain: str) -> None:
        self._hook("start", domain)
        self._get(domain).running = True

    def stop(self, domain: str, uuid: str | None = None) -> None:
        self._hook("stop", domain)
        name = self._named(domain, uuid)
        if name is not None:
            self.domains[name].running = False
            self.domains[name].reason = "it was forced off (destroyed)"
            self.domains[name].attached.clear()  # libvirt gives live-attached devices back

    def shutdown(self, domain: str) -> None:
        """The ACPI button: a fake guest powers off at once unless it ``ignores_acpi``."""
        self._hook("shutdown", domain)
        dom = self.domains.get(domain)
        if dom is not None and dom.running and not dom.ignores_acpi:
            dom.running = False
            dom.reason = "the guest powered itself off"

    def undefine(self, domain: str, uuid: str | None = None) -> None:
        self._hook("undefine", domain)
        name = self._named(domain, uuid)
        if name is not None:
            self.domains.pop(name)

    def running(self, domain: str) -> bool:
        return domain in self.domains and self.domains[domain].running

    def stop_reason(self, domain: str) -> str:
        return self._get(domain).reason

    def every_domain(self) -> list[Stored]:
        self._hook("every_domain", "")
        return [
            Stored(name, dom.data, dom.state, dom.uuid, self._hostdevs(dom))
            for name, dom in self.domains.items()
        ]

    def list(self, prefix: str) -> list[Stored]:
        self._hook("list", prefix)
        return [stored for stored in self.every_domain() if stored.domain.startswith(prefix)]

    def metadata(self, domain: str) -> Stored | None:
        self._hook("metadata", domain)
        dom = self.domains.get(domain)
        return Stored(domain, dom.data, dom.state, dom.uuid) if dom else None

    def definition(self, domain: str) -> str:
        return self._get(domain).xml

    def set_metadata(self, domain: str, data: dict[str, Any], state: str) -> None:
        self._hook("set_metadata", domain)
        dom = self._get(domain)
        dom.data, dom.state = data, state

    def lease_address(self, domain: str) -> str | None:
        return self.leases.get(domain)

    @staticmethod
    def _hostdevs(dom: FakeDomain) -> tuple[str, ...]:
        from vmsandbox.host.holders import hostdev_addresses

        found: dict[str, None] = {}
        for xml in (dom.xml, *(f"<domain><devices>{d}</devices></domain>" for d in dom.attached)):
            found.update(dict.fromkeys(hostdev_addresses(xml)))
        return tuple(found)

    def hostdev_holders(self) -> dict[str, str]:
        """BDF -> domain for the hostdevs of every domain's XML and of what was attached."""
        holders: dict[str, str] = {}
        for stored in self.every_domain():
            for bdf in stored.hostdevs:
                holders.setdefault(bdf, stored.domain)
        return holders

    def attach(self, domain: str, xml: str) -> None:
        self._hook("attach", domain)
        dom = self._get(domain)
        if not dom.running:
            raise FailedPrecondition(f"domain {domain!r} is not running")
        dom.attached.append(xml)

    def detach(self, domain: str, xml: str) -> None:
        """As libvirt 9.0: one function of a multifunction slot cannot be hot-unplugged."""
        self._hook("detach", domain)
        dom = self.domains.get(domain)
        if dom is None or xml not in dom.attached:
            return
        slot = _guest_slot(xml)
        if sum(1 for other in dom.attached if _guest_slot(other) == slot) > 1:
            raise FailedPrecondition(
                f"detaching a device from domain {domain!r}: libvirt refused: cannot hot "
                "unplug multifunction PCI device"
            )
        dom.attached.remove(xml)

    def close(self) -> None:
        """Nothing to close."""


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
    """A config for manager unit tests on the fake hypervisor: a state directory and an image
    store holding one 16 MiB qcow2 image, ``tiny``."""
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
        **overrides,
    )
