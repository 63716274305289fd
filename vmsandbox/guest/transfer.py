"""Files in and out of a guest over SFTP, on the sandbox's own SSH connection (pinned host key,
ssh.py): a file, a folder and all below it, or a stream of bytes, with permission bits and
modification times kept and never a whole file in memory.

What a copy may trust, and what it may not:

- A file is written under a temporary name beside its destination and renamed into place only
  once whole, on either side: a copy that fails (the guest's disk full, the connection gone)
  leaves no file that looks complete, and the temporary one is removed.
- On this host, everything below the destination is made through folder descriptors, each
  opened without following a symbolic link (``LocalDir``): nothing the guest lists, no link it
  makes and no link already in the destination can make a download write outside it.
- Symbolic links inside a copied folder are made again as links when their target stays inside
  that folder; a link that points out of it (an absolute target, or ``..`` past its top) is
  not made and is listed in the summary's ``skipped``. A link named as the source itself is
  followed, as ``cp`` does.
- Names come from the other side as they are (spaces, quotes, line breaks, leading dots); a
  name no file can have (empty, ``.``, ``..``, holding ``/`` or NUL) is skipped and listed.

Throughput: paramiko sends SFTP requests of 32 KiB, one at a time unless told otherwise; here
requests are of 255 KiB and a steady number of them is kept in flight both ways, and the session
runs over OpenSSH's client where there is one (sftpipe.py; bench/transfer.py measures it).
"""

from __future__ import annotations

import contextlib
import errno
import posixpath
import secrets
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from vmsandbox.errors import (
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    Unavailable,
    VmSandboxError,
)
from vmsandbox.guest.sftpipe import Session

if TYPE_CHECKING:
    import paramiko

# One SFTP read or write: OpenSSH's sftp-server takes messages of up to 256 KiB and answers
# reads of up to 255 KiB (its limits@openssh.com; the length scp and sftp use), where paramiko
# would send 32 KiB (SFTPFile.MAX_REQUEST_SIZE): each request costs the guest a system call and
# an answer, so eight times fewer of them nearly double the throughput of a TCG guest.
CHUNK = 255 * 1024
WRITES_IN_FLIGHT = 16  # about 4 MiB sent ahead of the guest's answers
READS_IN_FLIGHT = 32  # about 8 MiB asked for ahead of what was written out
MAX_DEPTH = 128  # folders deeper than this are skipped (each level holds a descriptor open)
MODE_BITS = 0o777  # permission bits kept; set-id bits are not carried across

Progress = Callable[[int, int | None], None]  # bytes copied so far, bytes in all (None: unknown)


def _no_progress(_done: int, _total: int | None) -> None:
    """Progress discarded."""


