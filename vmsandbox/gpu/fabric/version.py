"""The version rule of shared NVSwitch mode: the guest's NVIDIA driver is FM's version.

Fabric Manager works only with the driver release it was built for; in shared NVSwitch mode
the guests' drivers talk to the partition FM set up, so each guest driver must be the same
release as the host's FM (e.g. 535.216.01 with 535.216.01).

Where the versions come from:

- FM: ``nv-fabricmanager --version`` prints ``Fabric Manager version is : 535.216.01``.
  ``fmpm -l``'s ``version`` field is not it: that is the version of the API structure
  (``fmFabricPartitionList_version``). When FM runs in a service VM and not on this host,
  the operator sets ``fm_version`` in config.toml instead.
- The image: ``nvidia_driver_version`` in its ``meta.json``, recorded at build time from the
  dpkg status of the image's root (the upstream part of the driver package's version).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from vmsandbox.errors import FailedPrecondition

_FM_VERSION = re.compile(r"Fabric Manager version is\s*:\s*(\S+)")
# Packages whose version is the driver's, first found wins (Debian's and NVIDIA's names).
DRIVER_PACKAGES = (
    "nvidia-kernel-dkms",
    "nvidia-open-kernel-dkms",
    "nvidia-driver",
    "cuda-drivers",
)
DPKG_STATUS = Path("var/lib/dpkg/status")
VERSION_TIMEOUT = 30.0


def parse_fm_version(text: str) -> str | None:
    """The release in ``nv-fabricmanager --version``'s output, or None."""
    match = _FM_VERSION.search(text)
    return match[1] if match else None


def fm_version(binary: str = "nv-fabricmanager") -> str:
    """The host FM's release, from ``nv-fabricmanager --version``; FAILED_PRECONDITION when it
    cannot be read (the message says how to set ``fm_version`` instead)."""
    found = binary if "/" in binary else shutil.which(binary)
    hint = (
        "set fm_version in config.toml (VMSANDBOX_FM_VERSION) to the release of the Fabric "
        "Manager that serves this host, or fabric_manager to its nv-fabricmanager"
    )
    if found is None or not Path(found).is_file():
        raise FailedPrecondition(
            f"Fabric Manager's version cannot be read: {binary!r} is not found; {hint}",
            details={"field": "fabric_manager", "value": binary},
        )
    try:
        done = subprocess.run(
            [found, "--version"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FailedPrecondition(
            f"Fabric Manager's version cannot be read: {found} --version failed ({exc}); {hint}"
        ) from exc
    version = parse_fm_version(done.stdout + done.stderr)
    if version is None:
        raise FailedPrecondition(
            f"Fabric Manager's version cannot be read: {found} --version printed "
            f"{(done.stdout + done.stderr).strip()[:200]!r}; {hint}"
        )
    return version


def image_driver_version(root: Path) -> str | None:
    """The NVIDIA driver release installed in the image tree ``root``, or None."""
    try:
        text = (root / DPKG_STATUS).read_text(errors="replace")
    except OSError:
        return None
    versions: dict[str, str] = {}
    for stanza in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Status", "").endswith(" installed") and "Version" in fields:
            versions[fields.get("Package", "")] = fields["Version"]
    for package in DRIVER_PACKAGES:
        if package in versions:
            return upstream_version(versions[package])
    return None


def upstream_version(debian_version: str) -> str:
    """``535.216.01`` of ``1:535.216.01-1~deb12u1``: no epoch, no Debian revision."""
    version = debian_version.split(":", 1)[-1]
    return version.rsplit("-", 1)[0] if "-" in version else version


def check_driver_matches(image: str, image_driver: str | None, fm: str) -> None:
    """FAILED_PRECONDITION, naming both, unless the image's driver is FM's release."""
    if image_driver is None:
        raise FailedPrecondition(
            f"image {image!r} records no NVIDIA driver version, and in shared NVSwitch mode the "
            f"guest's driver must be Fabric Manager's release {fm}: use an image with the "
            "NVIDIA driver, built by this version of vmsandbox (rebuild it to record the version)",
            details={"image": image, "image_driver": None, "fabric_manager": fm},
        )
    if image_driver != fm:
        raise FailedPrecondition(
            f"image {image!r} has NVIDIA driver {image_driver}, but this host's Fabric Manager "
            f"is {fm}: in shared NVSwitch mode they must be the same release; build an image "
            f"with driver {fm} or upgrade Fabric Manager to {image_driver}",
            details={"image": image, "image_driver": image_driver, "fabric_manager": fm},
        )
