"""Choosing the virtualisation type: ``kvm`` where KVM really runs guests, else ``qemu`` (TCG).

``/dev/kvm`` existing is not enough: on some hosts (nested setups among them) KVM guests hang at
their first instructions in long mode. ``auto`` therefore boots the image's kernel under KVM for
a few seconds and looks for the kernel's first console line. The answer is cached per host
(kernel release, QEMU binary and /dev/kvm identity) in the state directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from vmsandbox.errors import FailedPrecondition, InvalidArgument

QEMU = "/usr/bin/qemu-system-x86_64"
PROBE_SECONDS = 6.0
_MARKER = b"Linux version"


def resolve(requested: str, *, cache: Path, kernel: Path | None) -> str:
    """Turn ``auto``/``kvm``/``qemu`` into the type to put in the domain XML."""
    if requested == "qemu":
        return "qemu"
    if requested == "kvm":
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            raise FailedPrecondition("virt_type 'kvm' was asked for but /dev/kvm is not usable")
        return "kvm"
    if requested != "auto":
        raise InvalidArgument(f"virt_type {requested!r} is not one of auto, kvm, qemu")
    return "kvm" if kvm_works(cache=cache, kernel=kernel) else "qemu"


def host_key() -> str:
    try:
        kvm = os.stat("/dev/kvm")
        kvm_id = f"{kvm.st_rdev}:{int(kvm.st_ctime)}"
    except OSError:
        kvm_id = "none"
    try:
        qemu_id = str(int(os.stat(QEMU).st_mtime))
    except OSError:
        qemu_id = "none"
    return f"{os.uname().release}|{qemu_id}|{kvm_id}"


def cached(*, cache: Path) -> str | None:
    """The virt type an earlier probe chose on this host, or None if none is cached."""
    try:
        data = json.loads(cache.read_text())
        if data.get("host") == host_key():
            return "kvm" if data["kvm"] else "qemu"
    except (OSError, ValueError, KeyError, AttributeError):
        return None  # no cache yet, or an unreadable one: probe again
    return None


def kvm_works(*, cache: Path, kernel: Path | None) -> bool:
    """Whether a KVM guest gets as far as printing its kernel banner (cached per host)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK) or shutil.which(QEMU) is None:
        return False
    known = cached(cache=cache)
    if known is not None:
        return known == "kvm"
    key = host_key()
    if kernel is None:
        return False  # nothing to probe with; TCG is always safe
    works = _probe(kernel)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False) as tmp:
        json.dump({"host": key, "kvm": works}, tmp)
    os.replace(tmp.name, cache)
    return works


def _probe(kernel: Path) -> bool:
    command = [
        QEMU,
        "-accel",
        "kvm",
        "-machine",
        "q35",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-m",
        "256",
        "-serial",
        "stdio",
        "-no-reboot",
        "-kernel",
        str(kernel),
        "-append",
        "earlyprintk=ttyS0 console=ttyS0 panic=-1",
    ]
    try:
        done = subprocess.run(command, capture_output=True, timeout=PROBE_SECONDS, check=False)
        output = done.stdout
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout or b""
    except OSError:
        return False
    return _MARKER in output
