"""``vmsandbox images``: build from a recipe, import a disk, list, remove and prune."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

from vmsandbox.cli.output import Output, mib, table

if TYPE_CHECKING:
    from vmsandbox.config import Config
    from vmsandbox.image.store import ImageStore


def run(args: argparse.Namespace, out: Output) -> int:
    from pathlib import Path

    from vmsandbox.config import Config
    from vmsandbox.image.replacing import kind
    from vmsandbox.image.store import ImageStore
    from vmsandbox.progress import StderrProgress

    config = Config.load()
    store = ImageStore(config.images)
    if args.images_command in ("rm", "prune"):
        return _remove(args, config, store, out)
    if args.images_command == "build":
        image = store.build(args.recipe, force=args.force, progress=StderrProgress())
        out.result(image.to_dict(), f"built {image.name} ({image.id}) at {image.disk}")
    elif args.images_command == "import":
        image = store.import_image(
            Path(args.path),
            args.name,
            max_disk_gib=config.max_disk_gib,
            replace=args.replace,
            progress=StderrProgress(),
        )
        text = f"imported {image.name} ({image.id}) at {image.disk}"
        if image.replaced is not None:
            text += (
                f"\nreplaced {image.name} {image.replaced.id} ({kind(image.replaced.meta)}): "
                "new sandboxes boot the import; 'vmsandbox images prune' removes the old build "
                "once no sandbox uses it"
            )
        out.result(image.to_dict(), text)
    else:
        images = [image.to_dict() for image in store.list()]
        rows = [
            (
                i["name"],
                i["id"],
                i.get("kind", "?"),
                i.get("kernel_version", "-"),
                f"{i.get('virtual_size', 0) / 2**30:.1f}G",
                i.get("built_at", "?"),
            )
            for i in images
        ]
        shown = table(("NAME", "ID", "KIND", "KERNEL", "SIZE", "BUILT"), rows)
        out.result({"images": images}, shown if rows else "no images built")
    return 0


def _remove(args: argparse.Namespace, config: Config, store: ImageStore, out: Output) -> int:
    """``images rm NAME`` and ``images prune``: what was removed and the disk space freed."""
    from vmsandbox.image.users import image_users
    from vmsandbox.vm.connection import open_connection

    conn = open_connection(config.uri)
    try:
        users = functools.partial(image_users, conn, store)
        if args.images_command == "rm":
            removed = store.remove(args.name, users)
        else:
            removed = store.prune(users)
    finally:
        conn.close()
    freed = sum(build.bytes for build in removed)
    lines = [f"removed {b.name} {b.id} ({mib(b.bytes)})" for b in removed]
    text = "\n".join([*lines, f"freed {mib(freed)}"]) if removed else "nothing to remove"
    out.result({"removed": [build.to_dict() for build in removed], "freed_bytes": freed}, text)
    return 0
