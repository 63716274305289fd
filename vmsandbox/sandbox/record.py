"""What vmsandbox remembers of a sandbox, and where its files are.

The record rides in the domain's ``<metadata>`` as JSON (libvirt is the only database). It is
typed here, with a schema version, so every reader sees the same fields with the same defaults:
records written before versions existed (version 1, no ``version`` key) still read. The lifecycle
state is kept beside the record (an attribute of the metadata element), not in it.

``SandboxFiles`` is the one place that knows which host files a sandbox has and where.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.sandbox.suspension import Suspension
from vmsandbox.validate import validate_name
from vmsandbox.vm.domain import DOMAIN_PREFIX
from vmsandbox.vm.process import ProcessIdentity

if TYPE_CHECKING:
    from vmsandbox.config import Config

# 3: ``failure`` and ``starter`` (stop/start and readiness of the OpenShell driver).
# 4: ``guest``, the pooled guest a sandbox was claimed from (state ``pooled``, pool/shapes.py).
# 5: ``credential``, the salted digest of a secret the guest holds (credential.py).
# 6: ``hotplug``, the spare root ports of a GPU-ready pooled guest (gpu/hotplug.py).
# 7: ``generation``, the runtime generation the OpenShell gateway last started it with.
# 8: ``owner``, who asked for it through the OpenShell driver (openshell/caller.py).
# 9: ``boot_seconds``, how long its last boot took to answer SSH (shown by ``show``).
# 10: ``expires_at``, the end of a sandbox's lifetime (``create --ttl``; lifetime.py).
# 11: ``suspended``, what a suspended sandbox needs to come back (suspension.py).
SCHEMA_VERSION = 11

STATE_CREATING = "creating"  # being made; reconcile removes it once its creator is gone
STATE_DEFINED = "defined"  # defined on purpose without starting (create(start=False))
STATE_STARTED = "started"  # started without waiting for SSH (create(wait=False))
STATE_READY = "ready"  # SSH accepted its key (and the GPUs were verified when asked)
STATE_POOLED = "pooled"  # a booted guest of the warm pool, not claimed yet (pool/shapes.py)
STATE_STARTING = "starting"  # started by power.start; ready once wait() saw SSH (and the GPUs)
STATE_FAILED = "failed"  # started, but the guest did not come up; ``failure`` says why
STATE_STOPPED = "stopped"  # never stored: what a sandbox whose domain does not run shows
STATE_SUSPENDING = "suspending"  # a suspend is at work: GPUs let go, memory being saved
STATE_SUSPENDED = "suspended"  # its memory is saved to disk: no QEMU, no GPU held (suspend.py)
STATE_RESUMING = "resuming"  # a resume is at work: memory restored, GPUs taken and attached
STATE_PARKED = "parked"  # a pooled guest of a ``park`` shape, its memory saved to disk
# What each state means, as ``vmsandbox show`` prints it beside the state (docs/usage.md has
# the same table, with the transitions between them).
STATE_MEANINGS = {
    STATE_CREATING: "a create, pool fill or claim is making it",
    STATE_DEFINED: "defined, never started; 'vmsandbox start' starts it",
    STATE_STARTING: "started by a call that is waiting for SSH to answer",
    STATE_STARTED: (
        "its guest runs, but no call has seen SSH answer yet (--no-wait); "
        "'vmsandbox start' waits for it"
    ),
    STATE_READY: "SSH answered with the pinned host key; its GPUs, if any, passed their checks",
    STATE_FAILED: (
        "its guest runs, but the last wait for it failed (see failure); "
        "'vmsandbox start' waits again"
    ),
    STATE_STOPPED: "its guest does not run; disk and GPUs kept; 'vmsandbox start' starts it",
    STATE_POOLED: "a warm-pool guest that no create has claimed yet",
    STATE_SUSPENDING: "a suspend is letting its GPUs go and saving its memory",
    STATE_SUSPENDED: (
        "its memory is saved to disk; no memory or GPU held; 'vmsandbox resume' brings it back"
    ),
    STATE_RESUMING: "a resume is restoring its memory and taking GPUs for it",
    STATE_PARKED: "a warm-pool guest saved to disk; a claim restores it",
}

# libvirt writes each QEMU domain's own log here (qemu:///system); destroy removes it too.
LIBVIRT_QEMU_LOG_DIR = Path("/var/log/libvirt/qemu")
# The console logs of failed creates kept in <state_dir>/failed/ (the newest ones).
KEPT_CONSOLE_LOGS = 20


@dataclass(frozen=True)
class HotplugRecord:
    """The spare root ports a GPU-ready pooled guest booted with (gpu/hotplug.py): their controller
    indexes in port order (a hostdev attached to port ``i`` names ``buses[i]`` as its bus), and
    the guest's firmware (a hostdev under SeaBIOS goes without its option ROM)."""

    buses: tuple[int, ...]
    firmware: str

    def to_dict(self) -> dict[str, Any]:
        return {"buses": list(self.buses), "firmware": self.firmware}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HotplugRecord:
        return cls(
            buses=tuple(int(bus) for bus in data.get("buses", ())),
            firmware=str(data.get("firmware", "bios")),
        )


