"""Copies from this host into a guest (transfer.py has the rules they keep): a file, a folder
and all below it, or a stream of bytes."""

from __future__ import annotations

import io
import os
import posixpath
import stat
import time
from pathlib import Path
from typing import IO

from vmsandbox.errors import InvalidArgument, NotFound
from vmsandbox.guest.localdir import host_error
from vmsandbox.guest.transfer import (
    MAX_DEPTH,
    MODE_BITS,
    GuestFiles,
    TransferSummary,
    guest_path,
    link_inside,
)


def upload(files: GuestFiles, local: str | Path, remote: str) -> TransferSummary:
    """Copy file or folder ``local`` to ``remote`` in the guest: into ``remote`` when it
    is a folder, else to that path (whose folder must exist). ``local`` written ending in
    ``/.`` (a string: a Path drops it) copies a folder's contents into ``remote``."""
    started = time.monotonic()
    contents = str(local).endswith("/.")
    local = Path(local)
    try:
        st = os.stat(local)
    except OSError as exc:
        raise host_error(exc, str(local), "read") from exc
    target = _upload_target(files, remote, Path(os.path.abspath(local)).name, contents, st)
    summary = TransferSummary(str(local), files.where(target))
    files.done, files.total = 0, local_size(local)
    files.check_room(posixpath.dirname(target) or "/", files.total)
    if stat.S_ISDIR(st.st_mode):
        _put_tree(files, Path(local), target, "", summary, 0)
    elif stat.S_ISREG(st.st_mode):
        with open_local(local) as source:
            files.put_file(source, target, st.st_mode, st.st_mtime)
        summary.files += 1
    else:
        raise InvalidArgument(
            f"{local} is neither a file nor a folder",
            details={"field": "source", "value": str(local)},
        )
    summary.bytes, summary.seconds = files.done, time.monotonic() - started
    return summary


def upload_stream(
    files: GuestFiles, data: bytes | bytearray | IO[bytes], remote: str, mode: int = 0o644
) -> TransferSummary:
    """Write ``data`` (bytes, or a binary stream read to its end) to file ``remote`` in
    the guest, with permission bits ``mode``."""

    started = time.monotonic()
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    target = _upload_target(files, remote, None, False, None)
    summary = TransferSummary("<stream>", files.where(target))
    size = len(data) if isinstance(data, bytes | bytearray) else None
    files.done, files.total = 0, size
    if size:
        files.check_room(posixpath.dirname(target) or "/", size)
    files.put_file(stream, target, stat.S_IFREG | mode, None)
    summary.files, summary.bytes = 1, files.done
    summary.seconds = time.monotonic() - started
    return summary


def _upload_target(
    files: GuestFiles, remote: str, name: str | None, contents: bool, st: os.stat_result | None
) -> str:
    """Where an upload lands: into ``remote`` when it is a folder, else ``remote``."""
    path = guest_path(remote, files.home)
    found = files.stat(path)
    is_dir = found is not None and stat.S_ISDIR(found.st_mode or 0)
    if is_dir and name is not None and not contents:
        return posixpath.join(path, name)
    if is_dir and name is None:
        raise InvalidArgument(
            f"{files.where(path)} is a folder: name the file to write",
            details={"field": "destination", "value": remote},
        )
    if found is not None and not is_dir and st is not None and stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(
            f"cannot copy a folder onto the file {files.where(path)}",
            details={"field": "destination", "value": remote},
        )
    if found is None:
        parent = posixpath.dirname(path.rstrip("/")) or "/"
        above = files.stat(parent)
        if above is None or not stat.S_ISDIR(above.st_mode or 0) or remote.endswith("/"):
            missing = path if remote.endswith("/") else parent
            raise NotFound(
                f"{files.where(missing)}: no such folder in the guest",
                details={"side": "guest", "path": missing, "sandbox": files.sandbox},
            )
    return path.rstrip("/") or "/"


def _put_tree(
    files: GuestFiles, local: Path, remote: str, rel: str, summary: TransferSummary, depth: int
) -> None:
    if depth > MAX_DEPTH:
        summary.skip(str(local), f"deeper than {MAX_DEPTH} folders")
        return
    try:
        st = os.stat(local, follow_symlinks=False)
        entries = sorted(os.scandir(local), key=lambda entry: entry.name)
    except OSError as exc:
        raise host_error(exc, str(local), "read") from exc
    if files.stat(remote) is None:
        try:
            files.sftp.mkdir(remote, 0o700)
        except OSError as exc:
            raise files.guest_error(exc, remote, "make the folder") from exc
    summary.directories += 1
    for entry in entries:
        source, target = Path(entry.path), posixpath.join(remote, entry.name)
        inner = posixpath.join(rel, entry.name) if rel else entry.name
        try:
            mode = entry.stat(follow_symlinks=False)
        except OSError as exc:
            raise host_error(exc, str(source), "read") from exc
        if stat.S_ISLNK(mode.st_mode):
            _put_link(files, source, target, rel, summary)
        elif stat.S_ISDIR(mode.st_mode):
            _put_tree(files, source, target, inner, summary, depth + 1)
        elif stat.S_ISREG(mode.st_mode):
            with open_local(source) as handle:
                files.put_file(handle, target, mode.st_mode, mode.st_mtime)
            summary.files += 1
        else:
            summary.skip(str(source), "not a file, folder or link")
    _finish_dir(files, remote, st)


def _put_link(
    files: GuestFiles, source: Path, target: str, rel: str, summary: TransferSummary
) -> None:
    link = os.readlink(source)
    if not link_inside(link, rel):
        summary.skip(str(source), f"a link out of the folder copied (to {link!r})")
        return
    try:
        if files.stat(target, follow=False) is not None:
            files.sftp.remove(target)
        files.sftp.symlink(link, target)
    except OSError as exc:
        raise files.guest_error(exc, target, "make the link") from exc
    summary.symlinks += 1


def _finish_dir(files: GuestFiles, remote: str, st: os.stat_result) -> None:
    try:
        files.sftp.chmod(remote, st.st_mode & MODE_BITS)
        files.sftp.utime(remote, (st.st_atime, st.st_mtime))
    except OSError as exc:
        raise files.guest_error(exc, remote, "set the mode of") from exc


def open_local(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as exc:
        raise host_error(exc, str(path), "read") from exc


def local_size(path: Path) -> int:
    """Bytes of the regular files at and under ``path`` (links not followed below it)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total
