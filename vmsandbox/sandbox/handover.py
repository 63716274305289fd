"""A suspended sandbox's GPUs handed over: taken out of the running guest before its memory is
saved, and attached at the same guest slots once it is restored (suspend.py, resume.py).

A GPU sits behind a root port of its own: one of a cold-made sandbox's (passthrough.py) or a
spare port of a claimed pooled guest (hotplug.py). The port stays in the domain; only the
GPU's ``<hostdev>`` elements go and come back, so a GPU of the same model attached at the
port's bus sits where the old one sat (same guest PCI address). Unplugging a GPU under a
loaded NVIDIA driver is unsupported, so the guest lets the GPU go first (guest/quiesce.py)
and takes up the new one only once it is attached and seen.

libvirt 9.0 cannot hot-unplug one function of a multifunction slot: a card with companions
(HDMI audio, USB, UCSI: consumer cards) cannot be detached from a running guest, so such a
sandbox is refused a suspend before anything is touched (``check_detachable``). Data-center
GPUs have one function. A sandbox on an NVSwitch board in full passthrough is refused too:
the NVSwitches passed along cannot leave a running guest. GPUs joined by a Fabric Manager
partition (shared NVSwitch mode) are handed over like any others; the suspend deactivates
their partition once they are out of the guest, since FM lets them be reset only then, and the
resume activates a free partition of the same size before it attaches its GPUs (suspend.py,
resume.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

from vmsandbox.errors import DeadlineExceeded, FailedPrecondition
from vmsandbox.gpu import hotplug
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.guest import quiesce
from vmsandbox.guest.ssh import Endpoint, ExecResult
from vmsandbox.host.bdf import libvirt_address
from vmsandbox.progress import Progress
from vmsandbox.sandbox.pool.gpu_steps import wait_seen
from vmsandbox.sandbox.record import SandboxFiles, SandboxRecord
from vmsandbox.sandbox.suspension import Suspension
from vmsandbox.vm.hypervisor import Hypervisor

# How long libvirt may take to see a detached GPU gone from the guest (the guest ejects it
# through ACPI: a second or two, longer under load).
DETACH_TIMEOUT = 60.0
DETACH_POLL = 0.2
GuestRun = Callable[..., ExecResult]


def check_detachable(record: SandboxRecord) -> None:
    """FAILED_PRECONDITION for a sandbox with a GPU of several functions or with NVSwitches
    (module docstring)."""
    if record.switches:
        raise FailedPrecondition(
            f"sandbox {record.name!r} cannot be suspended: NVSwitches "
            f"{', '.join(record.switches)} are passed to it (full passthrough), and NVSwitches "
            "cannot leave a running guest; stop or destroy it instead",
            details={"name": record.name, "switches": list(record.switches)},
        )
    shared = [gpu.bdf for gpu in record.gpus if gpu.companions]
    if shared:
        raise FailedPrecondition(
            f"sandbox {record.name!r} cannot be suspended: GPU {', '.join(shared)} shares its "
            "slot with other functions (audio, USB), and libvirt 9.0 cannot take one function "
            "of a slot out of a running guest",
            details={"name": record.name, "gpus": shared},
        )


def function_ids(gpus: tuple[GpuRecord, ...]) -> list[str]:
    """``vendor:device`` of every function of ``gpus``, as the guest program takes them."""
    ids = {f"{gpu.vendor_id[2:]}:{gpu.device_id[2:]}".lower() for gpu in gpus}
    ids |= {f"{v[2:]}:{d[2:]}".lower() for gpu in gpus for v, d in gpu.companion_ids}
    return sorted(ids)


def hostdevs(gpu: GpuRecord, bus: int, firmware: str) -> Iterator[tuple[str, str]]:
    """(host function, hostdev XML) of each function of ``gpu`` at guest ``bus``, companions
    before function 0 (whose arrival makes the guest scan the slot)."""
    functions = sorted((gpu.bdf, *gpu.companions), key=lambda bdf: libvirt_address(bdf)["function"])
    for bdf in (*functions[1:], functions[0]):
        multifunction = len(functions) > 1
        yield bdf, hotplug.hostdev_xml(bdf, bus, multifunction=multifunction, firmware=firmware)


def suspension(record: SandboxRecord, definition: str, at: str) -> Suspension:
    """What a suspend of ``record`` keeps: the GPUs it holds, where each sits in the guest
    (read from its domain's ``definition``) and the size of the partition that joins them.
    One already begun (an interrupted suspend or resume) is kept, with the GPUs held now in
    place of those it had."""
    size = len(record.gpus) if record.fabric_partition is not None else None
    if record.suspended is not None:
        if not record.gpus:
            return record.suspended
        return Suspension(
            at=at,
            gpus=record.gpus,
            buses=record.suspended.buses,
            firmware=record.suspended.firmware,
            guest=record.suspended.guest,
            partition_size=size,
        )
    buses, firmware = hotplug.placed(definition, [gpu.bdf for gpu in record.gpus])
    return Suspension(at=at, gpus=record.gpus, buses=buses, firmware=firmware, partition_size=size)


def guest_runner(run: GuestRun, record: SandboxRecord, files: SandboxFiles) -> GuestRun:
    """``run`` bound to the sandbox's SSH endpoint and pinned keys."""
    ssh = record.ssh
    if ssh.port is None:
        raise FailedPrecondition(
            f"sandbox {record.name!r} has no SSH endpoint yet", details={"name": record.name}
        )
    endpoint = Endpoint(ssh.host, ssh.port, ssh.user)
    return functools.partial(run, endpoint, files.keys(record.host_key_alias))


def let_go(run: GuestRun, record: SandboxRecord, *, force: bool) -> dict[str, object]:
    """In the guest: its GPUs let go (guest/quiesce.py); the program's report."""
    memory = gpu_memory_mib(record)
    ids = function_ids(record.gpus)
    return quiesce.quiesce(run, ids, force=force, name=record.name, gpu_memory_mib=memory)


def take_up(run: GuestRun, record: SandboxRecord) -> dict[str, object]:
    """In the guest: the attached GPUs taken up (guest/quiesce.py); the program's report."""
    return quiesce.revive(run, name=record.name, gpu_memory_mib=gpu_memory_mib(record))


def gpu_memory_mib(record: SandboxRecord) -> int:
    """The memory of the sandbox's GPUs together, MiB (what its processes could hold)."""
    return sum(gpu.memory_mib or 0 for gpu in record.gpus)


def attached(hypervisor: Hypervisor, domain: str) -> set[str]:
    """The host functions the domain holds now (live and defined)."""
    return {bdf for bdf, holder in hypervisor.hostdev_holders().items() if holder == domain}


def detach(
    hypervisor: Hypervisor,
    domain: str,
    uuid: str,
    held: Suspension,
    gpus: tuple[GpuRecord, ...],
    say: Progress,
) -> None:
    """Take every function of ``gpus`` (at ``held``'s buses) out of the running guest and its
    definition, and wait until libvirt sees them gone; DEADLINE_EXCEEDED naming those still
    there after DETACH_TIMEOUT."""
    wanted: set[str] = set()
    for gpu, bus in zip(gpus, held.buses, strict=True):
        say(f"detaching GPU {gpu.bdf} from the guest (bus {bus})")
        for bdf, xml in hostdevs(gpu, bus, held.firmware):
            hypervisor.detach(domain, xml, uuid=uuid)
            wanted.add(bdf)
    deadline = time.monotonic() + DETACH_TIMEOUT
    while still := sorted(wanted & attached(hypervisor, domain)):
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(
                f"{domain}: GPU {', '.join(still)} is still in the guest "
                f"{DETACH_TIMEOUT:.0f} s after it was detached",
                details={"domain": domain, "gpus": still},
            )
        time.sleep(DETACH_POLL)


def attach(
    hypervisor: Hypervisor,
    domain: str,
    uuid: str,
    held: Suspension,
    gpus: tuple[GpuRecord, ...],
    say: Progress,
) -> None:
    """Attach each of ``gpus`` (new GPUs of the old ones' model, in slot order) at its slot's
    bus, unless the domain holds it already (a resume taken up again)."""
    there = attached(hypervisor, domain)
    for gpu, bus in zip(gpus, held.buses, strict=True):
        if gpu.bdf in there:
            continue
        say(f"attaching GPU {gpu.bdf} at its old guest slot (bus {bus})")
        for _bdf, xml in hostdevs(gpu, bus, held.firmware):
            hypervisor.attach(domain, xml, uuid=uuid)


def wait_until_seen(
    run: GuestRun,
    definition: str,
    held: Suspension,
    gpus: tuple[GpuRecord, ...],
    name: str,
    say: Progress,
) -> None:
    """Wait until the guest sees each of ``gpus`` below its root port (ports the definition
    gives no address are left to the verification)."""
    wanted = {}
    for gpu, bus in zip(gpus, held.buses, strict=True):
        port = hotplug.port_of(definition, bus)
        if port is not None:
            wanted[port] = (gpu.bdf, gpu.vendor_id.lower(), gpu.device_id.lower())
    wait_seen(run, wanted, name, say)
