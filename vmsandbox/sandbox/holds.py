"""Reservations: what each sandbox of a state directory holds of the host's shared resources,
written under the host lock before anything is made, so that slow work can happen outside it.

libvirt is the truth of what exists; this ledger is the truth of what is *taken*. One file per
sandbox, ``<state_dir>/holds/<uuid>.json``, named by the domain UUID the sandbox has (or will
have once defined): its name, the GPUs, port and Fabric Manager partition it holds, the disk
its saved memory takes (suspended, parked), whether it is a pooled guest not claimed yet, and
the owner of a transition in flight (a create, claim, fill, suspend, resume or destroy:
``vm.process.Ownership``). The rules that keep it true:

- **Written only under the host lock** (``Holds`` refuses otherwise), by the process that owns
  the transition; a locked step commits only while it still owns the hold (``owned``).
- **A superset of libvirt.** A hold is written before its domain is defined and dropped only
  after its domain is undefined, so a crash leaves a hold too many, never one too few: nothing
  another sandbox holds can look free. A hold whose owner is gone is left over; reconcile
  takes its remains apart and drops it.
- **Dropped holds leave a tombstone** (``<uuid>.gone``) until reconcile, whose view is newer,
  sees the domain gone: a view read before the drop must not count the domain again.
- **A dropped hold's GPUs are sanitizing** (``vmsandbox.gpu.custody``): marked so under the
  same hold of the lock, before the file goes, so no GPU is free in both ledgers before it
  was reset and cleared. The caller sanitizes them once the lock is let go (custody.py);
  whatever it does not finish, reconcile does.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, Internal, ResourceExhausted, VmSandboxError
from vmsandbox.gpu.custody.work import release
from vmsandbox.lock import held
from vmsandbox.tools import write_json
from vmsandbox.vm.domain import DOMAIN_PREFIX
from vmsandbox.vm.process import Ownership, ProcessIdentity

TEARDOWNS = ("destroy", "reconcile")  # what a hold's owner does when it takes a sandbox apart
# What a hold's owner does when it saves or restores a sandbox's memory (suspend.py,
# resume.py): left over, reconcile settles it rather than taking the sandbox apart.
SAVES = ("suspend", "resume")


@dataclass(frozen=True)
class Hold:
    """What one sandbox (domain UUID ``uuid``) holds. ``stem`` is the name its domain and files
    carry (a claimed pooled guest keeps the guest's); ``pool`` the shape key of a pooled guest
    nobody has claimed (``image_id`` its image build); ``saved_bytes`` the disk its saved
    memory takes, or may take while a save is at work (``max_saved_gib`` counts them);
    ``owner`` the transition at work on it (``doing``: create, claim, fill, suspend, resume,
    destroy), None once it is settled."""

    uuid: str
    name: str
    stem: str
    gpus: tuple[str, ...] = ()
    port: int | None = None
    partition: int | None = None
    pool: str | None = None
    image_id: str | None = None
    saved_bytes: int = 0
    owner: ProcessIdentity | None = None
    doing: str = ""
    since: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def domain(self) -> str:
        return DOMAIN_PREFIX + self.stem

    @property
    def busy(self) -> bool:
        """Whether a transition is at work on it now (its owner lives)."""
        return self.owner is not None and self.owner.alive()

    @property
    def left_over(self) -> bool:
        """Whether a transition was at work on it and is gone: reconcile's to take apart."""
        return self.owner is not None and not self.owner.alive()

    @property
    def being_removed(self) -> bool:
        """Whether a teardown has taken it over (working, or left over for reconcile): nothing
        may commit to the sandbox any more."""
        return self.owner is not None and self.doing in TEARDOWNS

    def owned_by(self, owner: ProcessIdentity | None) -> bool:
        return owner is not None and self.owner == owner

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = list(self.gpus)
        data["owner"] = self.owner.to_dict() if self.owner else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Hold:
        owner = data.get("owner")
        return cls(
            uuid=str(data["uuid"]),
            name=str(data["name"]),
            stem=str(data.get("stem") or data["name"]),
            gpus=tuple(str(bdf) for bdf in data.get("gpus") or ()),
            port=int(data["port"]) if data.get("port") else None,
            partition=None if data.get("partition") is None else int(data["partition"]),
            pool=str(data["pool"]) if data.get("pool") else None,
            image_id=str(data["image_id"]) if data.get("image_id") else None,
            saved_bytes=int(data.get("saved_bytes") or 0),
            owner=ProcessIdentity.from_dict(owner) if isinstance(owner, dict) else None,
            doing=str(data.get("doing", "")),
            since=str(data.get("since", "")),
        )


class Holds:
    """The ledger of one state directory (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.folder = config.state_dir / "holds"

    def _check_locked(self, doing: str) -> None:
        if not held(self.config.lock_path):
            raise Internal(
                f"{doing} outside the host lock: reservations change under the lock only",
                details={"lock": str(self.config.lock_path)},
            )

    def all(self) -> dict[str, Hold]:
        """Every hold, by UUID (read under the lock: what it says is current)."""
        found: dict[str, Hold] = {}
        if not self.folder.is_dir():
            return found
        for path in self.folder.glob("*.json"):
            try:
                hold = Hold.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half-written by a writer that died: its owner is gone too
            found[hold.uuid] = hold
        return found

    def get(self, uuid: str) -> Hold | None:
        return self.all().get(uuid) if uuid else None

    def others_named(self, uuid: str, stem: str) -> list[Hold]:
        """The holds other than ``uuid``'s that reserve the name ``stem`` (files of that name
        are theirs then, never ``uuid``'s to remove)."""
        return [h for h in self.all().values() if h.uuid != uuid and stem in (h.name, h.stem)]

    def put(self, hold: Hold) -> Hold:
        """Write ``hold`` (atomically: readers see the old one or the new one)."""
        self._check_locked(f"writing the reservation of sandbox {hold.name!r}")
        path = self.folder / f"{hold.uuid}.json"
        try:
            write_json(path, hold.to_dict())
        except OSError as exc:
            partial = path.with_suffix(".partial")
            doing = f"writing the reservation of sandbox {hold.name!r}"
            raise unwritable(doing, exc, partial) from exc
        (self.folder / f"{hold.uuid}.gone").unlink(missing_ok=True)
        return hold

    def drop(self, uuid: str, *, tombstone: bool = True) -> None:
        """Forget the hold of ``uuid`` (its domain is undefined by now), leaving a tombstone
        unless no domain was ever defined for it (``tombstone`` False)."""
        self._check_locked(f"dropping the reservation {uuid}")
        path = self.folder / f"{uuid}.json"
        hold = self.get(uuid)
        if hold is not None and hold.gpus:
            cause = f"reservation of {hold.name} ({uuid}) dropped"
            release(self.config, hold.gpus, cause, hold.partition)
        if path.exists():
            if tombstone:
                with contextlib.suppress(OSError):  # a full disk: reconcile's view is right
                    gone = self.folder / f"{uuid}.gone"
                    os.close(os.open(gone, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            path.unlink()

    def gone(self) -> set[str]:
        """The UUIDs dropped since reconcile last saw their domains gone."""
        if not self.folder.is_dir():
            return set()
        return {path.stem for path in self.folder.glob("*.gone")}

    def forget_gone(self, uuids: Iterable[str]) -> None:
        """Remove tombstones (reconcile, whose view no longer lists those domains)."""
        self._check_locked("removing tombstones of reservations")
        for uuid in uuids:
            with contextlib.suppress(FileNotFoundError):
                (self.folder / f"{uuid}.gone").unlink()


def unwritable(doing: str, exc: OSError, path: Path) -> VmSandboxError:
    """RESOURCE_EXHAUSTED for a full disk, FAILED_PRECONDITION otherwise, naming the file."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return (ResourceExhausted if full else FailedPrecondition)(
        f"{doing}: {exc.strerror or exc} ({exc.filename or path})",
        details={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
    )


def settled(hold: Hold) -> Hold:
    """``hold`` with no transition at work on it."""
    return replace(hold, owner=None, doing="")


def owners_folder(config: Config) -> Path:
    """Where transitions keep their owner files (``vm.process.Ownership``)."""
    return config.state_dir / "owners"


def own(config: Config) -> Ownership:
    """A new owner file for a transition; a clear error when it cannot be written."""
    try:
        return Ownership(owners_folder(config))
    except OSError as exc:
        raise unwritable("writing the owner file of this call", exc, owners_folder(config)) from exc