@dataclass(frozen=True)
class SshRecord:
    """Where the guest's sshd is reached: a forwarded loopback port, or its DHCP address."""

    host: str
    port: int | None  # None: a libvirt-network guest whose lease is not known yet
    user: str


@dataclass(frozen=True)
class SandboxRecord:
    """One sandbox as stored in its domain's metadata."""

    name: str
    image: str
    image_id: str | None
    cpus: int
    memory_mib: int
    disk_gib: int
    virt_type: str
    network: str
    ssh: SshRecord
    mac: str
    keys: str  # the keys folder: tells which state directory made the sandbox
    host_key_alias: str
    created_at: str
    creator: ProcessIdentity | None = None
    labels: dict[str, str] = field(default_factory=dict)
    gpus: tuple[GpuRecord, ...] = ()
    # NVSwitch boards: the Fabric Manager partition that connects the GPUs (shared NVSwitch
    # mode), or the NVSwitches passed along with all the GPUs (full passthrough), by BDF.
    fabric_partition: int | None = None
    switches: tuple[str, ...] = ()
    verification: dict[str, Any] | None = None
    # State failed: why the guest did not come up ({code, message} of the error wait() raised).
    failure: dict[str, str] | None = None
    # State starting: the process that started it; while it lives the sandbox shows starting.
    starter: ProcessIdentity | None = None
    # The pooled guest this sandbox was claimed from: its domain and files keep that guest's
    # name (libvirt cannot rename a running domain). None: domain and files carry ``name``.
    guest: str | None = None
    # The salted digest of a secret the guest holds (the OpenShell sandbox token), by which
    # the driver's AuthenticateSandbox recognises the sandbox; never the secret itself.
    credential: str | None = None
    # A GPU-ready pooled guest's spare root ports (a claim attaches GPUs to them).
    hotplug: HotplugRecord | None = None
    # The OpenShell gateway's generation id of the last StartSandbox that started this sandbox
    # (part of its runtime identity, vmsandbox/openshell/identity.py); None: never restarted so.
    generation: str | None = None
    # Who asked for it through the OpenShell driver: the calling gateway's identity
    # (openshell/caller.py: its uid, and the gateway a trusted delegate named), which every
    # driver RPC is scoped to. None: not made through the driver, or made before owners were
    # recorded (the driver then reads an owner from its labels, openshell/caller.py).
    owner: str | None = None
    # Seconds its last boot took until SSH answered (create or start); None: not waited for.
    boot_seconds: float | None = None
    # When the sandbox's lifetime ends (UTC, ``%Y-%m-%dT%H:%M:%SZ``): ``vmsandbox reap``
    # destroys it from then on. None: it lives until destroyed.
    expires_at: str | None = None
    # Suspended (or being suspended or resumed): the GPUs to take again and where they go;
    # its GPUs (``gpus``) are those held now. None: not suspended.
    suspended: Suspension | None = None
    version: int = SCHEMA_VERSION

    @property
    def stem(self) -> str:
        """The name the domain and the host files carry."""
        return self.guest or self.name

    @property
    def domain(self) -> str:
        return DOMAIN_PREFIX + self.stem

    @property
    def on_fabric(self) -> bool:
        """Whether the guest's GPUs talk over NVLink through NVSwitches: a partition of more
        than one GPU, or the whole board with its NVSwitches."""
        return bool(self.switches) or (self.fabric_partition is not None and len(self.gpus) > 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "name": self.name,
            "image": self.image,
            "image_id": self.image_id,
            "cpus": self.cpus,
            "memory_mib": self.memory_mib,
            "disk_gib": self.disk_gib,
            "virt_type": self.virt_type,
            "network": self.network,
            "ssh": asdict(self.ssh),
            "mac": self.mac,
            "keys": self.keys,
            "host_key_alias": self.host_key_alias,
            "created_at": self.created_at,
            "creator": self.creator.to_dict() if self.creator else None,
            "labels": dict(self.labels),
            "gpus": [gpu.to_dict() for gpu in self.gpus],
            "fabric_partition": self.fabric_partition,
            "switches": list(self.switches),
            "verification": self.verification,
            "failure": dict(self.failure) if self.failure else None,
            "starter": self.starter.to_dict() if self.starter else None,
            "guest": self.guest,
            "credential": self.credential,
            "hotplug": self.hotplug.to_dict() if self.hotplug else None,
            "generation": self.generation,
            "owner": self.owner,
            "boot_seconds": self.boot_seconds,
            "expires_at": self.expires_at,
            "suspended": self.suspended.to_dict() if self.suspended else None,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SandboxRecord:
        """Read a stored record; version 1 (no ``version`` key) fills what it lacked, and so do
        records from before NVSwitch fabrics (no ``fabric_partition``, no ``switches``),
        version 2 (no ``failure``, no ``starter``), version 3 (no ``guest``) and version 4 (no
        ``credential``), version 5 (no ``hotplug``), version 6 (no ``generation``), version 7
        (no ``owner``), version 8 (no ``boot_seconds``), version 9 (no ``expires_at``: no
        lifetime) and version 10 (no ``suspended``: never suspended).

        FAILED_PRECONDITION for a record of a newer vmsandbox: guessing at fields it added could
        remove or misreport a sandbox.
        """
        version = int(data.get("version", 1))
        name = str(data["name"])
        if version > SCHEMA_VERSION:
            raise FailedPrecondition(
                f"sandbox {name!r} was recorded by a newer vmsandbox (record version {version}, "
                f"this one reads up to {SCHEMA_VERSION}); use that version to manage it"
            )
        ssh = data.get("ssh") or {}
        port = ssh.get("port")
        creator = data.get("creator")
        starter = data.get("starter")
        failure = data.get("failure")
        hotplug = data.get("hotplug")
        suspended = data.get("suspended")
        return cls(
            name=name,
            image=str(data.get("image", "?")),
            image_id=data.get("image_id"),
            cpus=int(data.get("cpus", 0)),
            memory_mib=int(data.get("memory_mib", 0)),
            disk_gib=int(data.get("disk_gib", 0)),
            virt_type=str(data.get("virt_type", "?")),
            network=str(data.get("network", "user")),
            ssh=SshRecord(
                host=str(ssh.get("host", "127.0.0.1")),
                port=int(port) if port else None,
                user=str(ssh.get("user", "sandbox")),
            ),
            mac=str(data.get("mac", "")),
            keys=str(data.get("keys", "")),
            host_key_alias=str(data.get("host_key_alias", DOMAIN_PREFIX + name)),
            created_at=str(data.get("created_at", "")),
            creator=ProcessIdentity.from_dict(creator) if isinstance(creator, dict) else None,
            labels={str(k): str(v) for k, v in (data.get("labels") or {}).items()},
            gpus=tuple(GpuRecord.from_dict(gpu) for gpu in data.get("gpus") or ()),
            fabric_partition=_optional_int(data.get("fabric_partition")),
            switches=tuple(str(bdf) for bdf in data.get("switches") or ()),
            verification=data.get("verification"),
            failure=(
                {str(k): str(v) for k, v in failure.items()} if isinstance(failure, dict) else None
            ),
            starter=ProcessIdentity.from_dict(starter) if isinstance(starter, dict) else None,
            guest=str(data["guest"]) if data.get("guest") else None,
            credential=str(data["credential"]) if data.get("credential") else None,
            hotplug=HotplugRecord.from_dict(hotplug) if isinstance(hotplug, dict) else None,
            generation=str(data["generation"]) if data.get("generation") else None,
            owner=str(data["owner"]) if data.get("owner") else None,
            boot_seconds=_optional_float(data.get("boot_seconds")),
            expires_at=str(data["expires_at"]) if data.get("expires_at") else None,
            suspended=Suspension.from_dict(suspended) if isinstance(suspended, dict) else None,
            version=SCHEMA_VERSION,
        )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class SandboxFiles:
    """The host files of one sandbox. Disks are readable by the hypervisor; keys by root only;
    libvirt's own QEMU log of the domain is removed with the rest."""

    name: str
    overlay: Path
    seed: Path
    nvram: Path
    keys_dir: Path
    console_log: Path
    qemu_log: Path | None  # None where libvirt keeps it elsewhere (not qemu:///system)

    @classmethod
    def of(cls, config: Config, name: str) -> SandboxFiles:
        system = config.uri.split("?", 1)[0] in ("qemu:///system", "qemu+unix:///system")
        return cls(
            name=name,
            overlay=config.disks / f"{name}.qcow2",
            seed=config.disks / f"{name}-seed.iso",
            nvram=config.disks / f"{name}-vars.fd",
            keys_dir=config.sandboxes / name,
            console_log=config.sandboxes / f"{name}.console.log",
            qemu_log=LIBVIRT_QEMU_LOG_DIR / f"{DOMAIN_PREFIX}{name}.log" if system else None,
        )

    @property
    def control(self) -> Path:
        """The host end of the guest's control channel (made by QEMU, removed by libvirt when
        the domain stops; inside the keys folder, so it goes with it)."""
        return self.keys_dir / "control.sock"

    def keys(self, host_alias: str | None = None) -> SandboxKeys:
        """The sandbox's SSH keys (client key, pinned host key) in its keys folder."""
        return SandboxKeys(self.keys_dir, host_alias or DOMAIN_PREFIX + self.name)

    def files(self) -> list[Path]:
        found = [self.overlay, self.seed, self.nvram, self.console_log, self.keys_dir]
        partials = [path.with_name(path.name + ".partial") for path in (self.overlay, self.seed)]
        return found + partials + ([self.qemu_log] if self.qemu_log else [])

    def existing(self) -> list[Path]:
        return [path for path in self.files() if path.exists() or path.is_symlink()]

    def remove(self) -> None:
        """Delete every file; FAILED_PRECONDITION naming what could not be deleted."""
        failed: list[str] = []
        for path in self.existing():
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError as exc:
                failed.append(f"{path} ({exc.strerror or exc})")
        if failed:
            raise FailedPrecondition(
                f"sandbox {self.name!r}: files could not be removed: {', '.join(failed)}",
                details={"remaining": [str(path) for path in self.existing()]},
            )


def keep_console_log(config: Config, files: SandboxFiles) -> Path | None:
    """A copy of the console log of a create that failed, made before its undos remove the
    sandbox's files: ``<state_dir>/failed/NAME-TIME.console.log`` (0600: the boot's lines are
    the user's to read, not everyone's), the newest KEPT_CONSOLE_LOGS kept. None when there
    is no log to keep or it cannot be copied (the create's own error matters more)."""
    try:
        if not files.console_log.is_file() or files.console_log.stat().st_size == 0:
            return None
        folder = config.state_dir / "failed"
        folder.mkdir(mode=0o700, exist_ok=True)
        when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        kept = folder / f"{files.name}-{when}.console.log"
        shutil.copyfile(files.console_log, kept)
        os.chmod(kept, 0o600)
        logs = sorted(folder.glob("*.console.log"), key=lambda path: path.stat().st_mtime)
        for old in logs[:-KEPT_CONSOLE_LOGS]:
            old.unlink(missing_ok=True)
    except OSError:
        return None
    return kept


def names_domain(data: dict[str, Any], domain: str) -> bool:
    """A stored record is ours only if it names, with valid names, the domain it is stored in
    (by its pooled guest's name when it has one, else by its own): those names become file
    paths, so a name that is not a sandbox name must never reach them."""
    name, guest = data.get("name"), data.get("guest")
    try:
        validate_name(name)
        if guest is not None:
            validate_name(guest, "guest")
    except InvalidArgument:
        return False
    return domain == DOMAIN_PREFIX + str(guest or name)


def prepare_state_dirs(config: Config) -> None:
    """Make the state directory: disks readable by the hypervisor's user, keys by root only."""
    try:
        for path, mode in (
            (config.state_dir, 0o711),
            (config.disks, 0o711),
            (config.sandboxes, 0o700),
        ):
            path.mkdir(parents=path == config.state_dir, exist_ok=True)
            os.chmod(path, mode)
    except OSError as exc:
        raise FailedPrecondition(
            f"state directory {config.state_dir} cannot be prepared: {exc.strerror} "
            f"({exc.filename or config.state_dir})"
        ) from exc