@dataclass
class TransferSummary:
    """What a copy did: counts, bytes, seconds, and what it left out and why."""

    source: str
    destination: str
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"path", "reason"}

    def skip(self, path: str, reason: str) -> None:
        self.skipped.append({"path": path, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "destination": self.destination,
            "files": self.files,
            "directories": self.directories,
            "symlinks": self.symlinks,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "bytes_per_second": round(self.bytes / self.seconds) if self.seconds else None,
            "skipped": list(self.skipped),
        }


def bad_name(name: str) -> bool:
    """Whether ``name`` cannot be one entry of a folder."""
    return name in ("", ".", "..") or "/" in name or "\0" in name


def link_inside(target: str, link_dir: str) -> bool:
    """Whether a link in ``link_dir`` (relative to the copied folder's top, "" at the top)
    with ``target`` points inside the copied folder, read as written (lexically)."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    joined = posixpath.normpath(posixpath.join(link_dir or ".", target))
    return joined != ".." and not joined.startswith("../")


def guest_path(path: str, home: str) -> str:
    """A guest path as SFTP takes it: ``~`` and ``~/x`` (and a relative path) from ``home``."""
    if path in ("", "~"):
        return home
    if path.startswith("~/"):
        path = path[2:]
    return path if path.startswith("/") else posixpath.join(home, path)


class GuestFiles:
    """Copies between this host and one guest over an SFTP ``session`` (sftpipe.py), which it
    closes with itself (upload.py, download.py copy with it). ``sandbox`` and ``user`` name
    the guest side in messages; ``progress`` hears of every chunk."""

    def __init__(
        self,
        session: Session,
        *,
        sandbox: str,
        user: str,
        progress: Progress | None = None,
    ) -> None:
        self.session = session
        self.sftp = session.sftp
        self.sandbox = sandbox
        self.user = user
        self.progress = progress or _no_progress
        self.home = self.sftp.normalize(".")
        self.done = 0
        self.total: int | None = None

    def close(self) -> None:
        """Close the SFTP session and the SSH connection it runs on."""
        self.session.close()

    def __enter__(self) -> GuestFiles:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- errors ---------------------------------------------------------------------------

    def where(self, path: str) -> str:
        return f"{self.sandbox}:{path}"

    def guest_error(self, exc: BaseException, path: str, doing: str) -> VmSandboxError:
        """A failure on the guest side as a vmsandbox error that says so."""
        if not isinstance(exc, OSError) or not self.session.alive():
            return Unavailable(
                f"the SSH connection to sandbox {self.sandbox!r} broke while it was asked to "
                f"{doing} {path}: {type(exc).__name__}: {exc}"
            )
        details = {"side": "guest", "path": path, "sandbox": self.sandbox}
        if exc.errno == errno.ENOENT:
            return NotFound(f"{self.where(path)} does not exist in the guest", details=details)
        if exc.errno in (errno.EACCES, errno.EPERM):
            return FailedPrecondition(
                f"permission denied in the guest: user {self.user!r} cannot {doing} "
                f"{self.where(path)}",
                details=details,
            )
        return FailedPrecondition(
            f"the guest could not {doing} {self.where(path)}: {exc.strerror or exc}",
            details=details,
        )

    def stat(self, path: str, *, follow: bool = True) -> paramiko.SFTPAttributes | None:
        try:
            return self.sftp.stat(path) if follow else self.sftp.lstat(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise self.guest_error(exc, path, "look at") from exc

    def guest_free_bytes(self, folder: str) -> int | None:
        """Bytes the guest user may still write on ``folder``'s filesystem (OpenSSH's
        ``statvfs@openssh.com``, which paramiko has no method for); None when the guest
        cannot say."""
        from paramiko.sftp import CMD_EXTENDED, CMD_EXTENDED_REPLY

        try:
            kind, msg = self.sftp._request(  # type: ignore[attr-defined]
                CMD_EXTENDED, "statvfs@openssh.com", folder
            )
            if kind != CMD_EXTENDED_REPLY:
                return None
            _bsize, frsize, _blocks, _bfree, bavail = (msg.get_int64() for _ in range(5))
            return int(bavail * frsize)
        except Exception:  # an older server, an odd answer, a closed connection
            return None

    def check_room(self, folder: str, needed: int) -> None:
        free = self.guest_free_bytes(folder)
        if free is not None and needed > free:
            raise ResourceExhausted(
                f"not enough space in the guest for the copy to {self.where(folder)}: "
                f"{needed} bytes needed, {free} free",
                details={"side": "guest", "path": folder, "needed": needed, "free": free},
            )

    def put_file(self, source: IO[bytes], target: str, mode: int, mtime: float | None) -> None:
        """Write ``source`` to a temporary file beside ``target``, then rename it into place."""
        folder = posixpath.dirname(target) or "/"
        partial = posixpath.join(folder, f".vmsandbox-{secrets.token_hex(6)}.partial")
        before = self.done
        try:
            with self.sftp.open(partial, "wb") as handle:
                self._write_pipelined(handle, source)
            self.sftp.chmod(partial, mode & MODE_BITS)
            if mtime is not None:
                self.sftp.utime(partial, (mtime, mtime))
            self.sftp.posix_rename(partial, target)
        except BaseException as exc:
            # a write the guest failed without a reason (SFTP's "Failure") on a full disk:
            # looked at before the partial file is removed and gives its space back
            full = isinstance(exc, OSError) and exc.errno is None and self._full(folder)
            self._discard(partial)
            if isinstance(exc, VmSandboxError | KeyboardInterrupt):
                raise
            if full:
                raise ResourceExhausted(
                    f"the guest ran out of space writing {self.where(target)} "
                    f"({self.done - before} bytes written); nothing was left there",
                    details={"side": "guest", "path": target, "written": self.done - before},
                ) from exc
            raise self.guest_error(exc, target, "write") from exc

    def _write_pipelined(self, handle: paramiko.SFTPFile, source: IO[bytes]) -> int:
        """Write ``source`` to the open ``handle``, WRITES_IN_FLIGHT requests of CHUNK bytes
        outstanding at once, each answer read (and its error raised) in order. paramiko's own
        pipelining (``set_pipelined``) waits for every answer each hundred writes, which
        leaves the line idle while the guest catches up; this uses the same requests through
        paramiko's request methods."""
        from paramiko.sftp import CMD_WRITE, int64

        sftp: Any = self.sftp
        waiting: deque[int] = deque()
        offset = 0
        while data := source.read(CHUNK):
            waiting.append(
                sftp._async_request(type(None), CMD_WRITE, handle.handle, int64(offset), data)
            )
            offset += len(data)
            while len(waiting) > WRITES_IN_FLIGHT or (waiting and sftp.sock.recv_ready()):
                sftp._read_response(waiting.popleft())
            self.advance(len(data))
        while waiting:
            sftp._read_response(waiting.popleft())
        return offset

    def _full(self, folder: str) -> bool:
        free = self.guest_free_bytes(folder)
        return free is not None and free < CHUNK

    def _discard(self, partial: str) -> None:
        # never made, or the connection is gone (then nothing can be removed)
        with contextlib.suppress(Exception):
            self.sftp.remove(partial)

    def advance(self, count: int) -> None:
        self.done += count
        self.progress(self.done, self.total)

    def read_file(self, path: str, size: int) -> Iterator[bytes]:
        """The file's bytes: its ``size`` bytes with READS_IN_FLIGHT requests of CHUNK bytes
        outstanding at once, then whatever follows (a file that grew, or one whose size says
        0), read one request at a time."""
        try:
            with self.sftp.open(path, "rb") as handle:
                handle.MAX_REQUEST_SIZE = CHUNK
                got = yield from self._read_pipelined(handle, size)
                handle.seek(got)
                while data := handle.read(CHUNK):
                    self.advance(len(data))
                    yield data
        except OSError as exc:
            raise self.guest_error(exc, path, "read") from exc

    def _read_pipelined(self, handle: paramiko.SFTPFile, size: int) -> Generator[bytes, None, int]:
        """Up to ``size`` bytes from offset 0, as the writes above: a steady pipeline of read
        requests through paramiko's request methods, whose answers OpenSSH's sftp-server sends
        in order (paramiko's ``readv`` waits for a whole window before asking for the next,
        and looks its buffers over once per piece). Stops at a short read (a file that
        shrank); returns the bytes read."""
        from paramiko.sftp import CMD_DATA, CMD_READ, int64

        sftp: Any = self.sftp
        waiting: deque[tuple[int, int]] = deque()  # (request, bytes asked for)
        asked = got = 0
        while asked < size or waiting:
            while asked < size and len(waiting) < READS_IN_FLIGHT:
                length = min(CHUNK, size - asked)
                request = sftp._async_request(
                    type(None), CMD_READ, handle.handle, int64(asked), length
                )
                waiting.append((request, length))
                asked += length
            request, length = waiting.popleft()
            kind, msg = sftp._read_response(request)
            data = msg.get_string() if kind == CMD_DATA else b""
            got += len(data)
            self.advance(len(data))
            yield data
            if len(data) < length:  # the file shrank: what is still asked for is past its end
                for request, _ in waiting:
                    with contextlib.suppress(EOFError, OSError):
                        sftp._read_response(request)
                break
        return got
