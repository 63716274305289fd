"""Launching the workload of a driver-made sandbox once its guest answers SSH, and what each
sandbox's launch waits for (``Launches``: its launch credentials, and why its last launch
failed).

A driver-made guest boots with its units (the main process, OPENSHELL_MAIN_UNIT, and the
supervisor) written but not started. When the guest is ready the driver runs one root script
in it over SSH (``launch``), on every boot, which:

1. resolves the workload identity in the guest: the user and group selectors the request
   named (``workload_identity``, else ``policy.process``), else the image's sandbox user, each
   a name or a number, looked up with ``getent``; a user or group that does not exist, or that
   resolves to uid or gid 0 (the primary group or a supplementary one), stops the launch;
2. writes the gateway's launch credentials, when there are fresh ones, to the guest's tmpfs:
   the supervisor's part (the ``supervisor`` bundle, bearer tokens inside) to AUTH_BUNDLE_PATH,
   0600 root, read by the supervisor and no workload; the public part (``gateway_id`` and
   ``verification_keys``) to VERIFICATION_PATH, 0644. They travel on SSH stdin (the bundle)
   or as public text, so they are never in a file on the host, on a command line or in the
   guest's disk: /run is memory, and a stopped guest loses them, which is why every
   StartSandbox brings fresh ones;
3. writes the resolved identity to IDENTITY_PATH (read back by the status query), then starts
   the units once per boot (LAUNCHED_PATH marks it); credentials that arrive for a guest
   already launched restart the supervisor, so it reads them.

The credentials are the JSON the gateway mints: ``{"supervisor": {...}, "gateway_id": "...",
"verification_keys": [{"key_id": "...", "public_key_pem": ...}]}``; the supervisor bundle is
passed on exactly as sent. Nothing here logs or repeats them.

Launch credentials wait in this process's memory until the guest is ready (``Launches``),
never on disk; a ``vmsandbox serve`` restarted meanwhile has lost them and the gateway's next
start brings fresh ones. A failed launch is kept, for the sandbox's snapshots (its Ready
condition), until the next start or a launch that succeeds.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import shlex
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vmsandbox.errors import FailedPrecondition, InvalidArgument, VmSandboxError
from vmsandbox.guest import ssh
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.vm.domain import DOMAIN_PREFIX

if TYPE_CHECKING:
    from vmsandbox.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)

RUN_DIR = "/run/openshell"
AUTH_BUNDLE_PATH = f"{RUN_DIR}/auth-bundle.json"
VERIFICATION_PATH = f"{RUN_DIR}/gateway-verification.json"
IDENTITY_PATH = f"{RUN_DIR}/workload-identity"
LAUNCHED_PATH = f"{RUN_DIR}/launched"
OPENSHELL_MAIN_UNIT = "openshell-main.service"
# Record labels a driver-made sandbox carries for its launch (set by request.translate).
USER_LABEL = "openshell.workload-user"
GROUP_LABEL = "openshell.workload-group"
SOURCE_LABEL = "openshell.workload-source"
UNITS_LABEL = "openshell.units"
RESTART_LABEL = "openshell.restart-on-credentials"
WORKLOAD_LABELS = (USER_LABEL, GROUP_LABEL, SOURCE_LABEL, UNITS_LABEL, RESTART_LABEL)
_SELECTOR = re.compile(r"(?:[0-9]{1,10}|[A-Za-z_][A-Za-z0-9_.-]{0,31})\Z")
_EXIT_NO_USER, _EXIT_NO_GROUP, _EXIT_ROOT = 3, 4, 5
_LAUNCH_TIMEOUT = 120.0  # seconds for the launch script in the guest


def check_selector(value: str, field_name: str) -> str:
    """A user or group selector: a name (letters, digits, '_', '.', '-', not starting with a
    digit or '-', at most 32) or a number; never root's (0 or ``root``)."""
    if not _SELECTOR.match(value):
        raise InvalidArgument(
            f"{field_name} {value!r} is not a user or group: give a name (letters, digits, "
            "'_', '.', '-', at most 32, not starting with a digit or '-') or a number",
            details={"field": field_name, "value": value},
        )
    if value == "root" or (value.isdigit() and int(value) == 0):
        raise InvalidArgument(
            f"{field_name} {value!r} is root: the workload never runs as uid or gid 0",
            details={"field": field_name, "value": value},
        )
    return value


