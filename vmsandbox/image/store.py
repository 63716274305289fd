"""Guest base images: the store that builds from ``images/`` recipes, imports, lists and removes.

Layout under the image directory (one folder per image name, one per build)::

    <images>/<name>/<id>/disk.qcow2      the base disk (read-only once published)
    <images>/<name>/<id>/vmlinuz         kernel and initrd for direct kernel boot (recipes only)
    <images>/<name>/<id>/initrd.img
    <images>/<name>/<id>/meta.json
    <images>/<name>/current -> <id>      the build new sandboxes use

``id`` is the first 16 hex digits of the recipe's content hash (or of an imported file's hash), so
a rebuild happens only when the recipe changes, and overlays of running sandboxes keep their old
backing file when it does. A build folder, once published, is never changed or replaced: a
forced rebuild of an unchanged recipe goes to ``<id>-2`` (``-3``, ...) and moves ``current``.
Building a recipe whose build is still on disk but no longer current points ``current`` back at
it rather than building again.

What a recipe is: recipe.py; how it becomes the files of one build: build.py.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vmsandbox.config import Config
from vmsandbox.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from vmsandbox.image.build import KERNEL_CMDLINE, build_recipe, require_tools
from vmsandbox.image.check import check_import
from vmsandbox.image.recipe import load_recipe, recipe_names
from vmsandbox.image.replacing import kind, refuse_replacing
from vmsandbox.progress import Progress, silent
from vmsandbox.tools import run_tool, write_with_tool
from vmsandbox.validate import validate_image_name

# Which sandboxes use which build folder, read when asked (image_users.image_users).
Users = Callable[[], Mapping[Path, Sequence[str]]]


@dataclass(frozen=True)
class BaseImage:
    """A built or imported image that sandboxes can be created from."""

    name: str
    id: str
    path: Path  # the build folder
    meta: dict[str, Any]
    # An import that replaced another build (``import_image(replace=True)``): that build.
    replaced: BaseImage | None = field(default=None, compare=False)

    @property
    def disk(self) -> Path:
        return self.path / "disk.qcow2"

    @property
    def kernel(self) -> Path | None:
        return self.path / "vmlinuz" if self.meta.get("kernel") else None

    @property
    def initrd(self) -> Path | None:
        return self.path / "initrd.img" if self.meta.get("initrd") else None

    @property
    def cmdline(self) -> str:
        return str(self.meta.get("cmdline", KERNEL_CMDLINE))

    @property
    def has_control(self) -> bool:
        """Whether the guest serves vmsandbox's control channel (guest/programs/control.py)."""
        return "control.py" in self.meta.get("guest_tools", [])

    @property
    def reports_sshd(self) -> bool:
        """Whether the guest's console says when sshd has started: vmsandbox's first-boot unit
        (guest/programs/firstboot.py) runs in it, and systemd reports each unit there."""
        return "firstboot.py" in self.meta.get("guest_tools", [])

    @property
    def virtual_size(self) -> int:
        return int(self.meta.get("virtual_size", 0))

    def to_dict(self) -> dict[str, Any]:
        data = {"name": self.name, "id": self.id, "path": str(self.path), **self.meta}
        if self.replaced is not None:
            data["replaced"] = {"id": self.replaced.id, **self.replaced.meta}
        return data


