"""The host end of a guest's control channel: the request a pool claim makes without SSH.

Domains of images that serve it (programs/control.py, listed in the image's meta.json) have
a virtio-serial port whose host end is a UNIX socket in the sandbox's private folder
(``SandboxFiles.control``). Three requests exist, each answered ``ok`` or ``error: WHY``:
``claim NAME`` (the hostname, once the guest has checked that its sshd runs), ``hostname
NAME`` (the hostname alone; guests of older builds know only this one) and ``wake`` (after
a resume: the guest's clock set to the host's and its random number generator reseeded from
bytes the host drew, then sshd checked). Each call opens the socket, sends the request, reads
one answer line within a short deadline and closes it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from pathlib import Path

from vmsandbox.errors import DeadlineExceeded, FailedPrecondition
from vmsandbox.validate import validate_name

TIMEOUT_S = 5.0
ANSWER_MAX = 512  # bytes of one answer line


def restrict(path: Path) -> None:
    """Make the control channel's socket the owner's alone (0600) once QEMU has made it: QEMU
    creates it group-writable (0775 under umask 0). Nothing to do where there is none."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.chmod(path, 0o600)


# What a guest of an older build answers to ``claim`` (and to ``wake``).
UNKNOWN_CLAIM = "error: unknown request 'claim'"
UNKNOWN_WAKE = "error: unknown request 'wake'"
SEED_BYTES = 32  # bytes of entropy ``wake`` hands the guest (programs/control.py)


def claim(path: Path, name: str, *, guest: str, timeout: float | None = None) -> bool:
    """Ask the guest behind ``path`` to take ``name`` as its hostname once it has checked that
    its sshd runs: True when it did, False when the guest does not know the request (an older
    build: the caller sets the hostname and checks sshd itself). Errors as ``set_hostname``'s
    (FAILED_PRECONDITION when sshd does not run)."""
    text = _request(path, "claim", name, guest=guest, timeout=timeout)
    if text.startswith(UNKNOWN_CLAIM):
        return False
    _check(text, name, guest, path)
    return True


def wake(path: Path, *, guest: str, timeout: float | None = None, claim: str = "") -> bool:
    """Tell the resumed guest behind ``path`` the time (this host's clock, in nanoseconds)
    and hand it SEED_BYTES fresh random bytes to reseed from; it answers once its sshd is
    checked. With ``claim`` (a parked pooled guest's claim), ``claim NAME`` follows on the
    same connection, one exchange instead of two. True when it did; False when the guest
    does not know ``wake`` (an older build: the caller does it over SSH, and sets the
    hostname itself). FAILED_PRECONDITION when the guest refuses either (its answer named),
    DEADLINE_EXCEEDED when it does not answer in time."""
    seed = os.urandom(SEED_BYTES).hex()
    lines = [f"wake {time.time_ns()} {seed}"]
    if claim:
        validate_name(claim)
        lines.append(f"claim {claim}")
    text, *claimed = _exchange_all(path, lines, guest=guest, timeout=timeout)
    if text.startswith(UNKNOWN_WAKE):
        return False
    for answer in claimed:
        _check(answer, claim, guest, path)
    if text != "ok":
        raise FailedPrecondition(
            f"guest {guest!r} refused to take the time and a new seed after its resume: "
            f"{text or 'no answer (the channel closed)'}",
            details={"guest": guest, "socket": str(path), "answer": text},
        )
    return True


def set_hostname(path: Path, name: str, *, guest: str, timeout: float | None = None) -> None:
    """Ask the guest behind ``path`` to take ``name`` as its hostname. INVALID_ARGUMENT for a
    name outside the grammar, DEADLINE_EXCEEDED when no answer comes within ``timeout``
    (TIMEOUT_S by default), FAILED_PRECONDITION when the socket is not there or the guest
    answers an error."""
    _check(_request(path, "hostname", name, guest=guest, timeout=timeout), name, guest, path)


def _check(text: str, name: str, guest: str, path: Path) -> None:
    if text != "ok":
        raise FailedPrecondition(
            f"guest {guest!r} refused hostname {name!r} on its control channel: "
            f"{text or 'no answer (the channel closed)'}",
            details={"guest": guest, "socket": str(path), "answer": text},
        )


def _request(path: Path, verb: str, name: str, *, guest: str, timeout: float | None) -> str:
    """The guest's answer line to ``verb NAME``, stripped."""
    validate_name(name)
    return _exchange(path, f"{verb} {name}", guest=guest, timeout=timeout)


def _exchange(path: Path, line: str, *, guest: str, timeout: float | None) -> str:
    """The guest's answer to request ``line``, stripped."""
    return _exchange_all(path, [line], guest=guest, timeout=timeout)[0]


def _exchange_all(path: Path, lines: list[str], *, guest: str, timeout: float | None) -> list[str]:
    """The guest's answers to requests ``lines``, sent on one connection, stripped (an
    answer missing when the channel closed early is "")."""
    timeout = TIMEOUT_S if timeout is None else timeout
    details = {"guest": guest, "socket": str(path)}
    try:
        info = os.lstat(path)
    except FileNotFoundError as exc:
        raise FailedPrecondition(
            f"guest {guest!r} has no control channel at {path} (is its domain running?)",
            details=details,
        ) from exc
    if not stat.S_ISSOCK(info.st_mode):
        raise FailedPrecondition(
            f"the control channel of guest {guest!r} at {path} is not a socket", details=details
        )
    os.chmod(path, 0o600)  # QEMU makes it group-writable; the folder keeps others out anyway
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.settimeout(timeout)
            sock.connect(str(path))
            sock.sendall("".join(f"{line}\n" for line in lines).encode())
            answer, most = b"", ANSWER_MAX * len(lines)
            while answer.count(b"\n") < len(lines) and len(answer) < most:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = sock.recv(most - len(answer))
                if not chunk:
                    break
                answer += chunk
        except TimeoutError as exc:
            raise DeadlineExceeded(
                f"guest {guest!r} did not answer on its control channel within {timeout:.0f}s",
                details=details,
            ) from exc
        except OSError as exc:
            raise FailedPrecondition(
                f"the control channel of guest {guest!r} failed: {exc.strerror or exc}",
                details=details,
            ) from exc
    answers = [line.strip() for line in answer.decode("ascii", errors="replace").split("\n")]
    return (answers + [""] * len(lines))[: len(lines)]
