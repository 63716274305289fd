"""Operator configuration: defaults, then a TOML file, then environment variables.

File: ``$VMSANDBOX_CONFIG`` or ``/etc/vmsandbox/config.toml`` (optional). Environment variables
override single keys: ``VMSANDBOX_URI``, ``VMSANDBOX_STATE_DIR``, ``VMSANDBOX_IMAGE_DIR``,
``VMSANDBOX_VIRT_TYPE``, ``VMSANDBOX_NETWORK``, ``VMSANDBOX_BOOT_TIMEOUT``,
``VMSANDBOX_PROBE_QEMU``, ``VMSANDBOX_GPU_FIRMWARE``, ``VMSANDBOX_OPENSHELL_ALLOWED_UIDS``
(comma-separated), ``VMSANDBOX_GUEST_OUTBOUND``, ``VMSANDBOX_REQUIRE_GPU_RESET``,
``VMSANDBOX_LOCK_TIMEOUT``, the GPU custody keys ``VMSANDBOX_GPU_SANITIZE``,
``VMSANDBOX_GPU_SCRUB_HOOK``, ``VMSANDBOX_REQUIRE_GPU_MEMORY_CLEAR``, and for NVSwitch
boards ``VMSANDBOX_FMPM``, ``VMSANDBOX_FMPM_TIMEOUT``, ``VMSANDBOX_FM_UNIX_SOCKET``,
``VMSANDBOX_FM_HOSTNAME``, ``VMSANDBOX_FABRIC_MANAGER``, ``VMSANDBOX_FM_VERSION``,
``VMSANDBOX_FABRIC_MANAGER_CONFIG``.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from vmsandbox.errors import InvalidArgument
from vmsandbox.validate import positive_int, validate_image_name

DEFAULT_CONFIG_FILE = "/etc/vmsandbox/config.toml"
# The size of a sandbox whose request names none (``SandboxSpec``'s, and a ``[pool]`` entry's).
DEFAULT_CPUS = 1
DEFAULT_MEMORY_MIB = 1024
DEFAULT_DISK_GIB = 4
# The QEMU that virt type ``auto`` boots to see whether KVM runs guests (``probe_qemu``).
QEMU = "/usr/bin/qemu-system-x86_64"
GPU_FIRMWARE = ("auto", "uefi", "bios")

_ENV = {
    "uri": "VMSANDBOX_URI",
    "state_dir": "VMSANDBOX_STATE_DIR",
    "image_dir": "VMSANDBOX_IMAGE_DIR",
    "virt_type": "VMSANDBOX_VIRT_TYPE",
    "network": "VMSANDBOX_NETWORK",
    "boot_timeout": "VMSANDBOX_BOOT_TIMEOUT",
    "openshell_allowed_uids": "VMSANDBOX_OPENSHELL_ALLOWED_UIDS",
    "guest_outbound": "VMSANDBOX_GUEST_OUTBOUND",
    "require_gpu_reset": "VMSANDBOX_REQUIRE_GPU_RESET",
    "lock_timeout": "VMSANDBOX_LOCK_TIMEOUT",
    "gpu_sanitize": "VMSANDBOX_GPU_SANITIZE",
    "gpu_scrub_hook": "VMSANDBOX_GPU_SCRUB_HOOK",
    "require_gpu_memory_clear": "VMSANDBOX_REQUIRE_GPU_MEMORY_CLEAR",
    "fmpm": "VMSANDBOX_FMPM",
    "fmpm_timeout": "VMSANDBOX_FMPM_TIMEOUT",
    "fm_unix_socket": "VMSANDBOX_FM_UNIX_SOCKET",
    "fm_hostname": "VMSANDBOX_FM_HOSTNAME",
    "fabric_manager": "VMSANDBOX_FABRIC_MANAGER",
    "fm_version": "VMSANDBOX_FM_VERSION",
    "fabric_manager_config": "VMSANDBOX_FABRIC_MANAGER_CONFIG",
    "probe_qemu": "VMSANDBOX_PROBE_QEMU",
    "gpu_firmware": "VMSANDBOX_GPU_FIRMWARE",
}
_POOL_KEYS = ("image", "cpus", "memory_mib", "disk_gib", "count", "gpus")
_PATHS = (
    "state_dir",
    "image_dir",
    "ovmf_code",
    "ovmf_vars",
    "fabric_manager_config",
    "pci_sysfs",
)


@dataclass(frozen=True)
class Config:
    """Where vmsandbox keeps things, how it talks to libvirt, and what one sandbox may take."""

    uri: str = "qemu:///system"
    state_dir: Path = Path("/var/lib/vmsandbox")
    image_dir: Path | None = None  # default: <state_dir>/images
    virt_type: str = "auto"  # "auto" | "kvm" | "qemu"
    # The QEMU that ``auto`` boots to see whether KVM runs guests (vmsandbox/vm/virt.py).
    probe_qemu: str = QEMU
    # "user": QEMU user-mode network, guest port 22 forwarded to 127.0.0.1:<free port>.
    # Any other value names a libvirt network; the guest address comes from its DHCP lease.
    network: str = "user"
    # With "user" networking: whether the guest may open connections to the outside world
    # (never to this host's own addresses: vm/netguard.py).
    guest_outbound: bool = False
    ssh_user: str = "sandbox"
    boot_timeout: float = 300.0  # seconds for a guest without GPUs to answer SSH
    max_cpus: int = 8
    max_memory_mib: int = 65536
    max_disk_gib: int = 256
    max_gpus: int = 16
    # Pin vCPUs to the host CPUs of the GPUs' NUMA node when a sandbox has GPUs.
    numa_pinning: bool = True
    # Refuse GPUs the kernel cannot reset (host/discover.py): the next tenant could read the
    # last one's GPU memory. Off only where GPU memory is cleared by other means.
    require_gpu_reset: bool = True
    # GPU custody between tenants (vmsandbox/gpu/custody): every released GPU is reset,
    # checked and cleared before it is free again. Off only to show that the canary test can
    # fail (bench/gpu_handoff.py): a released GPU is then free at once, as it is.
    gpu_sanitize: bool = True
    # A command run with a released GPU's BDF that clears its memory (exit 0: done), for GPUs
    # whose memory no hardware clear vmsandbox knows empties (all but NVIDIA Turing and later).
    gpu_scrub_hook: str = ""
    gpu_scrub_timeout: float = 600.0
    # Refuse to free a GPU whose memory nothing cleared (no hardware clear, no scrub hook).
    require_gpu_memory_clear: bool = True
    gpu_reset_timeout: float = 30.0  # seconds for a reset, and for the GPU to answer after it
    # The health monitor (vmsandbox serve, vmsandbox gpus watch): seconds between its looks
    # at the host (config space, power state, AER in the kernel log, paused domains), and
    # between its looks into running GPU guests' kernel logs for Xid errors.
    gpu_health_interval: float = 1.0
    gpu_xid_interval: float = 30.0
    # Where the kernel lists the host's PCI functions; custody resets and reads GPUs there.
    # The unit tests point it at a tree of plain files, so they never touch a real device.
    pci_sysfs: Path = Path("/sys/bus/pci/devices")
    # Seconds a call waits for its turn at the host lock (vmsandbox/lock.py) before it fails
    # with DEADLINE_EXCEEDED naming the holder.
    lock_timeout: float = 60.0
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
    # NVSwitch boards (vmsandbox.gpu.fabric). Fabric Manager's config, read for FABRIC_MODE:
    fabric_manager_config: Path = Path("/usr/share/nvidia/nvswitch/fabricmanager.cfg")
    # fmpm (NVIDIA/Fabric-Manager-Client): a path, or a name looked up on PATH; and the FM
    # instance it talks to: a unix socket (FM_CMD_UNIX_SOCKET_PATH) or a host name or address
    # (FM_CMD_BIND_INTERFACE), at most one; neither is fmpm's default, 127.0.0.1.
    fmpm: str = "fmpm"
    fmpm_timeout: float = 120.0  # seconds one fmpm command may take (activation trains NVLinks)
    fm_unix_socket: str = ""
    fm_hostname: str = ""
    # Where FM's release is read (``nv-fabricmanager --version``), unless fm_version gives it
    # (FM in a service VM): the guest's NVIDIA driver must be that release.
    fabric_manager: str = "nv-fabricmanager"
    fm_version: str = ""
    # The warm pool's shapes, from the ``[pool]`` table (sandbox/pool/shapes.py: how entries
    # name them).
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
        value: Any
        try:
            if key == "pool":
                changes[key] = parse_pool(raw)
                continue
            if key == "openshell_required_labels":
                changes[key] = _labels(raw)
                continue
            if isinstance(default, tuple):
                value = _uids(raw)
            elif isinstance(default, bool):
                value = raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes")
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


@dataclass(frozen=True)
class PoolShape:
    """One ``[pool]`` entry: ``count`` guests of this image and size kept ready, booted with
    ``gpus`` spare GPU ports (vmsandbox/sandbox/pool/shapes.py says how entries name them and how
    a create claims a guest of a shape)."""

    key: str
    image: str
    cpus: int
    memory_mib: int
    disk_gib: int
    count: int
    gpus: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "image": self.image,
            "cpus": self.cpus,
            "memory_mib": self.memory_mib,
            "disk_gib": self.disk_gib,
            "count": self.count,
            "gpus": self.gpus,
        }


def parse_pool(table: object) -> tuple[PoolShape, ...]:
    """The ``[pool]`` table as shapes; INVALID_ARGUMENT naming the entry's field otherwise."""
    if not isinstance(table, dict):
        raise InvalidArgument(
            f"config pool must be a table of shapes, got {table!r}",
            details={"field": "pool", "value": repr(table)},
        )
    shapes = [_shape(str(key), value) for key, value in table.items()]
    seen: dict[tuple[str, int, int, int], str] = {}
    for shape in shapes:
        size = (shape.image, shape.cpus, shape.memory_mib, shape.disk_gib)
        if size in seen:
            raise InvalidArgument(
                f"config pool.{shape.key} has the same shape as pool.{seen[size]}; "
                "give each shape one entry",
                details={"field": f"pool.{shape.key}", "value": repr(size)},
            )
        seen[size] = shape.key
    return tuple(shapes)


