"""Domains that a fault paused: QEMU stops a guest whose passed-through device reported an
unrecoverable error (its VFIO error handler, on the AER the host kernel passes on to vfio-pci),
and libvirt reports the domain paused. vmsandbox itself never pauses a domain, so any domain
paused for one of these reasons is a fault of its devices (or of QEMU).
"""

from __future__ import annotations

import libvirt

from vmsandbox.vm.connection import libvirt_errors

# virDomainPausedReason as words (libvirt-domain.h), by the constants' names: an older
# libvirt-python lacks the newer ones (API_ERROR came with libvirt 10.2).
_NAMES = (
    "UNKNOWN",
    "USER",
    "MIGRATION",
    "SAVE",
    "DUMP",
    "IOERROR",
    "WATCHDOG",
    "FROM_SNAPSHOT",
    "SHUTTING_DOWN",
    "SNAPSHOT",
    "CRASHED",
    "STARTING_UP",
    "POSTCOPY",
    "POSTCOPY_FAILED",
    "API_ERROR",
)
PAUSED_REASONS: dict[int, str] = {
    getattr(libvirt, f"VIR_DOMAIN_PAUSED_{name}"): name.lower().replace("_", " ")
    for name in _NAMES
    if hasattr(libvirt, f"VIR_DOMAIN_PAUSED_{name}")
}


def paused(conn: libvirt.virConnect) -> dict[str, str]:
    """Every paused domain of the connection, by name, with why libvirt says it is paused."""
    found: dict[str, str] = {}
    with libvirt_errors("listing paused domains"):
        domains = conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_PAUSED)
    for dom in domains:
        try:
            state, reason = dom.state()
        except libvirt.libvirtError:
            continue  # gone since the listing
        if state == libvirt.VIR_DOMAIN_PAUSED:
            found[dom.name()] = PAUSED_REASONS.get(reason, f"reason {reason}")
    return found
