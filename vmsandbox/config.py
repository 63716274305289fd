"""Operator configuration: defaults, then a TOML file, then environment variables.

File: ``$VMSANDBOX_CONFIG`` or ``/etc/vmsandbox/config.toml`` (optional). Environment variables
override single keys: ``VMSANDBOX_URI``, ``VMSANDBOX_STATE_DIR``, ``VMSANDBOX_IMAGE_DIR``,
``VMSANDBOX_VIRT_TYPE``, ``VMSANDBOX_NETWORK``, ``VMSANDBOX_BOOT_TIMEOUT``,
``VMSANDBOX_PROBE_QEMU``, ``VMSANDBOX_GPU_FIRMWARE``, ``VMSANDBOX_OPENSHELL_ALLOWED_UIDS`` and
``VMSANDBOX_OPENSHELL_DELEGATE_UIDS`` (comma-separated), ``VMSANDBOX_GUEST_OUTBOUND``,
``VMSANDBOX_GUEST_BLOCKED_NETWORKS`` (comma-separated), ``VMSANDBOX_REQUIRE_GPU_RESET``,
``VMSANDBOX_LOCK_TIMEOUT``, and for NVSwitch boards ``VMSANDBOX_FMPM``,
``VMSANDBOX_FMPM_TIMEOUT``, ``VMSANDBOX_FM_UNIX_SOCKET``, ``VMSANDBOX_FM_HOSTNAME``,
``VMSANDBOX_FABRIC_MANAGER``, ``VMSANDBOX_FM_VERSION``, ``VMSANDBOX_FABRIC_MANAGER_CONFIG``.

Every value is typed, whatever its source, and a value that is not of its key's type is
INVALID_ARGUMENT naming the key, the value and what is allowed, never read as some default: an
on/off setting is a TOML boolean (``true``/``false``) or, in the environment, one of
``ENV_BOOLEANS``; a count is a whole number (``max_gpus`` may be 0, the other caps at least 1);
seconds are a finite number above 0. Unknown keys, and ``[pool]`` shapes whose image is neither
a recipe nor in the image store, are refused at load.
"""

from __future__ import annotations

import ipaddress
import math
import os
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from vmsandbox.errors import InvalidArgument
from vmsandbox.resources import RECIPES
from vmsandbox.validate import positive_int, validate_image_name

DEFAULT_CONFIG_FILE = "/etc/vmsandbox/config.toml"
# The size of a sandbox whose request names none (``SandboxSpec``'s, and a ``[pool]`` entry's).
DEFAULT_CPUS = 1
DEFAULT_MEMORY_MIB = 1024
DEFAULT_DISK_GIB = 4
# The QEMU that virt type ``auto`` boots to see whether KVM runs guests (``probe_qemu``).
QEMU = "/usr/bin/qemu-system-x86_64"
GPU_FIRMWARE = ("auto", "uefi", "bios")
VIRT_TYPES = ("auto", "kvm", "qemu")
# The words an on/off setting takes in the environment (any case); TOML takes true and false.
ENV_BOOLEANS = {
    **{word: True for word in ("true", "yes", "on", "1")},
    **{word: False for word in ("false", "no", "off", "0")},
}
# Counts that may be 0 (the other whole-number keys are caps of at least 1).
_ZERO_ALLOWED = ("max_gpus",)

