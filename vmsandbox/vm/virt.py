"""Choosing the virtualisation type: ``kvm`` where KVM really runs guests, else ``qemu`` (TCG).

``/dev/kvm`` existing is not enough: on some hosts (nested setups among them) KVM guests hang at
their first instructions in long mode. ``auto`` therefore boots the image's kernel under KVM for
a few seconds and looks for the kernel's first console line. The answer is cached per host
boot (kernel release, boot id, QEMU binary, /dev/kvm's device number) in the state directory.
Not /dev/kvm's change time: libvirt changes it when it starts a domain, and the probe would run
again for every create.

The probe's QEMU must never outlive its caller or its time limit: on a host where KVM hangs, a
QEMU left behind runs forever (nothing records it, so reconcile cannot find it). It therefore
runs as ``setpriv --pdeathsig TERM timeout -k 2 6 setpriv --pdeathsig KILL qemu ...``:

- ``timeout`` enforces the limit on its own, whatever the caller does (killed, stopped, hung);
- ``timeout`` gets SIGTERM when its parent (the caller) dies, and answers it as it answers its
  own deadline: SIGTERM to QEMU, SIGKILL ``KILL_AFTER`` seconds later. It is told with TERM, not
  KILL, because a ``timeout`` killed outright could no longer take QEMU down;
- QEMU gets SIGKILL should ``timeout`` itself be killed.

The parent-death signal is set by ``setpriv`` (the ``prctl(PR_SET_PDEATHSIG)`` between fork and
exec) rather than by a ``preexec_fn``, which is unsafe in a threaded caller such as a gateway.
Its one gap, a caller that dies before ``setpriv`` has set the signal, is closed by ``timeout``'s
own deadline. (The signal follows the thread that started the probe; that thread waits for the
probe to end, so it cannot fire early.) Two creates that start at once on a fresh host run one
probe: the probe and the cache write happen under a file lock, and the cache is read again once
the lock is held.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from vmsandbox.config import QEMU, Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.lock import host_lock

PROBE_SECONDS = 6  # a working KVM prints the kernel banner well within this
KILL_AFTER = 2  # SIGTERM first (QEMU exits cleanly), SIGKILL this much later
# No process of a probe outlives this, counted from its start, whatever happens to its caller.
PROBE_LIMIT = PROBE_SECONDS + KILL_AFTER
_MARKER = b"Linux version"


def for_sandbox(
    requested: str, config: Config, kernel: Path | None, say: Callable[[str], None]
) -> str:
    """The virt type of a sandbox asking for ``requested`` (``auto``: the config's). ``auto``
    probes KVM once per host with ``kernel`` (cached in the state directory). With no kernel (a
    dry run) nothing is probed or refused: ``auto`` is the cached answer, ``qemu`` without one."""
    wanted = requested if requested != "auto" else config.virt_type
    cache = config.state_dir / "virt-probe.json"
    if kernel is None:
        return wanted if wanted != "auto" else cached(cache=cache, qemu=config.probe_qemu) or "qemu"
    if wanted == "auto" and cached(cache=cache, qemu=config.probe_qemu) is None:
        say("probing whether KVM runs guests on this host (once, then cached)")
    return resolve(wanted, cache=cache, kernel=kernel, qemu=config.probe_qemu)


def resolve(requested: str, *, cache: Path, kernel: Path | None, qemu: str = QEMU) -> str:
    """Turn ``auto``/``kvm``/``qemu`` into the type to put in the domain XML."""
    if requested == "qemu":
        return "qemu"
    if requested == "kvm":
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            raise FailedPrecondition("virt_type 'kvm' was asked for but /dev/kvm is not usable")
        return "kvm"
    if requested != "auto":
        raise InvalidArgument(f"virt_type {requested!r} is not one of auto, kvm, qemu")
    return "kvm" if kvm_works(cache=cache, kernel=kernel, qemu=qemu) else "qemu"


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_key(qemu: str = QEMU) -> str:
    """What the cached answer holds for: this boot of this kernel, this QEMU and /dev/kvm."""
    try:
        kvm_id = str(os.stat("/dev/kvm").st_rdev)
    except OSError:
        kvm_id = "none"
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = "none"
    try:
        qemu_id = str(int(os.stat(qemu).st_mtime))
    except OSError:
        qemu_id = "none"
    return f"{os.uname().release}|{boot}|{qemu_id}|{kvm_id}"


def cached(*, cache: Path, qemu: str = QEMU) -> str | None:
    """The virt type an earlier probe chose on this host, or None if none is cached."""
    try:
        data = json.loads(cache.read_text())
        if data.get("host") == host_key(qemu):
            return "kvm" if data["kvm"] else "qemu"
    except (OSError, ValueError, KeyError, AttributeError):
        return None  # no cache yet, or an unreadable one: probe again
    return None


def kvm_works(*, cache: Path, kernel: Path | None, qemu: str = QEMU) -> bool:
    """Whether a KVM guest gets as far as printing its kernel banner (cached per host)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK) or shutil.which(qemu) is None:
        return False
    known = cached(cache=cache, qemu=qemu)
    if known is not None:
        return known == "kvm"
    if kernel is None:
        return False  # nothing to probe with; TCG is always safe
    cache.parent.mkdir(parents=True, exist_ok=True)
    # A second waiter may wait one whole probe; give it that and as much again.
    with host_lock(cache.with_name(cache.name + ".lock"), timeout=2.0 * PROBE_LIMIT + 10):
        known = cached(cache=cache, qemu=qemu)  # the probe another process just ran
        if known is not None:
            return known == "kvm"
        works = _probe(kernel, qemu)
        with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False) as tmp:
            json.dump({"host": host_key(qemu), "kvm": works}, tmp)
        os.replace(tmp.name, cache)
    return works


def probe_command(kernel: Path, qemu: str = QEMU) -> list[str]:
    """The probe's command line: QEMU under a deadline of its own, dying with its caller."""
    return [
        "setpriv",
        "--pdeathsig",
        "TERM",
        "--",
        "timeout",
        f"--kill-after={KILL_AFTER}",
        str(PROBE_SECONDS),
        "setpriv",
        "--pdeathsig",
        "KILL",
        "--",
        qemu,
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


def _probe(kernel: Path, qemu: str) -> bool:
    if shutil.which("setpriv") is None or shutil.which("timeout") is None:
        return False  # without its guards the probe could leak a QEMU; TCG is always safe
    try:
        # The caller's own timeout is a last resort: ``timeout`` ends the probe before it.
        done = subprocess.run(
            probe_command(kernel, qemu),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=PROBE_LIMIT + 5,
            check=False,
        )
        output = done.stdout
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout or b""
    except OSError:
        return False
    return _MARKER in output