@dataclass(frozen=True)
class LaunchCredentials:
    """The gateway's launch credentials, split: ``supervisor`` (secret) and ``verification``
    (public)."""

    supervisor: bytes = field(repr=False)
    verification: bytes
    runtime_generation: str | None = None

    @classmethod
    def parse(cls, data: bytes, field_name: str) -> LaunchCredentials:
        """INVALID_ARGUMENT naming ``field_name`` when ``data`` is not the gateway's launch
        credentials; the content is never repeated."""

        def bad(what: str) -> InvalidArgument:
            return InvalidArgument(
                f"{field_name} is not OpenShell launch credentials: {what}",
                details={"field": field_name},
            )

        try:
            wire = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise bad("not JSON") from None
        if not isinstance(wire, dict):
            raise bad("not a JSON object")
        supervisor = wire.get("supervisor")
        if not isinstance(supervisor, dict) or not supervisor:
            raise bad("no 'supervisor' object")
        gateway_id = wire.get("gateway_id")
        if not isinstance(gateway_id, str) or not gateway_id:
            raise bad("no 'gateway_id'")
        keys = wire.get("verification_keys")
        if not isinstance(keys, list) or not keys:
            raise bad("no 'verification_keys'")
        public = [_public_key(key, bad) for key in keys]
        generation = supervisor.get("runtime_generation")
        return cls(
            supervisor=json.dumps(supervisor, separators=(",", ":")).encode(),
            verification=json.dumps(
                {"gateway_id": gateway_id, "verification_keys": public}, separators=(",", ":")
            ).encode(),
            runtime_generation=str(generation) if isinstance(generation, str | int) else None,
        )


def _public_key(key: Any, bad: Callable[[str], InvalidArgument]) -> dict[str, str]:
    if not isinstance(key, dict) or not isinstance(key.get("key_id"), str):
        raise bad("a verification key without 'key_id'")
    pem = key.get("public_key_pem")
    if isinstance(pem, list) and all(isinstance(b, int) and 0 <= b < 256 for b in pem):
        pem = bytes(pem).decode(errors="replace")
    if not isinstance(pem, str) or not pem:
        raise bad(f"verification key {key['key_id']!r} has no 'public_key_pem'")
    return {"key_id": key["key_id"], "public_key_pem": pem}


@dataclass(frozen=True)
class Workload:
    """Who the workload runs as and which units a launch starts, from the record's labels."""

    user: str
    group: str = ""
    source: str = "image"
    units: tuple[str, ...] = ()
    restart_on_credentials: tuple[str, ...] = ()

    @classmethod
    def of(cls, labels: Mapping[str, str]) -> Workload | None:
        """The workload of a sandbox the driver made with launch labels; None otherwise."""
        if USER_LABEL not in labels:
            return None
        return cls(
            user=labels[USER_LABEL],
            group=labels.get(GROUP_LABEL, ""),
            source=labels.get(SOURCE_LABEL, "image"),
            units=tuple(u for u in labels.get(UNITS_LABEL, "").split(",") if u),
            restart_on_credentials=tuple(u for u in labels.get(RESTART_LABEL, "").split(",") if u),
        )

    def labels(self) -> dict[str, str]:
        return {
            USER_LABEL: self.user,
            GROUP_LABEL: self.group,
            SOURCE_LABEL: self.source,
            UNITS_LABEL: ",".join(self.units),
            RESTART_LABEL: ",".join(self.restart_on_credentials),
        }


@dataclass(frozen=True)
class Resolved:
    """The workload identity as the guest resolved it."""

    uid: int
    gid: int
    supplementary: tuple[int, ...]


def script(workload: Workload, credentials: LaunchCredentials | None) -> str:
    """The root shell script of one launch (see the module docstring); with ``credentials``
    it reads the supervisor bundle from stdin."""
    q = shlex.quote
    lines = [
        "set -eu",
        "umask 022",
        f"mkdir -p -m 0755 {RUN_DIR}",
        f"user={q(workload.user)}",
        f"group={q(workload.group)}",
        'entry=$(getent passwd -- "$user") || { echo "the workload user $user does not exist '
        f'in the guest" >&2; exit {_EXIT_NO_USER}; }}',
        'uid=$(printf %s "$entry" | cut -d: -f3)',
        'gid=$(printf %s "$entry" | cut -d: -f4)',
        'if [ -n "$group" ]; then',
        '  gentry=$(getent group -- "$group") || { echo "the workload group $group does not '
        f'exist in the guest" >&2; exit {_EXIT_NO_GROUP}; }}',
        '  gid=$(printf %s "$gentry" | cut -d: -f3)',
        "fi",
        'groups=$(id -G -- "$(printf %s "$entry" | cut -d: -f1)")',
        'for g in "$uid" "$gid" $groups; do',
        '  if [ "$g" = 0 ]; then echo "the workload identity resolves to root (uid $uid, gid '
        f'$gid, groups $groups)" >&2; exit {_EXIT_ROOT}; fi',
        "done",
    ]
    if credentials is not None:
        verification = base64.b64encode(credentials.verification).decode()
        lines += [
            "umask 077",
            f"cat > {AUTH_BUNDLE_PATH}.new",
            f"chmod 0600 {AUTH_BUNDLE_PATH}.new",
            f"mv -f {AUTH_BUNDLE_PATH}.new {AUTH_BUNDLE_PATH}",
            "umask 022",
            f"printf %s {q(verification)} | base64 -d > {VERIFICATION_PATH}.new",
            f"chmod 0644 {VERIFICATION_PATH}.new",
            f"mv -f {VERIFICATION_PATH}.new {VERIFICATION_PATH}",
        ]
    lines += [
        'printf "WorkloadUid=%s\\nWorkloadGid=%s\\nWorkloadGroups=%s\\n" "$uid" "$gid" "$groups"'
        f" > {IDENTITY_PATH}.new",
        f"mv -f {IDENTITY_PATH}.new {IDENTITY_PATH}",
        f"if [ ! -e {LAUNCHED_PATH} ]; then",
    ]
    if workload.units:
        lines.append(f"  systemctl start --no-block {' '.join(map(q, workload.units))}")
    lines.append(f"  : > {LAUNCHED_PATH}")
    if credentials is not None and workload.restart_on_credentials:
        units = " ".join(map(q, workload.restart_on_credentials))
        lines.append(f"else systemctl try-restart --no-block {units}")
    lines += ["fi", f"cat {IDENTITY_PATH}"]
    return "\n".join(lines) + "\n"