def _shape(key: str, value: object) -> PoolShape:
    field = f"pool.{key}"
    entry: dict[str, Any]
    if isinstance(value, int) and not isinstance(value, bool):
        entry = {"image": key, "count": value}
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(_POOL_KEYS))
        if unknown:
            raise InvalidArgument(
                f"config {field} has unknown keys {', '.join(unknown)}; "
                f"known: {', '.join(_POOL_KEYS)}",
                details={"field": f"{field}.{unknown[0]}", "value": repr(value[unknown[0]])},
            )
        entry = {"image": key, **value}
    else:
        raise InvalidArgument(
            f"config {field} must be a count (a whole number) or a table of "
            f"{', '.join(_POOL_KEYS)}, got {value!r}",
            details={"field": field, "value": repr(value)},
        )
    count = _whole(entry.get("count", 1), f"{field}.count", "guests")
    gpus = _whole(entry.get("gpus", 0), f"{field}.gpus", "spare GPU ports")
    try:  # the checks, in the order, of a SandboxSpec of this size
        image = validate_image_name(entry["image"])
        cpus = positive_int(entry.get("cpus", DEFAULT_CPUS), "cpus")
        memory_mib = positive_int(entry.get("memory_mib", DEFAULT_MEMORY_MIB), "memory_mib")
        disk_gib = positive_int(entry.get("disk_gib", DEFAULT_DISK_GIB), "disk_gib")
    except InvalidArgument as exc:
        inner = exc.details.get("field", "")
        raise InvalidArgument(
            f"config {field}: {exc.message}",
            details={**exc.details, "field": f"{field}.{inner}" if inner else field},
        ) from exc
    return PoolShape(key, image, cpus, memory_mib, disk_gib, count, gpus)


def _whole(value: object, field: str, what: str) -> int:
    """``value`` as a count of ``what``, 0 or more; INVALID_ARGUMENT naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(
            f"config {field} must be a whole number of {what}, 0 or more, got {value!r}",
            details={"field": field, "value": repr(value)},
        )
    return value