_ENV = {
    "uri": "VMSANDBOX_URI",
    "state_dir": "VMSANDBOX_STATE_DIR",
    "image_dir": "VMSANDBOX_IMAGE_DIR",
    "virt_type": "VMSANDBOX_VIRT_TYPE",
    "network": "VMSANDBOX_NETWORK",
    "boot_timeout": "VMSANDBOX_BOOT_TIMEOUT",
    "openshell_allowed_uids": "VMSANDBOX_OPENSHELL_ALLOWED_UIDS",
    "openshell_delegate_uids": "VMSANDBOX_OPENSHELL_DELEGATE_UIDS",
    "guest_outbound": "VMSANDBOX_GUEST_OUTBOUND",
    "guest_blocked_networks": "VMSANDBOX_GUEST_BLOCKED_NETWORKS",
    "require_gpu_reset": "VMSANDBOX_REQUIRE_GPU_RESET",
    "lock_timeout": "VMSANDBOX_LOCK_TIMEOUT",
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
_POOL_KEYS = ("image", "cpus", "memory_mib", "disk_gib", "count", "gpus", "park")
_PATHS = ("state_dir", "image_dir", "ovmf_code", "ovmf_vars", "fabric_manager_config", "pci_sysfs")
# What guests with outbound network never reach by default (vm/netguard.py): the private
# ranges (RFC 1918), shared address space (RFC 6598: carrier NAT, overlay networks such as
# Tailscale's), link-local (cloud metadata services at 169.254.169.254) and IPv6 unique-local
# and link-local, where a fleet's Ray head and nodes, metrics and Fabric Manager live.
BLOCKED_NETWORKS = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "fc00::/7",
    "fe80::/10",
)
_CHOICES = {"virt_type": VIRT_TYPES, "gpu_firmware": GPU_FIRMWARE}


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
    # (never to this host's own addresses, nor to ``guest_blocked_networks``: vm/netguard.py).
    guest_outbound: bool = False
    # Networks (CIDR) such guests must not reach either: the fleet's and the site's own.
    guest_blocked_networks: tuple[str, ...] = BLOCKED_NETWORKS
    ssh_user: str = "sandbox"
    boot_timeout: float = 300.0  # seconds for a guest without GPUs to answer SSH
    max_cpus: int = 8
    max_memory_mib: int = 65536
    max_disk_gib: int = 256
    max_gpus: int = 16
    max_saved_gib: int = 64  # GiB that all suspended sandboxes' saved memory may take
    # Pin vCPUs to the host CPUs of the GPUs' NUMA node when a sandbox has GPUs.
    numa_pinning: bool = True
    # Refuse GPUs the kernel cannot reset (host/discover.py): the next tenant could read the
    # last one's GPU memory. Off only where GPU memory is cleared by other means.
    require_gpu_reset: bool = True
    gpu_sanitize: bool = True  # GPU custody (gpu/custody): off only to show the canary fail
    gpu_scrub_hook: str = ""  # a command that clears a released GPU's memory, given its BDF
    require_gpu_memory_clear: bool = True  # refuse to free a GPU whose memory nothing cleared
    gpu_health_interval: float = 1.0  # seconds between the health monitor's looks at the GPUs
    pci_sysfs: Path = Path("/sys/bus/pci/devices")  # the unit tests': a tree of plain files
    # Seconds a call waits for the host lock (vmsandbox/lock.py): then DEADLINE_EXCEEDED.
    lock_timeout: float = 60.0
    # Firmware of GPU sandboxes: "uefi" (OVMF, which maps large 64-bit BARs), "bios"
    # (SeaBIOS), or "auto": SeaBIOS for GPUs whose BARs are all small (passthrough.firmware).
    gpu_firmware: str = "auto"
    ovmf_code: Path = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
    ovmf_vars: Path = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
    # `vmsandbox serve`: uids besides the server's own that may use the OpenShell driver
    # socket, each one gateway (openshell/caller.py: a gateway sees and acts on its own only).
    openshell_allowed_uids: tuple[int, ...] = ()
    # uids trusted to speak for gateways they name in each call (a fleet agent), each named
    # gateway an owner of its own; they may use the socket too.
    openshell_delegate_uids: tuple[int, ...] = ()
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
    openshell_stop_suspends: bool = False  # StopSandbox suspends, StartSandbox then resumes
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
    # The warm pool's shapes, from ``[pool]`` (sandbox/pool/shapes.py: how entries name them).
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
        """Defaults < config file < environment < keyword overrides, each value checked for
        its key's type and range (INVALID_ARGUMENT naming the key, the value, where it came
        from and what is allowed)."""
        values: dict[str, tuple[Any, str]] = {}  # key -> (value, where it was set)
        file = Path(path or os.environ.get("VMSANDBOX_CONFIG", DEFAULT_CONFIG_FILE))
        if file.is_file():
            try:
                with file.open("rb") as handle:
                    values.update((k, (v, str(file))) for k, v in tomllib.load(handle).items())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise InvalidArgument(f"config file {file} cannot be read: {exc}") from exc
        for key, env in _ENV.items():
            if env in os.environ:
                values[key] = (os.environ[env], f"${env}")
        values.update((k, (v, "the caller")) for k, v in overrides.items() if v is not None)
        return _coerce(cls(), values)


