"""Operator configuration: defaults, then a TOML file, then environment variables.

File: ``$VMSANDBOX_CONFIG`` or ``/etc/vmsandbox/config.toml`` (optional). Environment variables
override single keys: ``VMSANDBOX_URI``, ``VMSANDBOX_STATE_DIR``, ``VMSANDBOX_IMAGE_DIR``,
``VMSANDBOX_VIRT_TYPE``, ``VMSANDBOX_NETWORK``, ``VMSANDBOX_BOOT_TIMEOUT``,
``VMSANDBOX_PROBE_QEMU``, ``VMSANDBOX_GPU_FIRMWARE``, ``VMSANDBOX_OPENSHELL_ALLOWED_UIDS``
(comma-separated), and for NVSwitch boards ``VMSANDBOX_FMPM``, ``VMSANDBOX_FM_UNIX_SOCKET``,
``VMSANDBOX_FM_HOSTNAME``, ``VMSANDBOX_FABRIC_MANAGER``, ``VMSANDBOX_FM_VERSION``,
``VMSANDBOX_FABRIC_MANAGER_CONFIG``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from vmsandbox import virt
from vmsandbox.errors import InvalidArgument
from vmsandbox.pool import PoolShape, parse_table

DEFAULT_CONFIG_FILE = "/etc/vmsandbox/config.toml"
GPU_FIRMWARE = ("auto", "uefi", "bios")

_ENV = {
    "uri": "VMSANDBOX_URI",
    "state_dir": "VMSANDBOX_STATE_DIR",
    "image_dir": "VMSANDBOX_IMAGE_DIR",
    "virt_type": "VMSANDBOX_VIRT_TYPE",
    "network": "VMSANDBOX_NETWORK",
    "boot_timeout": "VMSANDBOX_BOOT_TIMEOUT",
    "openshell_allowed_uids": "VMSANDBOX_OPENSHELL_ALLOWED_UIDS",
    "fmpm": "VMSANDBOX_FMPM",
    "fm_unix_socket": "VMSANDBOX_FM_UNIX_SOCKET",
    "fm_hostname": "VMSANDBOX_FM_HOSTNAME",
    "fabric_manager": "VMSANDBOX_FABRIC_MANAGER",
    "fm_version": "VMSANDBOX_FM_VERSION",
    "fabric_manager_config": "VMSANDBOX_FABRIC_MANAGER_CONFIG",
    "probe_qemu": "VMSANDBOX_PROBE_QEMU",
    "gpu_firmware": "VMSANDBOX_GPU_FIRMWARE",
}
_PATHS = ("state_dir", "image_dir", "ovmf_code", "ovmf_vars", "fabric_manager_config")


@dataclass(frozen=True)
class Config:
    """Where vmsandbox keeps things, how it talks to libvirt, and what one sandbox may take."""

    uri: str = "qemu:///system"
    state_dir: Path = Path("/var/lib/vmsandbox")
    image_dir: Path | None = None  # default: <state_dir>/images
    virt_type: str = "auto"  # "auto" | "kvm" | "qemu"
    # The QEMU that ``auto`` boots to see whether KVM runs guests (vmsandbox/virt.py).
    probe_qemu: str = virt.QEMU
    # "user": QEMU user-mode network, guest port 22 forwarded to 127.0.0.1:<free port>.
    # Any other value names a libvirt network; the guest address comes from its DHCP lease.
    network: str = "user"
    # With "user" networking: whether the guest may open connections to the outside world.
    guest_outbound: bool = False
    ssh_user: str = "sandbox"
    boot_timeout: float = 300.0  # seconds for a guest without GPUs to answer SSH
    max_cpus: int = 8
    max_memory_mib: int = 65536
    max_disk_gib: int = 256
    max_gpus: int = 16
    # Pin vCPUs to the host CPUs of the GPUs' NUMA node when a sandbox has GPUs.
    numa_pinning: bool = True
    # Firmware of GPU sandboxes: "uefi" (OVMF, which maps large 64-bit BARs), "bios"
    # (SeaBIOS), or "auto": SeaBIOS for GPUs whose BARs are all small (passthrough.firmware).
    gpu_firmware: str = "auto"
    ovmf_code: Path = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
    ovmf_vars: Path = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
    # `vmsandbox serve`: uids besides the server's own that may use the OpenShell driver socket.
    openshell_allowed_uids: tuple[int, ...] = ()
    # The OpenShell supervisor (openshell-sandbox binary) every driver-made sandbox runs, the
    # gateway endpoint it dials (on this host's loopback) and, for https, the TLS files it gets.
    openshell_supervisor: str = ""
    openshell_gateway_endpoint: str = ""
    openshell_tls_ca: str = ""
    openshell_tls_cert: str = ""
    openshell_tls_key: str = ""
    # The driver's resource admission policy, set as the gateway's block for this driver is
    # (vmsandbox/openshell/admission.py): whether callers may send template.driver_config,
    # whether attached resources need approval labels, and which (None: the gateway's default).
    openshell_allow_driver_config: bool = False
    openshell_resource_admission: bool = True
    openshell_required_labels: tuple[tuple[str, str], ...] | None = None
    # NVSwitch boards (vmsandbox.fabric). Fabric Manager's config, read for FABRIC_MODE:
    fabric_manager_config: Path = Path("/usr/share/nvidia/nvswitch/fabricmanager.cfg")
    # fmpm (NVIDIA/Fabric-Manager-Client): a path, or a name looked up on PATH; and the FM
    # instance it talks to: a unix socket (FM_CMD_UNIX_SOCKET_PATH) or a host name or address
    # (FM_CMD_BIND_INTERFACE), at most one; neither is fmpm's default, 127.0.0.1.
    fmpm: str = "fmpm"
    fm_unix_socket: str = ""
    fm_hostname: str = ""
    # Where FM's release is read (``nv-fabricmanager --version``), unless fm_version gives it
    # (FM in a service VM): the guest's NVIDIA driver must be that release.
    fabric_manager: str = "nv-fabricmanager"
    fm_version: str = ""
    # The warm pool's shapes, from the ``[pool]`` table (pool.py says how entries name them).
    pool: tuple[PoolShape, ...] = ()

    @property
    def images(self) -> Path:
        return self.image_dir or self.state_dir / "images"

    @property
    def disks(self) -> Path:
        """Overlays and seeds: readable by the hypervisor's user, so kept apart from keys."""
        return self.state_dir / "disks"

    @property
    def sandboxes(self) -> Path:
        """Per-sandbox keys, pinned host keys and console logs (owner only)."""
        return self.state_dir / "sandboxes"

    @property
    def lock_path(self) -> Path:
        return self.state_dir / "host.lock"

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, **overrides: Any) -> Config:
        """Defaults < config file < environment < keyword overrides."""
        values: dict[str, Any] = {}
        file = Path(path or os.environ.get("VMSANDBOX_CONFIG", DEFAULT_CONFIG_FILE))
        if file.is_file():
            try:
                with file.open("rb") as handle:
                    values.update(tomllib.load(handle))
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise InvalidArgument(f"config file {file} cannot be read: {exc}") from exc
        for key, env in _ENV.items():
            if env in os.environ:
                values[key] = os.environ[env]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return _coerce(cls(), values, file)


