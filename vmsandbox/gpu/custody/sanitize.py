"""A GPU's sanitize: what runs between two tenants, step by step, each step timed.

Where it sits: sandboxes keep libvirt's managed hostdevs (``managed='yes'``), so when a
sandbox's QEMU stops libvirt itself gives the GPU back to its host driver (and tries a reset
of its own, whose failure it only logs). The sanitize runs after that, once the releasing call
has marked the GPU ``sanitizing`` under the host lock: no allocation takes it meanwhile,
whatever driver it is on. Doing it there rather than taking the bind state from libvirt
(``managed='no'``) keeps every start, stop and crash path libvirt's, and a crash of vmsandbox
can never leave a GPU on vfio-pci that nothing will give back; the record, not the driver,
says whether the GPU may be handed on.

The steps, in order (``STEPS``):

1. ``fabric``: in shared NVSwitch mode the GPU's Fabric Manager partition must be deactivated
   before it is reset (FM trains and owns the NVLinks of an active partition; a reset under
   it breaks the partition). The release deactivates it first; while its lease is still
   recorded (FM unreachable) the sanitize waits (``NotYet``): the GPU stays ``sanitizing``
   and the next reconcile or health pass takes it up again. That is no fault of the GPU.
2. ``unbind``: a host driver (not vfio-pci) lets go of the GPU for the rest of the steps:
   the kernel refuses to map a BAR a driver has claimed, and a driver must not write to the
   memory being cleared.
3. ``reset``: the strongest reset the topology allows (host/pcireset.py: SBR of its own bridge,
   else FLR). With ``require_gpu_reset`` off a GPU without one skips it.
4. ``alive``: its config space reads again, not all ones, and it is in D0.
5. ``memory-clear``: NVIDIA GPUs from Turing on: the hardware clear that follows the reset,
   waited for as gpu-admin-tools does (host/nvclear.py). Others have no clear vmsandbox can
   see: the operator's scrub hook (next step) must clear them, unless
   ``require_gpu_memory_clear`` is off.
6. ``scrub``: the operator's command (``gpu_scrub_hook``), given the BDF as its argument and
   in ``VMSANDBOX_GPU_BDF``; exit 0 is success.
7. ``rebind``: the driver it had is given it back (the kernel probes it again).

A failing step ends the sanitize with its words (``Outcome.failed``, ``Outcome.words``); the
caller quarantines the GPU with them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vmsandbox.config import Config
from vmsandbox.host import nvclear, pcireset, pcistate
from vmsandbox.host.sysfs import SYS_PCI_DEVICES

STEPS = ("fabric", "unbind", "reset", "alive", "memory-clear", "scrub", "rebind")
NVIDIA = "0x10de"
VFIO = "vfio-pci"
SKIPPED = "skipped"
RESET_TIMEOUT_S = 30.0  # for a reset, and again for the GPU to answer after it
SCRUB_TIMEOUT_S = 600.0  # for the scrub hook (a GPU of 192 GiB zeroed through its BAR)


class NotYet(Exception):
    """The sanitize cannot begin yet, through no fault of the GPU (its partition is active)."""


class StepFailed(Exception):
    """One step failed; the words say how."""


@dataclass(frozen=True)
class Target:
    """What a sanitize needs to know of a GPU: its address, PCI ids (read from sysfs when the
    sanitize begins), and the Fabric Manager partition it was assigned with."""

    bdf: str
    vendor_id: str = ""  # "0x10de"
    device_id: str = ""  # "0x2330"
    partition: int | None = None


def identify(bdf: str, sysfs: str, partition: int | None = None) -> Target:
    """The GPU at ``bdf`` as sysfs shows it now; StepFailed when the function there is not a
    GPU (nothing is reset but a GPU, whatever a record says)."""
    from vmsandbox.host.discover import GPU_CLASSES
    from vmsandbox.host.sysfs import PciFunction

    function = PciFunction(bdf, os.path.join(sysfs, bdf))
    if (function.vendor_id, function.class_code >> 8) not in GPU_CLASSES:
        raise StepFailed(
            f"{bdf} is not a GPU on this host now ({function.vendor_id}:{function.device_id}, "
            f"class {function.class_id})"
        )
    return Target(bdf, function.vendor_id, function.device_id, partition)


@dataclass
class Outcome:
    """How a sanitize went: seconds per step run, notes of steps skipped, and the step that
    failed with its words."""

    steps: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    failed: str = ""
    words: str = ""

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def seconds(self) -> float:
        return sum(self.steps.values())


@dataclass(frozen=True)
class Host:
    """The host as a sanitize sees it: sysfs (``Config.pci_sysfs``), the scrub hook's runner,
    and whether a partition is still active."""

    sysfs: str = SYS_PCI_DEVICES
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
    partition_active: Callable[[int], bool] = lambda _partition: False
    clock: Callable[[], float] = time.monotonic
    reset_timeout: float = RESET_TIMEOUT_S
    scrub_timeout: float = SCRUB_TIMEOUT_S


def sanitize(bdf: str, partition: int | None, config: Config, host: Host) -> Outcome:
    """Run the steps (module docstring) on the GPU at ``bdf``, assigned with ``partition``;
    NotYet when it cannot begin yet."""
    if partition is not None and host.partition_active(partition):
        raise NotYet(
            f"its Fabric Manager partition {partition} is still active: it is reset only once "
            "the partition is deactivated"
        )
    outcome = Outcome(steps={"fabric": 0.0})
    try:
        target = identify(bdf, host.sysfs, partition)
    except StepFailed as exc:
        outcome.failed, outcome.words = "identity", f"identity: {exc}"
        return outcome
    driver = _driver(target.bdf, host.sysfs)
    steps: list[tuple[str, Callable[[], str | None]]] = [
        ("unbind", lambda: _unbind(target.bdf, driver, host.sysfs)),
        ("reset", lambda: _reset(target.bdf, config, host)),
        ("alive", lambda: _alive(target.bdf, host)),
        ("memory-clear", lambda: _memory_clear(target, config, host.sysfs)),
        ("scrub", lambda: _scrub(target, config, host)),
    ]
    try:
        for name, step in steps:
            began = host.clock()
            try:
                note = step()
            except StepFailed as exc:
                outcome.failed, outcome.words = name, f"{name}: {exc}"
                return outcome
            finally:
                outcome.steps[name] = round(host.clock() - began, 4)
            if note:
                outcome.notes[name] = note
    finally:
        began = host.clock()
        if driver not in (None, VFIO):
            _rebind(target.bdf, host.sysfs)
            outcome.steps["rebind"] = round(host.clock() - began, 4)
    return outcome


def _driver(bdf: str, sysfs: str) -> str | None:
    link = os.path.join(sysfs, bdf, "driver")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def _write(path: str, text: str) -> None:
    with open(path, "w") as attribute:
        attribute.write(text)


def _unbind(bdf: str, driver: str | None, sysfs: str) -> str | None:
    if driver in (None, VFIO):
        return SKIPPED
    try:
        _write(os.path.join(sysfs, bdf, "driver", "unbind"), bdf)
    except OSError as exc:
        raise StepFailed(f"host driver {driver} did not let go: {exc.strerror or exc}") from exc
    return None


def _rebind(bdf: str, sysfs: str) -> None:
    """Let the kernel probe the function again (its driver, or its driver_override)."""
    with contextlib.suppress(OSError):  # no driver wants it: vfio-pci takes it at start anyway
        _write(os.path.join(os.path.dirname(sysfs.rstrip("/")), "drivers_probe"), bdf)


def _reset(bdf: str, config: Config, host: Host) -> str | None:
    method = pcireset.choose(pcireset.methods_of(bdf, host.sysfs))
    if method is None:
        if config.require_gpu_reset:
            raise StepFailed("the kernel has no SBR or FLR for it")
        return "no reset method (require_gpu_reset is off)"
    try:
        pcireset.reset(bdf, method, host.reset_timeout, host.sysfs)
    except pcireset.ResetFailed as exc:
        raise StepFailed(str(exc)) from exc
    return method


def _alive(bdf: str, host: Host) -> str | None:
    try:
        pcistate.wait_answering(bdf, host.reset_timeout, host.sysfs)
    except pcistate.DeviceGone as exc:
        raise StepFailed(str(exc)) from exc
    return None


def _memory_clear(target: Target, config: Config, sysfs: str) -> str | None:
    arch = None
    if target.vendor_id == NVIDIA:
        bar0 = nvclear.Bar0(target.bdf, sysfs)
        try:
            with pcistate.memory_decoding(target.bdf, sysfs):
                arch = nvclear.architecture(int(target.device_id, 16), bar0)
                if arch is not None:
                    nvclear.wait_memory_clear(bar0, arch)
                    return f"hardware clear ({arch})"
        except (nvclear.ClearFailed, OSError) as exc:
            raise StepFailed(str(exc)) from exc
    if config.gpu_scrub_hook:
        return "by the scrub hook"
    if not config.require_gpu_memory_clear:
        return "not confirmed (require_gpu_memory_clear is off)"
    raise StepFailed(
        "vmsandbox knows no hardware memory clear for this GPU: set gpu_scrub_hook to a "
        "command that clears its memory (or require_gpu_memory_clear = false)"
    )


def _scrub(target: Target, config: Config, host: Host) -> str | None:
    if not config.gpu_scrub_hook:
        return SKIPPED
    env = {
        **os.environ,
        "VMSANDBOX_GPU_BDF": target.bdf,
        "VMSANDBOX_GPU_VENDOR": target.vendor_id,
        "VMSANDBOX_GPU_DEVICE": target.device_id,
    }
    try:
        done = host.run(
            [config.gpu_scrub_hook, target.bdf],
            capture_output=True,
            text=True,
            timeout=host.scrub_timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise StepFailed(f"the scrub hook did not end within {host.scrub_timeout:.0f} s") from exc
    except OSError as exc:
        raise StepFailed(f"the scrub hook cannot run: {exc.strerror or exc}") from exc
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise StepFailed(f"the scrub hook exited {done.returncode}: {said[-1] if said else ''}")
    return None
