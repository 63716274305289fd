"""A folder on this host that a download writes into, opened by descriptor: every folder, file
and link below it is made by name relative to its parent's descriptor, and every folder is
opened without following a symbolic link. So no name and no link, whether the guest sent it or
it was already there, can make a write land outside the destination; a file is written under a
temporary name and renamed into place once whole (a rename replaces a link, never follows it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from vmsandbox.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    VmSandboxError,
)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class LocalDir:
    """An open folder (``fd``) at ``path``; ``close`` or ``finish`` releases it."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    def child_dir(self, name: str) -> LocalDir:
        """Folder ``name`` in this one, made (0700 until ``finish``) when missing; an entry of
        that name that is not a folder, a link included, is refused (FAILED_PRECONDITION)."""
        where = os.path.join(self.path, name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=self.fd)
        try:
            return LocalDir(os.open(name, _DIR_FLAGS, dir_fd=self.fd), where)
        except OSError as exc:
            raise host_error(exc, where) from exc

    def write_file(self, name: str, chunks: Iterable[bytes], mode: int, mtime: float | None) -> int:
        """File ``name`` with the bytes of ``chunks``, written under a temporary name and
        renamed over whatever had the name; the bytes written. The temporary file is removed
        when ``chunks`` or a write fails."""
        partial = f".vmsandbox-{secrets.token_hex(6)}.partial"
        where = os.path.join(self.path, name)
        try:
            fd = os.open(partial, _NEW_FILE, 0o600, dir_fd=self.fd)
        except OSError as exc:
            raise host_error(exc, where) from exc
        written = 0
        try:
            with os.fdopen(fd, "wb", buffering=0) as handle:
                for data in chunks:
                    view = memoryview(data)
                    while view:
                        view = view[handle.write(view) or 0 :]
                    written += len(data)
                os.fchmod(handle.fileno(), mode & 0o777)
                if mtime is not None:
                    os.utime(handle.fileno(), (mtime, mtime))
            os.rename(partial, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(partial, dir_fd=self.fd)
            getattr(chunks, "close", lambda: None)()  # a reader's remote file, closed now
            if isinstance(exc, OSError):
                raise host_error(exc, where) from exc
            raise
        return written

    def symlink(self, target: str, name: str) -> None:
        """Link ``name`` to ``target``, replacing a file or link of that name (not a folder)."""
        where = os.path.join(self.path, name)
        try:
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISDIR(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=self.fd)
            os.symlink(target, name, dir_fd=self.fd)
        except OSError as exc:
            raise host_error(exc, where) from exc

    def finish(self, mode: int, atime: float | None, mtime: float | None) -> None:
        """Give the folder its mode and times (after its contents: a read-only folder is
        written first), then close it."""
        try:
            os.fchmod(self.fd, mode)
            if atime is not None and mtime is not None:
                os.utime(self.fd, (atime, mtime))
        except OSError as exc:
            raise host_error(exc, self.path) from exc
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_parent(local: str | Path, name: str, contents: bool) -> tuple[LocalDir, str]:
    """Where a download of an entry called ``name`` lands at ``local``: into ``local`` when it
    is a folder (unless ``contents``: a folder's contents copied into ``local`` itself), else
    at ``local``, whose folder must exist (NOT_FOUND naming it)."""
    text = str(local)  # as written: a Path drops a trailing "/"
    local = Path(local)
    if local.is_dir() and not contents:
        folder, entry = local, name
    else:
        if text.endswith("/") and not local.is_dir():
            raise NotFound(f"{local}: no such folder on this host", details={"side": "host"})
        folder, entry = local.parent, local.name
    if not entry or entry in (".", ".."):
        raise InvalidArgument(
            f"name the destination of the copy: {text!r} gives it no name",
            details={"field": "destination", "value": text},
        )
    try:
        return LocalDir(
            os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), str(folder)
        ), entry
    except FileNotFoundError as exc:
        raise NotFound(
            f"{folder}: no such folder on this host", details={"side": "host", "path": str(folder)}
        ) from exc
    except OSError as exc:
        raise host_error(exc, str(folder)) from exc


def host_error(exc: OSError, path: str, doing: str = "write") -> VmSandboxError:
    """A failure on this host's side of a copy as a vmsandbox error that says so."""
    details = {"side": "host", "path": path}
    if exc.errno == errno.ENOENT:
        return NotFound(f"{path} does not exist on this host", details=details)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return FailedPrecondition(
            f"permission denied on this host: cannot {doing} {path}", details=details
        )
    if exc.errno == errno.ENOSPC:
        return ResourceExhausted(f"no space left on this host to {doing} {path}", details=details)
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
        return FailedPrecondition(
            f"{path} on this host is in the way (a link, or a file where a folder goes); "
            "a copy never writes through a link",
            details=details,
        )
    return FailedPrecondition(
        f"cannot {doing} {path} on this host: {exc.strerror or exc}", details=details
    )
