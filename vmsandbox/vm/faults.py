"""Domains that a fault paused: QEMU stops a guest whose passed-through device reported an
unrecoverable error (its VFIO error handler, on the AER the host kernel passes on to vfio-pci),
and libvirt reports the domain paused. vmsandbox itself never pauses a domain, so any domain
paused for one of these reasons is a fault of its devices (or of QEMU).
"""

from __future__ import annotations

import libvirt

from vmsandbox.vm.hypervisor import libvirt_errors

# virDomainPausedReason as words (libvirt-domain.h); the health signals read the words.
PAUSED_REASONS = {
    libvirt.VIR_DOMAIN_PAUSED_UNKNOWN: "unknown",
    libvirt.VIR_DOMAIN_PAUSED_USER: "user",
    libvirt.VIR_DOMAIN_PAUSED_MIGRATION: "migration",
    libvirt.VIR_DOMAIN_PAUSED_SAVE: "save",
    libvirt.VIR_DOMAIN_PAUSED_DUMP: "dump",
    libvirt.VIR_DOMAIN_PAUSED_IOERROR: "ioerror",
    libvirt.VIR_DOMAIN_PAUSED_WATCHDOG: "watchdog",
    libvirt.VIR_DOMAIN_PAUSED_FROM_SNAPSHOT: "from snapshot",
    libvirt.VIR_DOMAIN_PAUSED_SHUTTING_DOWN: "shutting down",
    libvirt.VIR_DOMAIN_PAUSED_SNAPSHOT: "snapshot",
    libvirt.VIR_DOMAIN_PAUSED_CRASHED: "crashed",
    libvirt.VIR_DOMAIN_PAUSED_STARTING_UP: "starting up",
    libvirt.VIR_DOMAIN_PAUSED_POSTCOPY: "postcopy",
    libvirt.VIR_DOMAIN_PAUSED_POSTCOPY_FAILED: "postcopy failed",
    libvirt.VIR_DOMAIN_PAUSED_API_ERROR: "api error",
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
