"""The GPU steps of claiming a GPU-ready pooled guest: its GPUs attached live, seen, verified.

steps.py runs them in ``GPU_CLAIM_STEPS``: under the host lock the GPUs are chosen by the
allocator a cold create uses, the pooled guest is taken, and its hold and record name the
GPUs (steps.py's ``claim``: the hold reserves them from then on). Outside the lock (live
attach pins all guest memory: seconds on a large guest) each GPU is attached with its
companions to a spare root port (``attach``), the guest is waited for until it sees every GPU
(``seen``), and the in-guest verification runs (``verified``). Any failure stops the guest,
which gives the GPUs back to their host drivers, and removes it (the claim's undos): it never
returns to the pool.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace

from vmsandbox.errors import DeadlineExceeded, FailedPrecondition
from vmsandbox.gpu import hotplug
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.host.bdf import libvirt_address
from vmsandbox.progress import Progress
from vmsandbox.sandbox import create
from vmsandbox.sandbox.record import HotplugRecord, SandboxRecord

# How long a guest may take to see attached GPUs: seen after 3-5 s on the nested host (L2
# under KVM in a TCG L1), under load up to a few times that.
SEEN_TIMEOUT = 60.0
SEEN_POLL = 0.5
# The guest's answer: one "<port> <vendor> <device>" line per function 0 below a spare port.
_SEEN_SCRIPT = (
    "for port in {ports}; do for fn in /sys/bus/pci/devices/$port/0000:*:00.0; do "
    '[ -e "$fn/vendor" ] && echo "$port $(cat $fn/vendor) $(cat $fn/device)"; done; done; true'
)


def attach(c: create.Creation) -> None:
    """Attach each GPU with its companions to the next spare root port of the claimed guest."""
    record = c.record
    assert record is not None and record.hotplug is not None  # the claim took a GPU-ready one
    for gpu, bus, xml in _hostdevs(record, record.hotplug):
        c.progress(f"attaching GPU {gpu.bdf} to the guest's spare port (bus {bus})")
        c.hypervisor.attach(c.domain, xml, uuid=c.uuid)


def _hostdevs(record: SandboxRecord, ports: HotplugRecord) -> Iterator[tuple[GpuRecord, int, str]]:
    """(GPU, port bus, hostdev XML) per function, GPU by GPU in port order; a card's
    companions before its function 0, whose arrival makes the guest scan the slot."""
    if len(record.gpus) > len(ports.buses):
        raise FailedPrecondition(
            f"sandbox {record.name!r} has {len(record.gpus)} GPUs and its guest "
            f"{len(ports.buses)} spare ports",
            details={"name": record.name},
        )
    for gpu, bus in zip(record.gpus, ports.buses, strict=False):
        functions = sorted(
            (gpu.bdf, *gpu.companions), key=lambda bdf: libvirt_address(bdf)["function"]
        )
        for bdf in (*functions[1:], functions[0]):
            xml = hotplug.hostdev_xml(
                bdf, bus, multifunction=len(functions) > 1, firmware=ports.firmware
            )
            yield gpu, bus, xml


def seen(c: create.Creation) -> None:
    """Wait until the guest sees each GPU (its vendor and device id) below its spare port;
    DEADLINE_EXCEEDED naming the GPUs it does not see after ``SEEN_TIMEOUT``."""
    record = c.record
    assert record is not None and c.endpoint is not None  # made by the claim and hostname steps
    wanted = {
        hotplug.guest_port(port): (gpu.bdf, gpu.vendor_id.lower(), gpu.device_id.lower())
        for port, gpu in enumerate(record.gpus)
    }
    run = functools.partial(c.guest_run, c.endpoint, c.files.keys(record.host_key_alias))
    wait_seen(run, wanted, c.name, c.progress)


def wait_seen(
    run: Callable[..., ExecResult],
    wanted: Mapping[str, tuple[str, str, str]],
    name: str,
    progress: Progress,
) -> None:
    """Wait until the guest (its commands run by ``run``) sees, below each root port of
    ``wanted`` (its guest PCI address -> host BDF, vendor id, device id of the GPU attached
    to it), that GPU; DEADLINE_EXCEEDED naming the GPUs it does not see after
    ``SEEN_TIMEOUT``."""
    if not wanted:
        return
    command = _SEEN_SCRIPT.format(ports=" ".join(wanted))
    started = time.monotonic()
    deadline = started + SEEN_TIMEOUT
    while True:
        found = {}
        for line in run(command, timeout=SEEN_TIMEOUT).stdout.splitlines():
            port, vendor, device = [*line.split(), "", "", ""][:3]
            found[port] = (vendor.lower(), device.lower())
        missing = [bdf for port, (bdf, *ids) in wanted.items() if found.get(port) != tuple(ids)]
        if not missing:
            progress(f"the guest sees its GPUs after {time.monotonic() - started:.1f} s")
            return
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(
                f"sandbox {name!r}: the guest did not see GPU {', '.join(missing)} within "
                f"{SEEN_TIMEOUT:.0f} s of attaching it (below its ports it saw "
                f"{found or 'nothing'})",
                details={"name": name, "missing": missing},
            )
        time.sleep(SEEN_POLL)


def verified(c: create.Creation) -> None:
    """The in-guest verification of the attached GPUs; GuestVerificationFailed when it fails
    (the claim's undos then take the guest apart)."""
    from vmsandbox.guest.verify import VerificationReport, raise_if_failed

    assert c.record is not None and c.endpoint is not None
    if not c.verify:
        return
    c.progress("verifying the guest's devices")
    report = create.verify_guest(c.record, c.endpoint, c.files, c.guest_run)
    c.record = replace(c.record, verification=report)
    raise_if_failed(VerificationReport.from_dict(report), subject=f"sandbox {c.name!r}")