def _refuse(key: str, raw: object, where: str, allowed: str) -> InvalidArgument:
    """The error for a value of ``key`` (set in ``where``) that is not ``allowed``."""
    return InvalidArgument(
        f"config key {key!r} (set in {where}) has the value {raw!r}; allowed: {allowed}",
        details={"field": key, "value": repr(raw), "allowed": allowed, "source": where},
    )


def _typed(key: str, raw: Any, where: str, default: Any) -> Any:
    """``raw`` as a value of ``key``'s type (the type of its ``default``). The environment
    gives text; a TOML file and Python callers give typed values, which must be of the type."""
    text = where.startswith("$")  # an environment variable
    if isinstance(default, bool):
        if isinstance(raw, bool):
            return raw
        if text and str(raw).strip().lower() in ENV_BOOLEANS:
            return ENV_BOOLEANS[str(raw).strip().lower()]
        words = "/".join(ENV_BOOLEANS)
        raise _refuse(key, raw, where, f"{words} (any case)" if text else "true or false")
    if isinstance(default, tuple):
        return _uids(key, raw, where)
    if isinstance(default, int):
        least = 0 if key in _ZERO_ALLOWED else 1
        number = raw if text is False else (int(raw) if _digits(raw) else None)
        if isinstance(number, bool) or not isinstance(number, int) or number < least:
            raise _refuse(key, raw, where, f"a whole number of at least {least}")
        return number
    if isinstance(default, float):
        number = raw
        if text:
            try:
                number = float(raw)
            except ValueError:
                number = None
        if isinstance(number, bool) or not isinstance(number, int | float):
            number = math.nan
        if not math.isfinite(number) or number <= 0:
            raise _refuse(key, raw, where, "a number of seconds above 0")
        return float(number)
    if key in _PATHS:
        if not isinstance(raw, str | Path) or not str(raw):
            raise _refuse(key, raw, where, "a path")
        return Path(raw)
    if not isinstance(raw, str):
        raise _refuse(key, raw, where, "a string")
    if key in _CHOICES and raw not in _CHOICES[key]:
        raise _refuse(key, raw, where, f"one of {', '.join(_CHOICES[key])}")
    return raw


def _digits(text: object) -> bool:
    return isinstance(text, str) and text.isascii() and text.isdecimal()


def _uids(key: str, raw: Any, where: str) -> tuple[int, ...]:
    """A list of uids: a TOML list of whole numbers, or comma-separated ones (environment)."""
    items = raw if isinstance(raw, list | tuple) else None
    if isinstance(raw, str) and where.startswith("$"):
        items = [int(p) if _digits(p.strip()) else p for p in raw.split(",") if p.strip()]
    if items is None or not all(
        isinstance(uid, int) and not isinstance(uid, bool) and uid >= 0 for uid in items
    ):
        raise _refuse(key, raw, where, "a list of uids (whole numbers, 0 or more)")
    return tuple(items)


