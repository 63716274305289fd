"""SandboxManager: the path of one sandbox, from request to a running, reachable VM, and back.

It orchestrates and nothing else: specs (spec.py), images (images.py), keys and seed (keys.py,
seed.py), domain XML (domain.py), GPUs (host/, allocator.py, passthrough.py) and the guest
(guest.py) each live in their own module. libvirt is the source of truth: every sandbox is a
persistent domain named ``vmsbx-<name>`` whose metadata holds its record.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import re
import shlex
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import libvirt

from vmsandbox import domain as domain_xml
from vmsandbox import guest, virt
from vmsandbox.config import Config
from vmsandbox.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    VmSandboxError,
)
from vmsandbox.hypervisor import is_alive, libvirt_errors, open_connection
from vmsandbox.images import KERNEL_CMDLINE, BaseImage, ImageStore, make_overlay
from vmsandbox.keys import SandboxKeys
from vmsandbox.lock import host_lock
from vmsandbox.progress import Progress, silent
from vmsandbox.seed import network_config, write_seed
from vmsandbox.spec import SandboxSpec, generate_name, validate_name

if TYPE_CHECKING:  # importing vmsandbox.host loads pyudev: only GPU paths pay for it
    from vmsandbox.host.model import Gpu, Inventory

STATE_CREATING = "creating"
STATE_READY = "ready"
STATE_DEFINED = "defined"  # defined on purpose without starting (create(start=False))


@dataclass
class Sandbox:
    """A sandbox as a caller sees it."""

    name: str
    domain: str
    state: str  # ready | creating | running | shut off | ...
    image: str
    cpus: int
    memory_mib: int
    disk_gib: int
    virt_type: str
    ssh: guest.Endpoint | None
    key_file: Path
    known_hosts: Path
    host_key_alias: str
    created_at: str
    gpus: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    verification: dict[str, Any] | None = None
    boot_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "domain": self.domain,
            "state": self.state,
            "image": self.image,
            "cpus": self.cpus,
            "memory_mib": self.memory_mib,
            "disk_gib": self.disk_gib,
            "virt_type": self.virt_type,
            "ssh": (
                {"host": self.ssh.host, "port": self.ssh.port, "user": self.ssh.user}
                if self.ssh
                else None
            ),
            "key_file": str(self.key_file),
            "known_hosts": str(self.known_hosts),
            "host_key_alias": self.host_key_alias,
            "created_at": self.created_at,
            "gpus": self.gpus,
            "labels": self.labels,
            "verification": self.verification,
            "boot_seconds": self.boot_seconds,
        }


@dataclass
class SandboxPaths:
    """The files of one sandbox. Disks are readable by the hypervisor; keys by root only."""

    overlay: Path
    seed: Path
    keys: Path
    console_log: Path
    nvram: Path

    @classmethod
    def of(cls, config: Config, name: str) -> SandboxPaths:
        return cls(
            overlay=config.disks / f"{name}.qcow2",
            seed=config.disks / f"{name}-seed.iso",
            nvram=config.disks / f"{name}-vars.fd",
            keys=config.sandboxes / name,
            console_log=config.sandboxes / f"{name}.console.log",
        )

    def files(self) -> list[Path]:
        return [self.overlay, self.seed, self.nvram, self.console_log, self.keys]

    def existing(self) -> list[Path]:
        return [path for path in self.files() if path.exists() or path.is_symlink()]

    def remove(self) -> None:
        for path in self.files():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for path in (self.overlay, self.seed):
            path.with_name(path.name + ".partial").unlink(missing_ok=True)


class SandboxManager:
    """Create, find, use and destroy sandboxes on one libvirt host."""

    def __init__(
        self, config: Config | None = None, *, progress: Progress = silent, reconcile: bool = True
    ) -> None:
        self.config = config or Config.load()
        self.progress = progress
        self._conn: libvirt.virConnect | None = None
        self.images = ImageStore(self.config.images)
        self._prepare_dirs()
        if reconcile:
            self.reconcile()

    # -- plumbing -----------------------------------------------------------------------------

    @property
    def conn(self) -> libvirt.virConnect:
        if not is_alive(self._conn):
            self._conn = open_connection(self.config.uri)
        assert self._conn is not None
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self._conn.close()
            self._conn = None

    def __enter__(self) -> SandboxManager:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _prepare_dirs(self) -> None:
        cfg = self.config
        try:
            cfg.state_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(cfg.state_dir, 0o711)
            cfg.disks.mkdir(exist_ok=True)
            os.chmod(cfg.disks, 0o711)
            cfg.sandboxes.mkdir(exist_ok=True)
            os.chmod(cfg.sandboxes, 0o700)
        except OSError as exc:
            raise FailedPrecondition(
                f"state directory {cfg.state_dir} cannot be prepared: {exc.strerror} "
                f"({exc.filename or cfg.state_dir})"
            ) from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with host_lock(self.config.lock_path):
            yield

    def _domains(self) -> list[tuple[libvirt.virDomain, dict[str, Any], str]]:
        """Our domains with their record and recorded state."""
        found = []
        with libvirt_errors("listing domains"):
            domains = self.conn.listAllDomains(0)
        for dom in domains:
            if not dom.name().startswith(domain_xml.DOMAIN_PREFIX):
                continue
            try:
                parsed = domain_xml.read_metadata(dom.XMLDesc(0))
            except libvirt.libvirtError:
                continue  # vanished while we looked
            if parsed is not None and _names_domain(parsed[0], dom.name()):
                found.append((dom, *parsed))
        return found

    def _lookup(self, name: str) -> tuple[libvirt.virDomain, dict[str, Any], str] | None:
        try:
            dom = self.conn.lookupByName(domain_xml.DOMAIN_PREFIX + name)
            parsed = domain_xml.read_metadata(dom.XMLDesc(0))
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_DOMAIN:
                return None
            with libvirt_errors(f"looking up sandbox {name!r}"):
                raise
            raise  # unreachable: libvirt_errors always raises
        if parsed is None or not _names_domain(parsed[0], dom.name()):
            raise FailedPrecondition(
                f"domain {dom.name()!r} exists but was not made by vmsandbox; not touching it"
            )
        return dom, *parsed

    # -- create -------------------------------------------------------------------------------

    def check_caps(self, spec: SandboxSpec) -> None:
        cfg = self.config
        for what, value, cap in (
            ("cpus", spec.cpus, cfg.max_cpus),
            ("memory_mib", spec.memory_mib, cfg.max_memory_mib),
            ("disk_gib", spec.disk_gib, cfg.max_disk_gib),
        ):
            if value > cap:
                raise InvalidArgument(
                    f"{what} {value} is over this host's cap of {cap} per sandbox",
                    details={"field": what, "value": value, "max": cap},
                )

    def create(
        self,
        spec: SandboxSpec,
        *,
        wait: bool = True,
        start: bool = True,
        verify: bool = True,
        keep_on_failure: bool = False,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> Sandbox:
        """Create and start a sandbox; with ``wait``, return once SSH accepts its key.

        ``start=False`` only defines it (GPUs held, state ``defined``); destroy removes it.
        With ``verify`` (and ``wait``), the GPUs are checked from inside the guest; a failed check
        raises GuestVerificationFailed and removes the sandbox unless ``keep_on_failure``.

        Any failure removes everything this call made (domain, overlay, seed, keys) before the
        error propagates, which also frees the GPUs it had chosen.
        """
        say = progress or self.progress
        _check_timeout(timeout)
        self.check_caps(spec)
        image = self.images.get(spec.image)
        self._check_disk(spec, image)
        name = spec.name or generate_name()
        virt_type = self._virt_type(spec, image, say)
        paths = SandboxPaths.of(self.config, name)
        dom: libvirt.virDomain | None = None
        reserved = False
        try:
            with self._locked():
                _checkpoint("locked")
                if self._lookup(name) is not None:
                    raise AlreadyExists(f"sandbox {name!r} already exists", details={"name": name})
                reserved = True
                dom = self._define(spec, name, image, virt_type, paths, say)
                _checkpoint("defined")
            if not start:
                self._set_state(dom, STATE_DEFINED)
                return self._sandbox(dom, *self._read(dom))
            say(f"starting {dom.name()} ({virt_type})")
            with libvirt_errors(f"starting sandbox {name!r}"):
                dom.create()
            _checkpoint("started")
            sandbox = self._sandbox(dom, *self._read(dom))
            if wait:
                if timeout is None:
                    from vmsandbox.verify import boot_timeout

                    timeout = boot_timeout(
                        self.config.boot_timeout, spec.memory_mib, len(sandbox.gpus)
                    )
                sandbox.boot_seconds = self._wait_ssh(dom, sandbox, paths, timeout, say)
                if verify:
                    say("verifying the guest's devices")
                    sandbox.verification = self._verify(dom, sandbox)
            self._set_state(dom, STATE_READY, verification=sandbox.verification)
            sandbox.state = STATE_READY
            if sandbox.verification is not None and not sandbox.verification["ok"]:
                from vmsandbox.verify import VerificationReport, raise_if_failed

                if keep_on_failure:
                    reserved = False  # the caller asked to keep it for inspection
                raise_if_failed(
                    VerificationReport.from_dict(sandbox.verification),
                    subject=f"sandbox {name!r}",
                    details={"kept": keep_on_failure},
                )
            say(f"sandbox {name} is ready")
            return sandbox
        except BaseException:
            if reserved:
                self._remove(name, dom, paths)
            raise

    def verify(self, name: str) -> dict[str, Any]:
        """Re-run the in-guest GPU verification of a running sandbox; the report is stored."""
        sandbox = self.get(name)
        found = self._lookup(name)
        assert found is not None
        report = self._verify(found[0], sandbox)
        self._set_state(found[0], found[2], verification=report)
        return report

    def _verify(self, dom: libvirt.virDomain, sandbox: Sandbox) -> dict[str, Any]:
        from vmsandbox import verify

        if sandbox.ssh is None:
            raise FailedPrecondition(f"sandbox {sandbox.name!r} has no SSH endpoint yet")
        run = functools.partial(guest.run, sandbox.ssh, self.keys_of(sandbox))
        expected = [verify.ExpectedGpu.from_record(gpu) for gpu in sandbox.gpus]
        return verify.verify(run, expected).to_dict()

    def dry_run(self, spec: SandboxSpec) -> tuple[str, list[Gpu]]:
        """The domain XML and GPUs that ``create`` would use now; defines and writes nothing.

        Needs no built image: an image that is not built yet is shown at the path it will have.
        """
        self.check_caps(spec)
        name = spec.name or generate_name()
        try:
            image: BaseImage | None = self.images.get(spec.image)
        except NotFound:
            image = None
        virt_type = self.config.virt_type if spec.virt_type == "auto" else spec.virt_type
        if virt_type == "auto":
            cache = self.config.state_dir / "virt-probe.json"
            virt_type = virt.cached(cache=cache, qemu=self.config.probe_qemu) or "qemu"
        with self._locked():
            gpus = self._choose_gpus(spec)
            port = self._free_port() if self.config.network == "user" else None
        plan = self._plan(
            spec, name, image, virt_type, SandboxPaths.of(self.config, name), port, gpus, record={}
        )
        return domain_xml.build_domain_xml(plan), gpus

    def _check_disk(self, spec: SandboxSpec, image: BaseImage) -> None:
        if spec.disk_gib * 2**30 < image.virtual_size:
            raise InvalidArgument(
                f"disk_gib {spec.disk_gib} is smaller than image {image.name!r} "
                f"({image.virtual_size / 2**30:.1f} GiB)",
                details={"field": "disk_gib", "value": spec.disk_gib},
            )

    def _virt_type(self, spec: SandboxSpec, image: BaseImage, say: Progress) -> str:
        requested = spec.virt_type if spec.virt_type != "auto" else self.config.virt_type
        cache = self.config.state_dir / "virt-probe.json"
        qemu = self.config.probe_qemu
        if requested == "auto" and virt.cached(cache=cache, qemu=qemu) is None:
            say("probing whether KVM runs guests on this host (once, then cached)")
        return virt.resolve(requested, cache=cache, kernel=image.kernel, qemu=qemu)

    def _choose_gpus(self, spec: SandboxSpec) -> list[Gpu]:
        """Under the host lock: the GPUs for ``spec``, free on every domain of the connection."""
        if spec.gpu is None:
            return []
        from vmsandbox import allocator

        return allocator.select(spec.gpu, self.gpus(), max_gpus=self.config.max_gpus)

    def gpus(self) -> Inventory:
        """The host's GPU inventory, with ``in_use_by`` read from all libvirt domains."""
        from vmsandbox.host import discover, libvirt_hostdev_holders

        with libvirt_errors("reading which domains hold PCI devices"):
            holders = libvirt_hostdev_holders(self.conn)
        return discover(in_use=holders)

    def _define(
        self,
        spec: SandboxSpec,
        name: str,
        image: BaseImage,
        virt_type: str,
        paths: SandboxPaths,
        say: Progress,
    ) -> libvirt.virDomain:
        """Under the host lock, with the name free: choose GPUs, make the files, define."""
        gpus = self._choose_gpus(spec)
        if gpus:
            say("GPUs: " + ", ".join(f"{gpu.bdf} ({gpu.name or gpu.device_id})" for gpu in gpus))
        paths.remove()  # files without a domain are leftovers of a killed create
        alias = domain_xml.DOMAIN_PREFIX + name
        mac = "52:54:00:" + ":".join(f"{b:02x}" for b in os.urandom(3))
        with _host_files(f"writing the keys of sandbox {name!r} to {paths.keys}"):
            keys, client, host = SandboxKeys.create(paths.keys, alias)
        say(f"creating overlay on {image.name} ({image.id}), {spec.disk_gib} GiB")
        make_overlay(image.disk, paths.overlay, spec.disk_gib)
        _checkpoint("overlay")
        with _host_files(f"writing the seed of sandbox {name!r} to {paths.seed}"):
            write_seed(
                paths.seed,
                instance_id=str(uuid.uuid4()),
                hostname=name,
                user=self.config.ssh_user,
                client=client,
                host=host,
                network=network_config(mac, user_net=self.config.network == "user"),
                workdir=paths.keys,  # its files hold the host key: never outside the state dir
            )
        port = self._free_port() if self.config.network == "user" else None
        record = {
            "mac": mac,
            "keys": str(keys.folder),
            "host_key_alias": alias,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "creator": _process_identity(),
        }
        plan = self._plan(spec, name, image, virt_type, paths, port, gpus, record)
        xml = domain_xml.build_domain_xml(plan)
        with libvirt_errors(f"defining sandbox {name!r}"):
            return self.conn.defineXML(xml)

    def _plan(
        self,
        spec: SandboxSpec,
        name: str,
        image: BaseImage | None,
        virt_type: str,
        paths: SandboxPaths,
        port: int | None,
        gpus: list[Gpu],
        record: dict[str, Any],
    ) -> domain_xml.DomainPlan:
        """The DomainPlan of a sandbox (``image`` None: where an unbuilt image will be)."""
        cfg = self.config
        image_dir = image.path if image else cfg.images / spec.image / "current"
        kernel = image.kernel if image else image_dir / "vmlinuz"
        record = {
            **record,
            "name": name,
            "image": spec.image,
            "image_id": image.id if image else None,
            "cpus": spec.cpus,
            "memory_mib": spec.memory_mib,
            "disk_gib": spec.disk_gib,
            "virt_type": virt_type,
            "network": cfg.network,
            "ssh": {"host": "127.0.0.1", "port": port, "user": cfg.ssh_user},
            "labels": dict(spec.labels),
            "gpus": [_gpu_record(gpu) for gpu in gpus],
            "state": STATE_CREATING,
        }
        plan = domain_xml.DomainPlan(
            domain_name=domain_xml.DOMAIN_PREFIX + name,
            uuid=str(uuid.uuid4()),
            virt_type=virt_type,
            cpus=spec.cpus,
            memory_mib=spec.memory_mib,
            overlay=paths.overlay,
            seed=paths.seed,
            console_log=paths.console_log,
            record=record,
            kernel=kernel,
            initrd=(image.initrd if image else image_dir / "initrd.img"),
            cmdline=image.cmdline if image else KERNEL_CMDLINE,
            network=cfg.network,
            mac=record.get("mac", "52:54:00:00:00:01"),
            ssh_port=port,
            guest_outbound=cfg.guest_outbound,
        )
        if gpus:
            from vmsandbox import passthrough

            plan.uefi = True
            plan.nvram = paths.nvram
            plan.ovmf_code = cfg.ovmf_code
            plan.ovmf_vars = cfg.ovmf_vars
            extra = passthrough.plan(
                gpus,
                host_cpus=passthrough.host_cpus_by_node(),
                vcpus=spec.cpus,
                memory_mib=spec.memory_mib,
                virt_type=virt_type,
                pin=cfg.numa_pinning,
            )
            plan.extra.append(functools.partial(passthrough.apply, plan=extra))
        return plan

    def _free_port(self) -> int:
        """A loopback port no sandbox of ours forwards and nothing listens on right now."""
        taken = {rec.get("ssh", {}).get("port") for _dom, rec, _state in self._domains()}
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            if port not in taken:
                return port
        raise VmSandboxError("no free loopback port found for SSH forwarding")

    def _wait_ssh(
        self,
        dom: libvirt.virDomain,
        sandbox: Sandbox,
        paths: SandboxPaths,
        timeout: float | None,
        say: Progress,
    ) -> float:
        limit = timeout if timeout is not None else self.config.boot_timeout
        endpoint = self._endpoint(dom, sandbox, limit)
        keys = SandboxKeys(paths.keys, sandbox.host_key_alias)

        def running() -> bool:
            try:
                return dom.isActive() == 1
            except libvirt.libvirtError:
                return False

        _checkpoint("waiting")
        try:
            waited = guest.wait_ready(
                endpoint,
                keys,
                timeout=limit,
                progress=say,
                still_running=running,
                stage=lambda: _console_stage(paths.console_log),
            )
        except DeadlineExceeded as exc:
            tail = _tail(paths.console_log, 30)
            raise DeadlineExceeded(
                f"sandbox {sandbox.name!r}: {exc.message}\n--- guest console (last lines) ---\n"
                f"{tail or '(console log is empty)'}",
                details={"console_tail": tail},
            ) from exc
        sandbox.ssh = endpoint
        say(f"SSH is up after {waited:.1f}s")
        return round(waited, 2)

    def _endpoint(self, dom: libvirt.virDomain, sandbox: Sandbox, timeout: float) -> guest.Endpoint:
        if sandbox.ssh is not None and sandbox.ssh.port:
            return sandbox.ssh
        deadline = time.monotonic() + timeout
        user = self.config.ssh_user
        while time.monotonic() < deadline:
            with contextlib.suppress(libvirt.libvirtError):
                addrs = dom.interfaceAddresses(libvirt.VIR_DOMAIN_INTERFACE_ADDRESSES_SRC_LEASE)
                for iface in addrs.values():
                    for addr in iface.get("addrs") or []:
                        if addr.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4:
                            return guest.Endpoint(addr["addr"], 22, user)
            time.sleep(0.5)
        raise DeadlineExceeded(f"sandbox {sandbox.name!r} got no DHCP lease within {timeout:.0f}s")

    def _set_state(self, dom: libvirt.virDomain, state: str, **updates: Any) -> None:
        record, _old = self._read(dom)
        record.update(updates)
        with libvirt_errors("updating sandbox metadata"):
            dom.setMetadata(
                libvirt.VIR_DOMAIN_METADATA_ELEMENT,
                domain_xml.metadata_xml(record, state),
                domain_xml.METADATA_KEY,
                domain_xml.METADATA_NS,
                libvirt.VIR_DOMAIN_AFFECT_CONFIG
                | (libvirt.VIR_DOMAIN_AFFECT_LIVE if dom.isActive() else 0),
            )

    def _read(self, dom: libvirt.virDomain) -> tuple[dict[str, Any], str]:
        with libvirt_errors("reading sandbox metadata"):
            parsed = domain_xml.read_metadata(dom.XMLDesc(0))
        if parsed is None:
            raise FailedPrecondition(f"domain {dom.name()!r} has no vmsandbox metadata")
        return parsed

    # -- read ---------------------------------------------------------------------------------

    def _sandbox(self, dom: libvirt.virDomain, record: dict[str, Any], state: str) -> Sandbox:
        ssh = record.get("ssh") or {}
        endpoint = (
            guest.Endpoint(ssh["host"], int(ssh["port"]), ssh["user"]) if ssh.get("port") else None
        )
        name = record["name"]
        paths = SandboxPaths.of(self.config, name)
        try:
            active = dom.isActive() == 1
        except libvirt.libvirtError:
            active = False
        shown = state if active or state in (STATE_CREATING, STATE_DEFINED) else "stopped"
        return Sandbox(
            name=name,
            domain=dom.name(),
            state=shown,
            image=record.get("image", "?"),
            cpus=int(record.get("cpus", 0)),
            memory_mib=int(record.get("memory_mib", 0)),
            disk_gib=int(record.get("disk_gib", 0)),
            virt_type=record.get("virt_type", "?"),
            ssh=endpoint,
            key_file=paths.keys / "id_ed25519",
            known_hosts=paths.keys / "known_hosts",
            host_key_alias=record.get("host_key_alias", dom.name()),
            created_at=record.get("created_at", ""),
            gpus=list(record.get("gpus", [])),
            labels=dict(record.get("labels", {})),
            verification=record.get("verification"),
        )

    def get(self, name: str) -> Sandbox:
        validate_name(name)
        found = self._lookup(name)
        if found is None:
            raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
        return self._sandbox(*found)

    def list(self) -> list[Sandbox]:
        return sorted(
            (self._sandbox(dom, rec, state) for dom, rec, state in self._domains()),
            key=lambda sandbox: sandbox.name,
        )

    # -- use ----------------------------------------------------------------------------------

    def keys_of(self, sandbox: Sandbox) -> SandboxKeys:
        return SandboxKeys(self.config.sandboxes / sandbox.name, sandbox.host_key_alias)

    def exec(
        self,
        name: str,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
    ) -> guest.ExecResult:
        """Run a command in the sandbox: a list is quoted word by word; a string is a shell line."""
        sandbox = self.get(name)
        if sandbox.ssh is None:
            raise FailedPrecondition(f"sandbox {name!r} has no SSH endpoint yet")
        _check_timeout(timeout)
        if not isinstance(command, str):
            if not command:
                raise InvalidArgument("exec needs a command", details={"field": "command"})
            if not all(isinstance(word, str) for word in command):
                raise InvalidArgument("exec words must be strings", details={"field": "command"})
            command = shlex.join(command)
        if "\0" in command:
            raise InvalidArgument(
                "exec command contains a NUL byte, which no command line can carry",
                details={"field": "command"},
            )
        return guest.run(
            sandbox.ssh,
            self.keys_of(sandbox),
            command,
            timeout=timeout,
            stdout=stdout,
            stderr=stderr,
        )

    def ssh_argv(self, name: str, command: Sequence[str] = ()) -> list[str]:
        """The OpenSSH command line that logs into the sandbox with its pinned host key."""
        sandbox = self.get(name)
        if sandbox.ssh is None:
            raise FailedPrecondition(f"sandbox {name!r} has no SSH endpoint yet")
        keys = self.keys_of(sandbox)
        return [
            "ssh",
            "-i",
            str(keys.client_key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "IdentityAgent=none",
            "-o",
            f"UserKnownHostsFile={keys.known_hosts}",
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"HostKeyAlias={keys.host_alias}",
            "-o",
            "PasswordAuthentication=no",
            "-p",
            str(sandbox.ssh.port),
            "-l",
            sandbox.ssh.user,
            sandbox.ssh.host,
            *(["--", *command] if command else []),
        ]

    # -- destroy ------------------------------------------------------------------------------

    def destroy(self, name: str) -> None:
        """Stop and remove the sandbox: domain, NVRAM, overlay, seed, keys, console log.

        Idempotent in effect: whatever is left of the sandbox is removed; NOT_FOUND only when
        nothing of it existed.
        """
        validate_name(name)
        paths = SandboxPaths.of(self.config, name)
        found = self._lookup(name)
        if found is None:
            with self._locked():
                if self._lookup(name) is None and paths.existing():
                    paths.remove()
                    return
            raise NotFound(f"sandbox {name!r} does not exist", details={"name": name})
        self._remove(name, found[0], paths)

    def _remove(self, name: str, dom: libvirt.virDomain | None, paths: SandboxPaths) -> None:
        """Stop the domain, then under the host lock undefine it and delete its files, so a
        create of the same name in another process never sees a half-removed sandbox."""
        if dom is not None:
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
        with self._locked():
            self._remove_locked(name, dom, paths)

    def _remove_locked(self, name: str, dom: libvirt.virDomain | None, paths: SandboxPaths) -> None:
        if dom is not None:
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
            try:
                dom.undefineFlags(
                    libvirt.VIR_DOMAIN_UNDEFINE_NVRAM
                    | libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                    | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
                )
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != libvirt.VIR_ERR_NO_DOMAIN:
                    with libvirt_errors(f"removing sandbox {name!r}"):
                        raise
        paths.remove()

    # -- repair -------------------------------------------------------------------------------

    def reconcile(self) -> dict[str, list[str]]:
        """Finish removing half-made sandboxes of this state directory; never touches domains
        that are not ours (no vmsandbox record naming the domain, or made with another state
        directory).

        Half-made: a domain still marked creating whose creator process is gone; files with no
        domain; a stopped domain whose overlay, seed or keys are gone. A running domain whose
        files are gone is reported, not stopped. Returns what was removed and what could not
        be fixed.
        """
        removed: list[str] = []
        problems: list[str] = []
        with self._locked():
            domains = [found for found in self._domains() if self._is_local(found[1])]
            for dom, rec, state in domains:
                name = rec["name"]
                paths = SandboxPaths.of(self.config, name)
                creating = state == STATE_CREATING
                if creating and _process_alive(rec.get("creator")):
                    continue  # its creator is still at work
                missing = [
                    str(p) for p in (paths.overlay, paths.seed, paths.keys) if not p.exists()
                ]
                if not creating and not missing:
                    continue
                try:
                    running = dom.isActive() == 1
                except libvirt.libvirtError:
                    running = False
                if not creating and running:
                    problems.append(
                        f"{name}: running, but its files are gone ({', '.join(missing)}); "
                        f"remove it with 'vmsandbox destroy {name}'"
                    )
                    continue
                try:
                    self._remove_locked(name, dom, paths)
                    removed.append(name)
                except VmSandboxError as exc:
                    problems.append(f"{name}: {exc.message}")
            known = {rec["name"] for _dom, rec, _state in domains}
            for name in _names_on_disk(self.config) - known:
                SandboxPaths.of(self.config, name).remove()
                removed.append(name)
        return {"removed": sorted(set(removed)), "problems": problems}

    def _is_local(self, record: dict[str, Any]) -> bool:
        """Whether a sandbox was made with this state directory (its keys are kept here)."""
        return record.get("keys") == str(self.config.sandboxes / record["name"])


def _names_domain(record: dict[str, Any], domain: str) -> bool:
    """A record is ours only if it names, with a valid name, the domain it is stored in: its
    name becomes file paths, so a name that is not a sandbox name must never reach them."""
    name = record.get("name")
    try:
        validate_name(name)
    except InvalidArgument:
        return False
    return domain == domain_xml.DOMAIN_PREFIX + name


def _check_timeout(timeout: float | None) -> None:
    """A timeout is None (the default) or a finite number of seconds above 0 (NaN never
    expires: every comparison with it is false)."""
    if timeout is None:
        return
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise InvalidArgument(
            f"timeout must be a finite number of seconds above 0, got {timeout!r}",
            details={"field": "timeout", "value": repr(timeout)},
        )


@contextlib.contextmanager
def _host_files(doing: str) -> Iterator[None]:
    """Turn a failed write on the host into FAILED_PRECONDITION (RESOURCE_EXHAUSTED when the
    disk is full), naming what was being written."""
    try:
        yield
    except OSError as exc:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        raise (ResourceExhausted if full else FailedPrecondition)(
            f"{doing}: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""),
            details={"errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))},
        ) from exc


def _checkpoint(stage: str) -> None:
    """Crash-test seam: with ``VMSANDBOX_CRASH_AT=<stage>`` the create announces the stage on
    stderr and waits there to be killed (stages: locked, overlay, defined, started, waiting)."""
    if os.environ.get("VMSANDBOX_CRASH_AT") == stage:
        print(f"vmsandbox-checkpoint {stage}", file=sys.stderr, flush=True)
        time.sleep(3600)


def _gpu_record(gpu: Gpu) -> dict[str, Any]:
    """What a sandbox remembers of each of its GPUs (enough to verify them in the guest)."""
    return {
        "bdf": gpu.bdf,
        "vendor": gpu.vendor,
        "vendor_id": gpu.vendor_id,
        "device_id": gpu.device_id,
        "name": gpu.name,
        "memory_mib": gpu.memory_mib,
        "numa_node": gpu.numa_node,
        "companions": list(gpu.companions),
        "companion_ids": [list(pair) for pair in gpu.companion_ids],
    }


def _names_on_disk(config: Config) -> set[str]:
    names: set[str] = set()
    if config.disks.is_dir():
        for path in config.disks.iterdir():
            stem = path.name.split(".", 1)[0]
            names.add(stem.removesuffix("-seed").removesuffix("-vars"))
    if config.sandboxes.is_dir():
        for path in config.sandboxes.iterdir():
            names.add(path.name.split(".", 1)[0])
    valid = set()
    for name in names:
        with contextlib.suppress(InvalidArgument):
            valid.add(validate_name(name))
    return valid


def _process_identity() -> dict[str, Any]:
    return {"pid": os.getpid(), "start": _start_time(os.getpid()), "boot": _boot_id()}


def _process_alive(identity: dict[str, Any] | None) -> bool:
    if not identity:
        return False
    if identity.get("boot") != _boot_id():
        return False
    pid = identity.get("pid")
    return isinstance(pid, int) and _start_time(pid) == identity.get("start") is not None


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started, or None if it is gone or a zombie (killed, not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _tail(path: Path, lines: int) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 16384))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    text = _ANSI_RE.sub("", text)
    text = "".join(ch for ch in text if ch in "\n\t" or ch.isprintable())
    return "\n".join(text.splitlines()[-lines:])


# Escape sequences of the guest console (colours, cursor moves): never echoed to a terminal.
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


_STAGES = (
    ("Reached target multi-user", "multi-user target reached"),
    ("Starting ssh.service", "starting sshd"),
    ("cloud-init", "cloud-init running"),
    ("Reached target basic", "basic system up"),
    ("Run /init", "initramfs"),
    ("Linux version", "kernel booting"),
)


def _console_stage(path: Path) -> str | None:
    """A short phrase for how far the guest has got, read from its console log."""
    text = _tail(path, 80)
    if not text:
        return "firmware"
    for marker, phrase in _STAGES:
        if marker in text:
            return phrase
    return "booting"
