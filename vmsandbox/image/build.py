"""A recipe's base image: mmdebstrap a root tree, take its kernel, make ext4, convert to qcow2.

The image store (store.py) decides when to build and publishes the folder this fills; this module
only knows how a recipe (recipe.py) becomes the files of one build. Bump recipe.py's
``BUILDER_VERSION`` when these steps change what a recipe produces.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from vmsandbox.errors import FailedPrecondition
from vmsandbox.gpu.fabric.version import image_driver_version
from vmsandbox.image.apt_sources import mirror_lines
from vmsandbox.image.recipe import Recipe
from vmsandbox.progress import Progress
from vmsandbox.tools import run_streaming, run_tool

KERNEL_CMDLINE = "root=/dev/vda rw console=ttyS0,115200 net.ifnames=0 biosdevname=0"
# Given to guests that boot with passed devices: the lean initramfs (images/common/lean.sh)
# then leaves the NIC's driver to udev instead of loading it before systemd. With the NIC's
# driver loaded that early, every GPU guest booted on the nested test host (KVM in a TCG
# guest) made that host's kernel panic in KVM's vCPU reset; loaded by udev, it boots.
LATE_NIC_ARG = "vmsandbox.nic=late"


def build_recipe(recipe: Recipe, tmp: Path, progress: Progress) -> dict[str, Any]:
    """Build ``recipe`` into ``tmp``: disk.qcow2, vmlinuz and initrd.img; returns its meta.json."""
    data = recipe.data
    suite = str(data.get("suite", "bookworm"))
    components = [str(c) for c in data.get("components", ["main"])]
    packages = [str(p) for p in data.get("packages", [])]
    rootdir = tmp / "root"
    hooks = [
        f"--customize-hook=install -D -m 0755 {shlex.quote(str(tool))} "
        f'"$1/usr/lib/vmsandbox/{tool.name}"'
        for tool in recipe.tools
    ]
    hooks += [f'--customize-hook={shlex.quote(str(s))} "$1"' for s in recipe.scripts]
    command = [
        "mmdebstrap",
        "--mode=root",
        "--variant=apt",
        "--format=directory",
        f"--components={','.join(components)}",
        f"--include={','.join(packages)}",
        '--aptopt=APT::Install-Recommends "false"',
        "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-exclude=/usr/share/man/*",
        "--dpkgopt=path-exclude=/usr/share/locale/*",
        "--dpkgopt=path-include=/usr/share/locale/locale.alias",
        *hooks,
        suite,
        str(rootdir),
        *mirror_lines(suite, components),
    ]
    progress(f"mmdebstrap {suite}: {len(packages)} packages ({', '.join(components)})")
    run_streaming(command, progress, message=_mmdebstrap_message)
    boot = rootdir / "boot"
    kernels = sorted(boot.glob("vmlinuz-*"))
    initrds = sorted(boot.glob("initrd.img-*"))
    if not kernels or not initrds:
        raise FailedPrecondition(f"recipe {recipe.name!r} produced no kernel or initrd in /boot")
    kernel_version = kernels[-1].name.removeprefix("vmlinuz-")
    shutil.copyfile(kernels[-1], tmp / "vmlinuz")
    shutil.copyfile(initrds[-1], tmp / "initrd.img")
    nvidia_driver = image_driver_version(rootdir)  # shared NVSwitch mode's version rule
    used = _tree_size(rootdir)
    size_mib = (used * 12 // 10) // 2**20 + int(data.get("headroom_mib", 512))
    progress(f"making ext4 filesystem ({size_mib} MiB, {used // 2**20} MiB of files)")
    raw = tmp / "disk.raw"
    run_tool(["mkfs.ext4", "-q", "-F", "-L", "root", "-d", str(rootdir), str(raw), f"{size_mib}M"])
    shutil.rmtree(rootdir)
    progress("converting to qcow2")
    run_tool(["qemu-img", "convert", "-O", "qcow2", str(raw), str(tmp / "disk.qcow2")])
    raw.unlink()
    return {
        "kind": "recipe",
        "recipe_hash": recipe.hash,
        "description": data.get("description", ""),
        "kernel": "vmlinuz",
        "initrd": "initrd.img",
        "kernel_version": kernel_version,
        "cmdline": kernel_cmdline(recipe),
        "packages": packages,
        "nvidia_driver_version": nvidia_driver,
        # what vmsandbox may rely on in the guest (control.py: the control channel's server)
        "guest_tools": [tool.name for tool in recipe.tools],
    }


def kernel_cmdline(recipe: Recipe) -> str:
    """The kernel command line of the recipe's guests: vmsandbox's own, then the recipe's
    ``kernel_args``."""
    return " ".join([KERNEL_CMDLINE, *recipe.kernel_args])


def _mmdebstrap_message(line: str) -> str | None:
    """mmdebstrap's info, warning and error lines, as progress messages."""
    return f"mmdebstrap: {line[3:]}" if line.startswith(("I: ", "E: ", "W: ")) else None


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for file in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, file)).st_size
    return total


def require_tools(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise FailedPrecondition(
            f"missing tools for image builds: {', '.join(missing)}; run the setup (make setup)"
        )
