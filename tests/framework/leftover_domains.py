"""Domains a test module left defined on the system libvirtd.

A running guest shows up in the session-end process check (framework/processes.py); a domain
that is only defined, shut off or parked (its memory in libvirt's save file) runs no process
and would slip through, yet a later test that lists the host's sandboxes sees it. After each
module that may touch libvirt, tests/conftest.py removes the domains the module defined in a
directory this run made (not the session's shared state directory) and names them in the run's
summary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from lxml import etree

SYSTEM_URI = "qemu:///system"


@dataclass(frozen=True)
class LeftDomain:
    """One domain a module left behind."""

    module: str
    name: str
    folder: str


def defined() -> dict[str, str] | None:
    """UUID -> XML of every domain the system libvirtd has; None when it cannot be reached."""
    import libvirt

    try:
        conn = libvirt.open(SYSTEM_URI)
    except libvirt.libvirtError:
        return None
    try:
        found = {}
        for dom in conn.listAllDomains(0):
            with contextlib.suppress(libvirt.libvirtError):  # undefined while we looked
                found[dom.UUIDString()] = dom.XMLDesc(0)
        return found
    finally:
        conn.close()


def new_in(before: dict[str, str], dirs: set[str], module: str) -> list[tuple[str, LeftDomain]]:
    """The domains defined since ``before`` whose XML names one of ``dirs``: UUID, what."""
    now = defined() or {}
    prefixes = sorted(d.rstrip("/") + "/" for d in dirs)
    left = []
    for uuid, xml in now.items():
        if uuid in before:
            continue
        folder = next((p for p in prefixes if p in xml), None)
        if folder is not None:
            name = etree.fromstring(xml.encode()).findtext("name", "")
            left.append((uuid, LeftDomain(module, name, folder)))
    return left


def remove(uuid: str) -> None:
    """Stop and undefine domain ``uuid`` with its save file, whatever state it is in."""
    import libvirt

    conn = libvirt.open(SYSTEM_URI)
    try:
        with contextlib.suppress(libvirt.libvirtError):
            dom = conn.lookupByUUIDString(uuid)
            if dom.isActive():
                dom.destroy()
            dom.undefineFlags(
                libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
            )
    finally:
        conn.close()
