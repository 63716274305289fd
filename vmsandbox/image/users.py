"""Which sandboxes use which image builds: what ``images rm`` and ``images prune`` must spare.

A sandbox's overlay backs onto its image's ``disk.qcow2`` for as long as the sandbox exists, so a
build in use must stay. Read from libvirt, the source of truth, across every domain of the
connection (sandboxes of other state directories share the image store): each disk's backing
chain (``qemu-img info --backing-chain``, which also finds a chain libvirt has not probed), and,
for vmsandbox domains, the image build their record names (a sandbox whose overlay is gone still
counts: destroy is what ends its claim).

It fails closed: a domain that cannot be read (libvirtd restarting, say), or a disk that exists
but whose backing chain ``qemu-img`` cannot read, aborts the answer with an error; a build is
never taken for unused because its user could not be seen. Only a domain undefined while it
was being read, and a disk that is gone, use nothing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import libvirt
from lxml import etree

from vmsandbox.errors import FailedPrecondition
from vmsandbox.image.store import ImageStore
from vmsandbox.vm import domain as domain_xml
from vmsandbox.vm.connection import libvirt_errors, translate


def image_users(conn: libvirt.virConnect, store: ImageStore) -> dict[Path, list[str]]:
    """Build folder of ``store`` -> the sandboxes (or other domains, by domain name) using it."""
    root = store.root.resolve()
    users: dict[Path, set[str]] = {}
    with libvirt_errors("listing domains to see which images they use"):
        domains = conn.listAllDomains(0)
    for dom in domains:
        try:
            xml = dom.XMLDesc(0)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                continue  # undefined while we looked: it uses nothing now
            doing = f"reading domain {dom.name()!r} to see which images it uses"
            raise translate(exc, doing) from exc
        parsed = domain_xml.read_metadata(xml)
        record = parsed[0] if parsed is not None else {}
        who = str(record.get("name") or dom.name())
        files = [Path(file) for file in _backing_files(xml)]
        if isinstance(record.get("image"), str) and isinstance(record.get("image_id"), str):
            files.append(root / record["image"] / record["image_id"] / "disk.qcow2")
        for build in {_build_of(file, root) for file in files}:
            if build is not None:
                users.setdefault(build, set()).add(who)
    return {build: sorted(names) for build, names in users.items()}


def _backing_files(xml: str) -> set[str]:
    """Every file a domain's disks are made of: their sources and all their backing files."""
    root = etree.fromstring(xml.encode(), etree.XMLParser(resolve_entities=False))
    files: set[str] = set()
    for disk in root.iterfind("devices/disk"):
        sources = {source.get("file") for source in disk.iter("source")} - {None}
        files.update(str(file) for file in sources)
        if disk.get("device", "disk") == "disk":
            for source in sources:
                files.update(_chain(str(source)))
    return files


def _chain(path: str) -> list[str]:
    """The backing files below ``path`` (``-U``: the disk of a running guest is locked)."""
    if not Path(path).exists():
        return []  # an overlay that is gone backs onto nothing
    done = subprocess.run(
        ["qemu-img", "info", "-U", "--backing-chain", "--output=json", path],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        chain = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        chain = None
    if not isinstance(chain, list):
        raise FailedPrecondition(
            f"the backing chain of disk {path} cannot be read (qemu-img info: "
            f"{done.stderr.strip() or 'no JSON'}): not removing images while a domain's "
            "disks cannot be seen",
            details={"disk": path},
        )
    return [str(layer["filename"]) for layer in chain if isinstance(layer, dict)]


def _build_of(file: Path, root: Path) -> Path | None:
    """The build folder ``<root>/<name>/<id>`` that ``file`` lies in, if it lies in one (the
    folder path resolved, through ``current``; the file itself may be a link out of the store)."""
    try:
        parts = (file.parent.resolve() / file.name).relative_to(root).parts
    except ValueError:
        return None
    return root / parts[0] / parts[1] if len(parts) >= 3 else None