def _networks(key: str, raw: Any, where: str) -> tuple[str, ...]:
    """A list of networks in CIDR notation (a TOML list, or comma-separated ones in the
    environment), each written as its network (host bits cleared)."""
    items = raw if isinstance(raw, list | tuple) else None
    if isinstance(raw, str) and where.startswith("$"):
        items = [part for part in raw.split(",") if part.strip()]
    allowed = "a list of networks in CIDR notation, such as 10.0.0.0/8 or fc00::/7"
    if items is None or not all(isinstance(item, str) for item in items):
        raise _refuse(key, raw, where, allowed)
    try:
        return tuple(str(ipaddress.ip_network(item.strip(), strict=False)) for item in items)
    except ValueError as exc:
        raise _refuse(key, raw, where, allowed) from exc


def _labels(raw: Any, where: str) -> tuple[tuple[str, str], ...]:
    """A table of label keys to values, all strings (a TOML table), as sorted pairs."""
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
    ):
        raise _refuse(
            "openshell_required_labels", raw, where, "a table of label names to string values"
        )
    return tuple(sorted(raw.items()))


def _coerce(base: Config, values: dict[str, tuple[Any, str]]) -> Config:
    known = sorted(f.name for f in fields(Config))
    changes: dict[str, Any] = {}
    for key, (raw, where) in values.items():
        if key not in known:
            raise InvalidArgument(
                f"unknown config key {key!r} (set in {where}); known keys: {', '.join(known)}",
                details={"field": key, "value": repr(raw), "source": where},
            )
        if key == "pool":
            changes[key] = parse_pool(raw)
        elif key == "openshell_required_labels":
            changes[key] = _labels(raw, where)
        elif key == "guest_blocked_networks":
            changes[key] = _networks(key, raw, where)
        else:
            changes[key] = _typed(key, raw, where, getattr(base, key))
    config = replace(base, **changes)
    for shape in config.pool:
        _check_shape(config, shape)
    if config.fm_unix_socket and config.fm_hostname:
        raise InvalidArgument(
            f"config sets both fm_unix_socket {config.fm_unix_socket!r} and fm_hostname "
            f"{config.fm_hostname!r}; fmpm reaches Fabric Manager through one: keep one of them",
            details={"field": "fm_hostname", "value": config.fm_hostname},
        )
    return config


def _check_shape(config: Config, shape: PoolShape) -> None:
    """A ``[pool]`` shape within the caps per sandbox, of an image that is a recipe or in the
    store: a typo (``mnimal = 1``) is refused here, not when ``pool fill`` gets to it."""
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
    recipes = sorted(p.parent.name for p in RECIPES.glob("*/recipe.toml"))
    try:
        stored = sorted(p.name for p in config.images.iterdir() if p.is_dir())
    except OSError:  # no image store yet (or none this user may read)
        stored = []
    if shape.image not in recipes and shape.image not in stored:
        field = f"pool.{shape.key}" if shape.image == shape.key else f"pool.{shape.key}.image"
        raise InvalidArgument(
            f"config {field} names image {shape.image!r}, which is neither a recipe "
            f"({', '.join(recipes) or 'none'}) nor an image in {config.images} "
            f"({', '.join(stored) or 'none'})",
            details={"field": field, "value": shape.image, "allowed": [*recipes, *stored]},
        )


@dataclass(frozen=True)
class PoolShape:
    """One ``[pool]`` entry: ``count`` guests of this image and size kept ready, booted with
    ``gpus`` spare GPU ports, and with ``park`` saved to disk while they wait
    (vmsandbox/sandbox/pool/shapes.py says how entries name them and how a create claims a guest
    of a shape)."""

    key: str
    image: str
    cpus: int
    memory_mib: int
    disk_gib: int
    count: int
    gpus: int = 0
    park: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
    park = _typed(f"{field}.park", entry.get("park", False), "the [pool] table", False)
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
    return PoolShape(key, image, cpus, memory_mib, disk_gib, count, gpus, park)


def _whole(value: object, field: str, what: str) -> int:
    """``value`` as a count of ``what``, 0 or more; INVALID_ARGUMENT naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(
            f"config {field} must be a whole number of {what}, 0 or more, got {value!r}",
            details={"field": field, "value": repr(value)},
        )
    return value
