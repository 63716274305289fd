"""Finding and reading the NoCloud seed for vmsandbox's first-boot unit (firstboot.py): the
block device of the ISO 9660 volume labelled cidata, and its three files from the Joliet tree.

A module of the first-boot unit, installed beside it as /usr/lib/vmsandbox/firstboot_iso.py.
Standard library only: it runs with ``python3 -I -S``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

if __package__:  # a module of vmsandbox (the tests run it on the host)
    from .firstboot_seed import SeedError
else:  # in the guest, a module of /usr/lib/vmsandbox
    from firstboot_seed import SeedError

# Every import costs under TCG, on the way to sshd: typing (and dataclasses, which imports inspect)
# is kept out of the way.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

LABEL = b"cidata"
# ISO 9660: 2048-byte sectors; the primary volume descriptor at sector 16 ("CD001" at byte 1,
# the volume id at 40), the others after it; a Joliet one is a supplementary descriptor (type 2)
# with one of the UCS-2 escape sequences at byte 88.
ISO_SECTOR = 2048
PVD_OFFSET = 16 * ISO_SECTOR
JOLIET_ESCAPES = (b"%/@", b"%/C", b"%/E")
MAX_DESCRIPTORS = 16
MAX_DIRECTORY = 64 * ISO_SECTOR
SEED_WAIT_S = 60.0
POLL_S = 0.05


def _volume_label(device: Path) -> bytes | None:
    """The ISO 9660 volume id of a block device, or None when it holds no ISO 9660 volume."""
    try:
        with device.open("rb") as handle:
            handle.seek(PVD_OFFSET)
            pvd = handle.read(72)
    except OSError:
        return None
    if len(pvd) < 72 or pvd[:6] != b"\x01CD001":
        return None
    return pvd[40:72].rstrip(b" \0")


def find_seed(dev: Path = Path("/dev"), timeout: float = SEED_WAIT_S) -> Path:
    """The block device of the volume labelled cidata (whole disks and CD-ROMs, waited for:
    their drivers may still be loading)."""
    deadline = time.monotonic() + timeout
    while True:
        for name in sorted(os.listdir("/sys/class/block")):
            partition = os.path.exists(f"/sys/class/block/{name}/partition")
            if not partition and _volume_label(dev / name) == LABEL:
                return dev / name
        if time.monotonic() > deadline:
            raise SeedError(
                f"no NoCloud seed (an ISO 9660 volume labelled cidata) appeared within "
                f"{timeout:.0f}s"
            )
        time.sleep(POLL_S)


def read_seed(device: Path) -> tuple[str, ...]:
    """user-data, meta-data and network-config ("" when absent) of the seed on ``device``,
    read from its Joliet directory (vmsandbox writes the seed with genisoimage -joliet): no
    mount, so no mount and umount programs and no iso9660 driver to load on the way to sshd."""
    try:
        with device.open("rb") as volume:
            files = _joliet_root(volume, device)
            texts = []
            for name in ("user-data", "meta-data", "network-config"):
                if name not in files:
                    if name == "network-config":
                        texts.append("")
                        continue
                    raise SeedError(f"the seed on {device} has no {name}")
                extent, size = files[name]
                volume.seek(extent * ISO_SECTOR)
                data = volume.read(size)
                if len(data) != size:
                    raise SeedError(f"the seed on {device} ends inside {name}")
                texts.append(data.decode())
            return tuple(texts)
    except UnicodeDecodeError as exc:
        raise SeedError(f"the seed on {device} holds a file that is not UTF-8 ({exc})") from exc


def _joliet_root(volume: Any, device: Path) -> dict[str, tuple[int, int]]:
    """The files in the root directory of the volume's Joliet tree: name -> (extent, size)."""
    for sector in range(16, 16 + MAX_DESCRIPTORS):
        volume.seek(sector * ISO_SECTOR)
        descriptor = volume.read(ISO_SECTOR)
        if len(descriptor) < ISO_SECTOR or descriptor[1:6] != b"CD001" or descriptor[0] == 255:
            break
        if descriptor[0] == 2 and descriptor[88:91] in JOLIET_ESCAPES:
            root = descriptor[156:190]
            extent, size = _u32(root, 2), _u32(root, 10)
            if size > MAX_DIRECTORY:
                raise SeedError(f"the seed on {device} has a root directory of {size} bytes")
            volume.seek(extent * ISO_SECTOR)
            return _directory(volume.read(size))
    raise SeedError(f"the seed on {device} has no Joliet directory (vmsandbox writes one)")


def _directory(data: bytes) -> dict[str, tuple[int, int]]:
    """The plain files of one ISO 9660 directory with Joliet (UCS-2) names, version cut."""
    files = {}
    at = 0
    while at < len(data):
        length = data[at]
        if length == 0:  # records do not cross sectors: the rest of this one is padding
            at = (at // ISO_SECTOR + 1) * ISO_SECTOR
            continue
        record = data[at : at + length]
        at += length
        name_length = record[32]
        if length < 33 + name_length or record[25] & 0x02:  # short, or a directory
            continue
        name = record[33 : 33 + name_length].decode("utf-16-be", errors="replace")
        files[name.split(";", 1)[0]] = (_u32(record, 2), _u32(record, 10))
    return files


def _u32(data: bytes, at: int) -> int:
    """The little-endian half of an ISO 9660 both-endian 32-bit number."""
    return int.from_bytes(data[at : at + 4], "little")