def launch(
    run: Callable[[str, bytes | None], ExecResult],
    workload: Workload,
    credentials: LaunchCredentials | None,
) -> Resolved:
    """Run the launch in the guest with ``run(command, stdin)`` as the SSH user (who has
    passwordless sudo); FAILED_PRECONDITION with the guest's reason when it cannot."""
    command = f"sudo -n sh -c {shlex.quote(script(workload, credentials))}"
    done = run(command, credentials.supervisor if credentials else None)
    if done.exit_status != 0:
        reason = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.exit_status}"]
        raise FailedPrecondition(
            f"the workload could not be launched: {reason[0]}",
            details={"exit_status": done.exit_status},
        )
    resolved = read_identity(key_values(done.stdout))
    if resolved is None:
        raise FailedPrecondition("the workload launch did not report the resolved identity")
    return resolved


def read_identity(fields: Mapping[str, str]) -> Resolved | None:
    """The resolved identity from IDENTITY_PATH's lines (``Key=value``); None without them."""
    try:
        uid, gid = int(fields["WorkloadUid"]), int(fields["WorkloadGid"])
        groups = {int(g) for g in fields.get("WorkloadGroups", "").split()}
    except (KeyError, ValueError):
        return None
    return Resolved(uid, gid, tuple(sorted(groups - {gid})))


def key_values(text: str) -> dict[str, str]:
    """The ``Key=value`` lines of ``text`` (systemctl show's form, and IDENTITY_PATH's)."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


class Launches:
    """Per sandbox, by its domain UUID (a later sandbox of the same name is another one): the
    credentials not yet in the guest and the last launch failure.

    ``manager`` makes a SandboxManager; ``changed(name, uuid)`` tells the watchers that a
    sandbox's snapshot changed (``events.EventSource.changed``).
    """

    def __init__(
        self, manager: Callable[[], SandboxManager], changed: Callable[[str, str], None]
    ) -> None:
        self._manager = manager
        self._changed = changed
        self._lock = threading.Lock()
        self._pending: dict[str, LaunchCredentials] = {}
        self._failures: dict[str, str] = {}

    def hold(self, uuid: str, credentials: LaunchCredentials | None) -> None:
        """Keep ``credentials`` (when given) for the next launch of sandbox ``uuid``."""
        with self._lock:
            if credentials is not None:
                self._pending[uuid] = credentials

    def restart(self, uuid: str, credentials: LaunchCredentials | None) -> None:
        """A new start of ``uuid``: its credentials held (when given), its last failure gone."""
        with self._lock:
            if credentials is not None:
                self._pending[uuid] = credentials
            self._failures.pop(uuid, None)

    def drop(self, uuid: str) -> None:
        """Forget the credentials held for ``uuid`` (its start failed)."""
        with self._lock:
            self._pending.pop(uuid, None)

    def forget(self, uuid: str) -> None:
        """Forget everything about ``uuid`` (it was deleted)."""
        with self._lock:
            self._pending.pop(uuid, None)
            self._failures.pop(uuid, None)

    def failure(self, uuid: str) -> str | None:
        """Why the last launch of ``uuid`` failed ("CODE: message"); None when it did not."""
        with self._lock:
            return self._failures.get(uuid)

    def launch(self, name: str, uuid: str) -> None:
        """Launch the workload of the ready sandbox of ours ``name`` with domain UUID ``uuid``
        (``launch``) with the credentials waiting for it; a failure is kept for its
        snapshots, and raised."""
        with self._manager() as manager:
            sandbox = manager.get(name, uuid=uuid)
            workload = Workload.of(sandbox.labels)
            if workload is None or sandbox.ssh is None:
                return
            endpoint, keys = sandbox.ssh, manager.keys_of(sandbox)
        with self._lock:
            credentials = self._pending.pop(uuid, None)

        def run(command: str, stdin: bytes | None) -> ExecResult:
            return ssh.run(endpoint, keys, command, stdin=stdin, timeout=_LAUNCH_TIMEOUT)

        try:
            resolved = launch(run, workload, credentials)
        except VmSandboxError as exc:
            with self._lock:
                self._failures[uuid] = f"{exc.code}: {exc.message}"
            self._changed(sandbox.domain.removeprefix(DOMAIN_PREFIX), uuid)
            raise
        with self._lock:
            self._failures.pop(uuid, None)
        log.info("sandbox %s launched as uid %d gid %d", name, resolved.uid, resolved.gid)
        self._changed(sandbox.domain.removeprefix(DOMAIN_PREFIX), uuid)
