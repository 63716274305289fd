"""Which libvirt domain holds which PCI device, read from the domains' XML.

libvirt is the source of truth for GPUs in use: every domain on the connection (ours or not,
running or not) whose XML names a PCI ``<hostdev>`` holds that device. The persistent
(inactive) XML says what a domain takes when it starts; for a running domain the live XML is
read too, since a device attached live appears only there.
"""

from __future__ import annotations

import libvirt
from lxml import etree

from .bdf import format_bdf

_HOSTDEV_ADDRESSES = etree.XPath(
    "/domain/devices/hostdev[@mode='subsystem'][@type='pci']/source/address"
)


def hostdev_addresses(domain_xml: str | bytes) -> list[str]:
    """Canonical BDFs of the PCI hostdevs in one domain XML document."""
    root = etree.fromstring(domain_xml.encode() if isinstance(domain_xml, str) else domain_xml)
    return [
        format_bdf(
            int(address.get("domain", "0"), 0),
            int(address.get("bus"), 0),
            int(address.get("slot"), 0),
            int(address.get("function", "0"), 0),
        )
        for address in _HOSTDEV_ADDRESSES(root)
    ]


def _domain_xmls(domain: libvirt.virDomain) -> list[str]:
    xmls = [domain.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)]
    if domain.isActive():
        xmls.append(domain.XMLDesc(0))
    return xmls


def domain_hostdevs(domain: libvirt.virDomain) -> tuple[str, ...]:
    """Canonical BDFs one domain holds: its persistent XML's, and its live XML's while it runs
    (a device attached live). libvirtError when the domain cannot be read."""
    found: dict[str, None] = {}
    for xml in _domain_xmls(domain):
        found.update(dict.fromkeys(hostdev_addresses(xml)))
    return tuple(found)


def libvirt_hostdev_holders(conn: libvirt.virConnect) -> dict[str, str]:
    """Map canonical BDF -> name of the domain whose XML holds it, over all domains. Any
    error but a domain undefined while it was read propagates: a holder left out would make
    its GPU look free."""
    holders: dict[str, str] = {}
    for domain in conn.listAllDomains(0):
        try:
            held = domain_hostdevs(domain)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                continue  # undefined between listing and reading
            raise
        for bdf in held:
            holders.setdefault(bdf, domain.name())
    return holders
