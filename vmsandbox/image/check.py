"""What ``images import`` accepts: a disk that firmware could boot, refused at once otherwise.

An imported image has no kernel of its own: the guest's firmware boots it from the disk. A file
that cannot boot that way (``/etc/passwd``, a file of zeros, a bare filesystem, a compressed
download) would otherwise be found out only when a sandbox waits out its whole boot timeout.

Accepted: a healthy qcow2 (``qemu-img check``) with no backing or external data file (either
would make the import read some other file of the host) and with data written to it (a blank
qcow2, fresh from ``qemu-img create``, boots nothing), or a raw disk whose first
sectors hold a boot sector or MBR (signature 0x55AA), or a GPT header; in both cases no larger
than the host's per-sandbox disk cap. Anything else is INVALID_ARGUMENT naming what was found.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any, BinaryIO

from vmsandbox.errors import FailedPrecondition, InvalidArgument

HEAD_BYTES = 1 << 20  # what is read of a raw image: every signature below lies within it
ZERO_SCAN_BYTES = 64 << 20  # how far a raw image that starts with zeros is read for "all zeros"
_MBR_SIGNATURE = (510, b"\x55\xaa")  # MBR partition table, or a boot sector (FAT, a bootloader)
_GPT_HEADERS = ((512, b"EFI PART"), (4096, b"EFI PART"))  # LBA 1 with 512- or 4096-byte sectors
# Things people import by mistake, by the signature that gives them away, and what to say.
_FOUND = (
    (0, b"\x7fELF", "an ELF executable"),
    (0, b"\x1f\x8b", "gzip-compressed data (decompress it first)"),
    (0, b"\xfd7zXZ\x00", "xz-compressed data (decompress it first)"),
    (0, b"\x28\xb5\x2f\xfd", "zstd-compressed data (decompress it first)"),
    (0, b"BZh", "bzip2-compressed data (decompress it first)"),
    (0, b"PK\x03\x04", "a zip archive"),
    (257, b"ustar", "a tar archive (extract the disk image from it first)"),
    (0, b"hsqs", "a squashfs filesystem, with no partition table or boot sector"),
    (0, b"XFSB", "an XFS filesystem, with no partition table or boot sector"),
    (0x10040, b"_BHRfS_M", "a btrfs filesystem, with no partition table or boot sector"),
    (1080, b"\x53\xef", "an ext2/3/4 filesystem, with no partition table or boot sector"),
    (0, b"LUKS\xba\xbe", "a LUKS encrypted volume, with no partition table"),
    (0x8001, b"CD001", "an ISO 9660 image without a hybrid MBR (a disk cannot boot it)"),
)
_QCOW2_CHECK_OK = (0, 3)  # qemu-img check: 0 clean, 3 only leaked clusters (harmless)


def check_import(source: Path, *, max_disk_gib: int) -> dict[str, Any]:
    """Refuse ``source`` unless a sandbox could boot from it; its ``qemu-img info`` otherwise."""
    shown = repr(str(source))
    info = _info(source, shown)
    fmt = info.get("format")
    if fmt not in ("qcow2", "raw"):
        raise _refuse(
            source,
            f"image file {shown} has format {fmt!r}; allowed: qcow2, raw "
            f"(convert it with 'qemu-img convert -O qcow2')",
            found=str(fmt),
        )
    if info.get("backing-filename"):
        raise _refuse(
            source,
            f"image file {shown} is a qcow2 overlay of {info['backing-filename']!r}; "
            "flatten it first ('qemu-img convert -O qcow2 OVERLAY FLAT')",
            found="backing file",
        )
    data_file = (info.get("format-specific") or {}).get("data", {}).get("data-file")
    if data_file:
        raise _refuse(
            source,
            f"image file {shown} keeps its data in another file ({data_file!r}); "
            "flatten it first ('qemu-img convert -O qcow2 IMAGE FLAT')",
            found="external data file",
        )
    size = int(info.get("virtual-size", 0))
    if size > max_disk_gib * 2**30:
        raise _refuse(
            source,
            f"image file {shown} is a {size / 2**30:.1f} GiB disk, over this host's cap of "
            f"{max_disk_gib} GiB per sandbox (config max_disk_gib)",
            found=f"{size} bytes",
        )
    if fmt == "qcow2":
        _check_qcow2(source, shown)
        _check_not_blank(source, shown)
    else:
        found = unbootable_raw(source)
        if found is not None:
            raise _refuse(
                source,
                f"image file {shown} cannot boot: it is {found}; import a qcow2 image or a raw "
                "disk image with an MBR or GPT partition table",
                found=found,
            )
    return info


def unbootable_raw(source: Path) -> str | None:
    """None when the raw disk ``source`` starts like a bootable disk; else what it is."""
    with source.open("rb") as handle:
        head = handle.read(HEAD_BYTES)
        if _at(head, *_MBR_SIGNATURE) or any(_at(head, *gpt) for gpt in _GPT_HEADERS):
            return None
        if not head:
            return "an empty file"
        if not head.strip(b"\0"):
            return _zeros(handle, len(head))
    for offset, magic, what in _FOUND:
        if _at(head, offset, magic):
            return what
    if b"\0" not in head:
        try:
            head.decode("utf-8")
            return "a text file"
        except UnicodeDecodeError:
            pass  # a partial character at the end of the head, or not text at all
    return "data with no partition table or boot sector (no MBR or GPT)"


def _zeros(handle: BinaryIO, start: int) -> str:
    """What to call a file whose first ``start`` bytes (read from ``handle``) are zeros."""
    scanned = start
    while scanned < ZERO_SCAN_BYTES:
        chunk = handle.read(HEAD_BYTES)
        if not chunk:
            return "all zeros"
        if chunk.strip(b"\0"):
            break
        scanned += len(chunk)
    return f"zeros in its first {scanned >> 20} MiB, with no partition table or boot sector"


def _at(data: bytes, offset: int, magic: bytes) -> bool:
    return data[offset : offset + len(magic)] == magic


def _info(source: Path, shown: str) -> dict[str, Any]:
    done = _qemu_img("info", "--output=json", str(source.absolute()))
    if done.returncode != 0:
        raise _refuse(
            source,
            f"image file {shown} is not a readable disk image: {_last_line(done.stderr)}",
            found="unreadable",
        )
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _check_qcow2(source: Path, shown: str) -> None:
    done = _qemu_img("check", "--output=json", "-f", "qcow2", str(source.absolute()))
    if done.returncode in _QCOW2_CHECK_OK:
        return
    try:
        report = json.loads(done.stdout)
    except ValueError:
        report = {}
    errors = [line.strip() for line in done.stderr.splitlines() if line.startswith("ERROR")]
    first = errors[0][:300] if errors else _last_line(done.stderr)
    if report.get("corruptions"):
        problem = f"qemu-img check found {report['corruptions']} corruptions ({first})"
    else:
        problem = f"qemu-img check could not finish ({first})"
    raise _refuse(
        source,
        f"image file {shown} is a damaged qcow2 (truncated or corrupt): {problem}",
        found="corrupt qcow2",
    )


def _check_not_blank(source: Path, shown: str) -> None:
    """Refuse a qcow2 that holds no data at all (every cluster unallocated or zero)."""
    done = _qemu_img("map", "--output=json", "-f", "qcow2", str(source.absolute()))
    try:
        extents = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        extents = None
    if extents is not None and not any(extent.get("data") for extent in extents):
        raise _refuse(
            source,
            f"image file {shown} cannot boot: it is a blank qcow2 (nothing was ever written to "
            "it); import a disk image with an operating system on it",
            found="blank qcow2",
        )


def _qemu_img(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["qemu-img", *args], capture_output=True, text=True, errors="replace", check=False
        )
    except OSError as exc:
        raise FailedPrecondition(f"cannot run qemu-img: {exc}; run the setup (make setup)") from exc


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no message)"


def _refuse(source: Path, message: str, *, found: str) -> InvalidArgument:
    return InvalidArgument(message, details={"field": "path", "value": str(source), "found": found})