class ImageStore:
    """The image directory: what is built, what sandboxes boot from."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def list(self) -> list[BaseImage]:
        """The current build of every image name."""
        if not self.root.is_dir():
            return []
        loaded = (self._load(entry.name) for entry in sorted(self.root.iterdir()))
        return [image for image in loaded if image is not None]

    def get(self, name: str) -> BaseImage:
        validate_image_name(name)
        image = self._load(name)
        if image is None:
            built = ", ".join(image.name for image in self.list())
            hint = (
                f"build it with 'vmsandbox images build {name}'"
                if name in recipe_names()
                else "import one with 'vmsandbox images import PATH NAME'"
            )
            raise NotFound(
                f"image {name!r} is not built in {self.root} (built: {built or 'none'}); {hint}",
                details={"field": "image", "value": name},
            )
        return image

    def _load(self, name: str) -> BaseImage | None:
        meta_file = self.root / name / "current" / "meta.json"
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            return None
        path = meta_file.parent.resolve()
        return BaseImage(name=name, id=path.name, path=path, meta=meta)

    def names(self) -> builtins.list[str]:
        """Every image name with a folder in the store, built or not."""
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.is_dir() and not entry.is_symlink() and not entry.name.startswith(".")
        )

    def builds(self, name: str) -> builtins.list[BaseImage]:
        """Every finished build of ``name``, current or not (a build without readable
        metadata is listed with empty metadata, so that prune can clear it away)."""
        folder = self.root / name
        found = []
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            if entry.is_symlink() or not entry.is_dir() or entry.name.startswith("."):
                continue
            try:
                meta = json.loads((entry / "meta.json").read_text())
            except (OSError, ValueError):
                meta = {}
            found.append(BaseImage(name=name, id=entry.name, path=entry.resolve(), meta=meta))
        return found

    def remove(self, name: str, users: Users) -> builtins.list[Removed]:
        """Remove image ``name``, every build of it; refused while a sandbox's disk backs onto
        any of them. ``users()``, asked under the image lock: build folder -> sandboxes
        (image_users.image_users)."""
        validate_image_name(name)
        if not (self.root / name).is_dir():
            raise NotFound(
                f"image {name!r} is not in {self.root} (images: "
                f"{', '.join(self.names()) or 'none'})",
                details={"field": "name", "value": name},
            )
        with self._writing(name), self._image_lock(name):
            builds = self.builds(name)
            used = users()
            using = sorted({who for build in builds for who in used.get(build.path, ())})
            if using:
                raise FailedPrecondition(
                    f"image {name!r} is in use by {len(using)} sandbox(es): {', '.join(using)}; "
                    "destroy them first",
                    details={"image": name, "sandboxes": using},
                )
            removed = [_delete(build.path, name) for build in builds]
            removed += [_delete(path, name) for path in self._partial_builds(name)]
            shutil.rmtree(self.root / name)
        return removed

    def prune(self, users: Users) -> builtins.list[Removed]:
        """Remove every build that is not the current one of its image and that no sandbox's
        disk backs onto, and the folders of builds that were killed half-way."""
        removed: list[Removed] = []
        for name in self.names():
            with self._writing(name), self._image_lock(name):
                current = self.root / name / "current"
                keep = os.readlink(current) if current.is_symlink() else None
                old = [build for build in self.builds(name) if build.id != keep]
                used = users() if old else {}
                removed += [_delete(b.path, name) for b in old if not used.get(b.path)]
                removed += [_delete(path, name) for path in self._partial_builds(name)]
        return removed

    def _partial_builds(self, name: str) -> builtins.list[Path]:
        """Build folders of a build or import that was killed: under the image lock no build
        of ``name`` is running, so every one of them is dead."""
        return sorted((self.root / name).glob(".build-*"))

    def is_current(self, name: str, build_id: str) -> bool:
        """Whether ``current`` is a build of ``build_id`` (the first one or a forced rebuild)."""
        current = self.root / name / "current"
        if not current.is_symlink():
            return False
        target = os.readlink(current)
        return target == build_id or target.startswith(f"{build_id}-")

    def reuse(self, name: str, build_id: str) -> BaseImage | None:
        """Make the newest finished build of ``build_id`` (``build_id`` or ``build_id-N``)
        current again, when ``current`` points elsewhere (another recipe was built meanwhile);
        None when there is none. Saves rebuilding what is on disk already."""
        same = [
            found
            for found in self.builds(name)
            if found.meta.get("id") == found.id
            and (found.id == build_id or found.id.startswith(f"{build_id}-"))
        ]
        if not same:
            return None
        newest = max(same, key=lambda found: int(found.id.partition("-")[2] or 1))
        self._point_current(self.root / name, newest.id)
        return self.get(name)

    def build(self, name: str, *, force: bool = False, progress: Progress = silent) -> BaseImage:
        """Build recipe ``name`` unless a build of the same recipe hash is already current."""
        recipe = load_recipe(name)
        build_id = recipe.hash[:16]
        with self._writing(name), self._image_lock(name):
            if not force and self.is_current(name, build_id):
                progress(f"image {name} is up to date ({build_id})")
                return self.get(name)
            if not force and (kept := self.reuse(name, build_id)) is not None:
                progress(f"image {name}: build {kept.id} of this recipe is current again")
                return kept
            require_tools("mmdebstrap", "mkfs.ext4", "qemu-img")
            return self._publish(name, build_id, lambda tmp: build_recipe(recipe, tmp, progress))

    def import_image(
        self,
        source: Path,
        name: str,
        *,
        max_disk_gib: int = Config.max_disk_gib,
        replace: bool = False,
        progress: Progress = silent,
    ) -> BaseImage:
        """Copy a qcow2 or raw disk image in as ``name`` (booted by firmware, not by kernel).

        What no sandbox could boot is refused before anything is written (check.py). An import
        never replaces what ``name`` is now without ``replace``: ALREADY_EXISTS when ``name``
        has a current build (a recipe's build, or another file's import) or is a recipe's name
        (its next build would replace the import). With ``replace``, the build it replaced
        stays on disk for the sandboxes made from it (``prune`` removes it once unused), and
        the image returned names it in ``replaced``.
        """
        validate_image_name(name)
        if not source.is_file():
            raise InvalidArgument(f"image file {str(source)!r} does not exist or is not a file")
        fmt = check_import(source, max_disk_gib=max_disk_gib)["format"]
        progress(f"hashing {source}")
        build_id = _file_hash(source)[:16]
        with self._writing(name), self._image_lock(name):
            if self.is_current(name, build_id):
                progress(f"image {name} already holds this file ({build_id})")
                return self.get(name)
            before = self._load(name)
            if not replace:
                refuse_replacing(
                    name, before.id if before else None, before.meta if before else {}, self.root
                )

            def convert(tmp: Path) -> dict[str, Any]:
                progress(f"converting {source} to qcow2")
                disk = str(tmp / "disk.qcow2")
                run_tool(
                    ["qemu-img", "convert", "-f", fmt, "-O", "qcow2", str(source.absolute()), disk],
                    error=FailedPrecondition,  # the source was read fine: writing here failed
                )
                return {"kind": "import", "source": str(source)}

            try:
                image = self._publish(name, build_id, convert)
            except BaseException:
                self._drop_if_empty(name)
                raise
        if before is not None:
            progress(f"image {name}: build {before.id} ({kind(before.meta)}) is no longer current")
            image = BaseImage(image.name, image.id, image.path, image.meta, replaced=before)
        return image

    def _publish(self, name: str, build_id: str, make: Any) -> BaseImage:
        folder = self.root / name
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        folder_id = _unused_build_id(folder, build_id)
        tmp = folder / f".build-{folder_id}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        started = time.monotonic()
        try:
            meta = make(tmp)
            info = _qemu_img_info(tmp / "disk.qcow2")
            meta.update(
                name=name,
                id=folder_id,
                virtual_size=int(info["virtual-size"]),
                file_size=(tmp / "disk.qcow2").stat().st_size,
                built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                build_seconds=round(time.monotonic() - started, 1),
            )
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
            for child in tmp.iterdir():
                os.chmod(child, 0o644)
            os.rename(tmp, folder / folder_id)  # fails rather than replace: the id is unused
            self._point_current(folder, folder_id)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.get(name)

    @staticmethod
    def _point_current(folder: Path, folder_id: str) -> None:
        """Point ``folder``'s ``current`` at build ``folder_id`` in one atomic rename."""
        link = folder / f".current-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(folder_id)
        os.replace(link, folder / "current")

    def _drop_if_empty(self, name: str) -> None:
        """After a failed first import of ``name``: leave no folder holding only its lock."""
        folder = self.root / name
        if not (folder / "current").is_symlink() and not self.builds(name):
            shutil.rmtree(folder, ignore_errors=True)

    @contextlib.contextmanager
    def _writing(self, name: str) -> Iterator[None]:
        """A failed write in the image directory is the host's problem: FAILED_PRECONDITION
        (RESOURCE_EXHAUSTED when the disk is full) naming the path, not INTERNAL."""
        try:
            yield
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise (ResourceExhausted if full else FailedPrecondition)(
                f"cannot write image {name!r} in {self.root}: {exc.strerror or exc} "
                f"({exc.filename or self.root})"
            ) from exc

    @contextlib.contextmanager
    def _image_lock(self, name: str) -> Iterator[None]:
        (self.root / name).mkdir(parents=True, exist_ok=True)
        with open(self.root / name / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield


def _unused_build_id(folder: Path, build_id: str) -> str:
    """``build_id``, or ``build_id-N`` with the lowest N >= 2 that names no folder yet: sandboxes'
    overlays back onto published folders, so a rebuild never reuses one."""
    candidate, number = build_id, 1
    while (folder / candidate).exists():
        number += 1
        candidate = f"{build_id}-{number}"
    return candidate


@dataclass(frozen=True)
class Removed:
    """A build folder that remove or prune deleted, and the disk space that freed."""

    name: str
    id: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "id": self.id, "bytes": self.bytes}


def _delete(folder: Path, name: str) -> Removed:
    freed = 0
    for dirpath, _dirs, files in os.walk(folder):
        for file in files:
            with contextlib.suppress(OSError):
                freed += os.lstat(os.path.join(dirpath, file)).st_blocks * 512
    shutil.rmtree(folder)
    return Removed(name=name, id=folder.name, bytes=freed)


def make_overlay(base: Path, overlay: Path, disk_gib: int) -> None:
    """A qcow2 overlay of ``disk_gib`` GiB on base image ``base`` (0600, written atomically)."""
    write_with_tool(
        overlay,
        lambda partial: [
            *("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2"),
            *("-b", str(base), str(partial), f"{disk_gib}G"),
        ],
        what=f"cannot create overlay {overlay}",
    )


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _qemu_img_info(path: Path) -> dict[str, Any]:
    out = run_tool(["qemu-img", "info", "--output=json", str(path)])
    return json.loads(out)
