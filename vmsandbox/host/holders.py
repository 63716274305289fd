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


def libvirt_hostdev_holders(conn: libvirt.virConnect) -> dict[str, str]:
    """Map canonical BDF -> name of the domain whose XML holds it, over all domains."""
    holders: dict[str, str] = {}
    for domain in conn.listAllDomains(0):
        try:
            xmls = _domain_xmls(domain)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                continue  # undefined between listing and reading
            raise
        name = domain.name()
        for xml in xmls:
            for bdf in hostdev_addresses(xml):
                holders.setdefault(bdf, name)
    return holders