def _uids(raw: Any) -> tuple[int, ...]:
    """A list of uids: a TOML list of integers, or a comma-separated string (environment)."""
    items = raw if isinstance(raw, list) else [part for part in str(raw).split(",") if part]
    uids = tuple(int(item) for item in items)
    if any(uid < 0 for uid in uids):
        raise ValueError(f"uids are not negative, got {list(uids)}")
    return uids


def _labels(raw: Any) -> tuple[tuple[str, str], ...]:
    """A table of label keys to values, all strings (a TOML table), as sorted pairs."""
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise ValueError("expected a table of label names to string values")
    return tuple(sorted(raw.items()))


def _coerce(base: Config, values: dict[str, Any], source: Path) -> Config:
    known = {f.name: f for f in fields(Config)}
    changes: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in known:
            raise InvalidArgument(
                f"unknown config key {key!r} (from {source} or the environment); "
                f"known keys: {', '.join(sorted(known))}"
            )
        default = getattr(base, key)
        try:
            if key == "pool":
                changes[key] = parse_table(raw)
                continue
            if key == "openshell_required_labels":
                changes[key] = _labels(raw)
                continue
            if isinstance(default, tuple):
                value = _uids(raw)
            elif isinstance(default, bool):
                value: Any = (
                    raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
                )
            elif isinstance(default, int):
                value = int(raw)
            elif isinstance(default, float):
                value = float(raw)
            elif key in _PATHS:
                value = Path(raw)
            else:
                value = str(raw)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"config key {key!r} has a bad value {raw!r}: {exc}") from exc
        changes[key] = value
    config = replace(base, **changes)
    if config.virt_type not in ("auto", "kvm", "qemu"):
        raise InvalidArgument(
            f"config virt_type {config.virt_type!r} is not one of auto, kvm, qemu"
        )
    if config.gpu_firmware not in GPU_FIRMWARE:
        raise InvalidArgument(
            f"config gpu_firmware {config.gpu_firmware!r} is not one of {', '.join(GPU_FIRMWARE)}",
            details={"field": "gpu_firmware", "value": config.gpu_firmware},
        )
    for shape in config.pool:
        for what, value, cap in (
            ("gpus", shape.gpus, config.max_gpus),
            ("cpus", shape.cpus, config.max_cpus),
            ("memory_mib", shape.memory_mib, config.max_memory_mib),
            ("disk_gib", shape.disk_gib, config.max_disk_gib),
        ):
            if value > cap:
                raise InvalidArgument(
                    f"config pool.{shape.key}.{what} {value} is over this host's cap of {cap} "
                    "per sandbox",
                    details={"field": f"pool.{shape.key}.{what}", "value": value, "max": cap},
                )
    if config.fm_unix_socket and config.fm_hostname:
        raise InvalidArgument(
            f"config sets both fm_unix_socket {config.fm_unix_socket!r} and fm_hostname "
            f"{config.fm_hostname!r}; fmpm reaches Fabric Manager through one: keep one of them",
            details={"field": "fm_hostname", "value": config.fm_hostname},
        )
    return config
