"""vmsandbox: libvirt VM sandboxes with PCI GPU passthrough.

The names a caller needs are importable from here (``from vmsandbox import SandboxManager,
SandboxSpec, GpuRequest``); each is loaded on first use, so importing ``vmsandbox`` stays cheap
and loads no other module of the package.

The package is built in layers, one package per concept; a package imports only from the
packages below it and from the shared core (the modules at the top level of ``vmsandbox``, named
on the last line), never from one above it.

Layers, top first:

    cli         the vmsandbox command
    fleet       many hosts behind one gateway, placed by Ray (the ``fleet`` extra)
    openshell   the OpenShell compute driver behind ``vmsandbox serve``
    compat      other sandbox platforms' GPU requests as a GpuRequest
    sandbox     a sandbox's life: spec, record, create, boot, power, pool, SandboxManager
    image       base images: store, recipes, builds, imports, who uses what
    guest       talking to a guest: SSH, keys, seed, control channel, GPU checks, programs
    gpu         GPU requests, allocation, passthrough, hot-plug, NVSwitch fabric
    vm          libvirt and QEMU: hypervisor seam, domain XML, virt type, console
    host        the host's GPUs and topology
    core        config errors lock progress resources tables tools validate

tests/unit/test_layering.py reads this table and fails on an import against it, on any import cycle
and on a module grown too long.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "Config": "vmsandbox.config",
    "SandboxManager": "vmsandbox.sandbox.manager",
    "SandboxSpec": "vmsandbox.sandbox.spec",
    "Sandbox": "vmsandbox.sandbox.handle",
    "GpuRequest": "vmsandbox.gpu.request",
    "GuestSetup": "vmsandbox.guest.setup",
    "GuestFile": "vmsandbox.guest.setup",
    "VmSandboxError": "vmsandbox.errors",
    "InvalidArgument": "vmsandbox.errors",
    "FailedPrecondition": "vmsandbox.errors",
    "ResourceExhausted": "vmsandbox.errors",
    "NotFound": "vmsandbox.errors",
    "AlreadyExists": "vmsandbox.errors",
    "Unavailable": "vmsandbox.errors",
    "DeadlineExceeded": "vmsandbox.errors",
    "Unauthenticated": "vmsandbox.errors",
    "Internal": "vmsandbox.errors",
    "GuestVerificationFailed": "vmsandbox.errors",
    "HostKeyMismatch": "vmsandbox.guest.ssh",
}

__all__ = [
    "AlreadyExists",
    "Config",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GpuRequest",
    "GuestFile",
    "GuestSetup",
    "GuestVerificationFailed",
    "HostKeyMismatch",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "Sandbox",
    "SandboxManager",
    "SandboxSpec",
    "Unauthenticated",
    "Unavailable",
    "VmSandboxError",
    "__version__",
]

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ loads them
    from vmsandbox.config import Config
    from vmsandbox.errors import (
        AlreadyExists,
        DeadlineExceeded,
        FailedPrecondition,
        GuestVerificationFailed,
        Internal,
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        Unauthenticated,
        Unavailable,
        VmSandboxError,
    )
    from vmsandbox.gpu.request import GpuRequest
    from vmsandbox.guest.setup import GuestFile, GuestSetup
    from vmsandbox.guest.ssh import HostKeyMismatch
    from vmsandbox.sandbox.handle import Sandbox
    from vmsandbox.sandbox.manager import SandboxManager
    from vmsandbox.sandbox.spec import SandboxSpec


def __getattr__(name: str) -> Any:
    """A public name, loaded from its module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
