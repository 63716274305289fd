"""Copies from a guest to this host (transfer.py has the rules they keep): a file, a folder and
all below it, or a file into a stream."""

from __future__ import annotations

import os
import posixpath
import stat
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from vmsandbox.errors import InvalidArgument, NotFound, ResourceExhausted
from vmsandbox.guest.localdir import LocalDir, open_parent
from vmsandbox.guest.transfer import (
    MAX_DEPTH,
    MODE_BITS,
    GuestFiles,
    TransferSummary,
    bad_name,
    guest_path,
    link_inside,
)

if TYPE_CHECKING:
    import paramiko


def download(files: GuestFiles, remote: str, local: str | Path) -> TransferSummary:
    """Copy file or folder ``remote`` of the guest to ``local``: into ``local`` when it is
    a folder, else to that path (whose folder must exist). ``remote`` ending in ``/.``
    copies a folder's contents into ``local``."""
    started = time.monotonic()
    contents = remote.endswith("/.")
    path = guest_path(remote, files.home)
    path = posixpath.normpath(path) if contents else path.rstrip("/") or "/"
    st = files.stat(path)
    if st is None:
        raise NotFound(
            f"{files.where(path)} does not exist in the guest",
            details={"side": "guest", "path": path, "sandbox": files.sandbox},
        )
    is_dir = stat.S_ISDIR(st.st_mode or 0)
    if not is_dir and not stat.S_ISREG(st.st_mode or 0):
        raise InvalidArgument(
            f"{files.where(path)} is neither a file nor a folder",
            details={"field": "source", "value": remote},
        )
    parent, name = open_parent(local, posixpath.basename(path), contents and is_dir)
    summary = TransferSummary(files.where(path), str(Path(parent.path) / name))
    try:
        files.done, files.total = 0, st.st_size if not is_dir else None
        if not is_dir:
            check_host_room(parent.path, st.st_size or 0)
            parent.write_file(
                name, files.read_file(path, st.st_size or 0), st.st_mode or 0o644, st.st_mtime
            )
            summary.files = 1
        else:
            _get_tree(files, path, parent, name, "", summary, 0, st)
    finally:
        parent.close()
    summary.bytes, summary.seconds = files.done, time.monotonic() - started
    return summary


def download_stream(files: GuestFiles, remote: str, sink: IO[bytes]) -> TransferSummary:
    """Write the guest file ``remote`` into ``sink`` (a binary stream), chunk by chunk."""
    started = time.monotonic()
    path = guest_path(remote, files.home)
    st = files.stat(path)
    if st is None:
        raise NotFound(
            f"{files.where(path)} does not exist in the guest",
            details={"side": "guest", "path": path, "sandbox": files.sandbox},
        )
    if not stat.S_ISREG(st.st_mode or 0):
        raise InvalidArgument(
            f"{files.where(path)} is not a file", details={"field": "source", "value": remote}
        )
    files.done, files.total = 0, st.st_size
    for data in files.read_file(path, st.st_size or 0):
        sink.write(data)
    summary = TransferSummary(files.where(path), "<stream>", files=1, bytes=files.done)
    summary.seconds = time.monotonic() - started
    return summary


def _get_tree(
    files: GuestFiles,
    remote: str,
    parent: LocalDir,
    name: str,
    rel: str,
    summary: TransferSummary,
    depth: int,
    st: paramiko.SFTPAttributes,
) -> None:
    if depth > MAX_DEPTH:
        summary.skip(files.where(remote), f"deeper than {MAX_DEPTH} folders")
        return
    try:
        entries = sorted(files.sftp.listdir_attr(remote), key=lambda entry: entry.filename)
    except OSError as exc:
        raise files.guest_error(exc, remote, "list") from exc
    folder = parent.child_dir(name)
    summary.directories += 1
    try:
        for entry in entries:
            source = posixpath.join(remote, entry.filename)
            mode = entry.st_mode or 0
            if bad_name(entry.filename):
                summary.skip(files.where(source), "a name no file can have here")
            elif stat.S_ISLNK(mode):
                _get_link(files, source, folder, entry.filename, rel, summary)
            elif stat.S_ISDIR(mode):
                inner = posixpath.join(rel, entry.filename) if rel else entry.filename
                _get_tree(files, source, folder, entry.filename, inner, summary, depth + 1, entry)
            elif stat.S_ISREG(mode):
                size = entry.st_size or 0
                check_host_room(folder.path, size)
                reader = files.read_file(source, size)
                folder.write_file(entry.filename, reader, mode, entry.st_mtime)
                summary.files += 1
            else:
                summary.skip(files.where(source), "not a file, folder or link")
    finally:
        folder.finish((st.st_mode or 0o755) & MODE_BITS, st.st_atime, st.st_mtime)


def _get_link(
    files: GuestFiles, source: str, folder: LocalDir, name: str, rel: str, summary: TransferSummary
) -> None:
    try:
        link = files.sftp.readlink(source) or ""
    except OSError as exc:
        raise files.guest_error(exc, source, "read the link") from exc
    if not link_inside(link, rel):
        summary.skip(files.where(source), f"a link out of the folder copied (to {link!r})")
        return
    folder.symlink(link, name)
    summary.symlinks += 1


def check_host_room(folder: str, needed: int) -> None:
    """RESOURCE_EXHAUSTED before a download that cannot fit in ``folder``'s filesystem."""
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return
    free = vfs.f_bavail * vfs.f_frsize
    if needed > free:
        raise ResourceExhausted(
            f"not enough space on this host in {folder}: {needed} bytes needed, {free} free",
            details={"side": "host", "path": folder, "needed": needed, "free": free},
        )
