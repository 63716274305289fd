"""The OpenShell supervisor (``openshell-sandbox``) in every driver-made sandbox, when the
operator has the binary (config ``openshell_supervisor``).

Each guest gets the binary at BINARY (0755), the TLS files at TLS_DIR (key 0600) and
SUPERVISOR_UNIT, which runs it as root with ENV_FILE (0600): OPENSHELL_ENDPOINT,
OPENSHELL_SANDBOX_ID, OPENSHELL_SANDBOX, OPENSHELL_SANDBOX_TOKEN_FILE,
OPENSHELL_MAIN_PROCESS_SPEC (the sandbox's command, ``tty`` and
``await_main_process_attachment``: the supervisor runs it, so no main unit), the launch
files (OPENSHELL_AUTH_BUNDLE_FILE, OPENSHELL_GATEWAY_VERIFICATION_FILE,
OPENSHELL_WORKLOAD_IDENTITY_FILE: vmsandbox.openshell.launch writes them before it starts the
unit) and, for https, OPENSHELL_TLS_CA/CERT/KEY and OPENSHELL_GATEWAY_TLS_SERVER_NAME.

The endpoint (config ``openshell_gateway_endpoint``, a gateway listening on this host's
loopback) becomes ``127.0.0.1`` with the same port in the guest, where the driver's SSH remote
forward (``vmsandbox.openshell.tunnel``) carries each connection to the host's loopback, so
the traffic stays on this machine even though the guest may open no other connection: the
gateway must listen on this host's loopback at that port. The TLS server name stays the
configured host's, so the gateway's certificate still verifies.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.guest.setup import GuestFile, systemd_quoted
from vmsandbox.openshell.launch import AUTH_BUNDLE_PATH, IDENTITY_PATH, VERIFICATION_PATH

BINARY = "/opt/openshell/bin/openshell-sandbox"
TLS_DIR = "/opt/openshell/tls"
ENV_FILE = "/etc/openshell/supervisor.env"
SUPERVISOR_UNIT = "openshell-supervisor.service"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class Supervisor:
    """The supervisor binary, the endpoint its guests dial and the TLS files they get."""

    binary: bytes = field(repr=False)
    scheme: str
    host: str
    port: int
    tls: dict[str, bytes] = field(default_factory=dict, repr=False)  # ca, cert, key

    @classmethod
    def from_config(cls, config: Config) -> Supervisor | None:
        """The configured supervisor; None when none is; FAILED_PRECONDITION when the
        configuration cannot work (missing files, no loopback endpoint, no user network)."""
        if not config.openshell_supervisor:
            return None
        if config.network != "user":
            raise FailedPrecondition(
                "openshell_supervisor needs network = 'user': the guest reaches the gateway "
                "through QEMU's user-mode network"
            )
        endpoint = urlsplit(config.openshell_gateway_endpoint)
        if endpoint.scheme not in ("http", "https") or endpoint.hostname not in _LOOPBACK:
            raise FailedPrecondition(
                f"openshell_gateway_endpoint {config.openshell_gateway_endpoint!r} must be an "
                "http(s) URL on this host's loopback, e.g. 'https://127.0.0.1:8080'"
            )
        port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
        tls = {
            kind: _read(path, f"openshell_tls_{kind}")
            for kind, path in (
                ("ca", config.openshell_tls_ca),
                ("cert", config.openshell_tls_cert),
                ("key", config.openshell_tls_key),
            )
            if path
        }
        return cls(
            binary=_read(config.openshell_supervisor, "openshell_supervisor"),
            scheme=endpoint.scheme,
            host=endpoint.hostname or "127.0.0.1",
            port=port,
            tls=tls,
        )

    @property
    def guest_endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def guest_parts(
        self,
        environment: dict[str, str],
        command: tuple[str, ...],
        tty: bool,
        await_attachment: bool = False,
    ) -> tuple[list[GuestFile], dict[str, str]]:
        """The files and units for one guest; ``environment`` is the sandbox's own
        (OPENSHELL_SANDBOX, _ID and _TOKEN_FILE among it)."""
        env = {
            **environment,
            "OPENSHELL_ENDPOINT": self.guest_endpoint,
            "OPENSHELL_AUTH_BUNDLE_FILE": AUTH_BUNDLE_PATH,
            "OPENSHELL_GATEWAY_VERIFICATION_FILE": VERIFICATION_PATH,
            "OPENSHELL_WORKLOAD_IDENTITY_FILE": IDENTITY_PATH,
        }
        if command:
            spec = {
                "version": 1,
                "command": list(command),
                "tty": tty,
                "await_main_process_attachment": await_attachment,
            }
            env["OPENSHELL_MAIN_PROCESS_SPEC"] = json.dumps(spec, separators=(",", ":"))
        files = [
            GuestFile(BINARY, base64.b64encode(self.binary).decode(), mode="0755", base64=True)
        ]
        if self.scheme == "https":
            env["OPENSHELL_GATEWAY_TLS_SERVER_NAME"] = self.host
        for kind, data in sorted(self.tls.items()):
            path = f"{TLS_DIR}/{kind}.pem"
            env[f"OPENSHELL_TLS_{kind.upper()}"] = path
            files.append(GuestFile(path, data.decode(), mode="0600" if kind == "key" else "0644"))
        lines = "".join(f"{key}={systemd_quoted(value)}\n" for key, value in sorted(env.items()))
        files.append(GuestFile(ENV_FILE, lines, mode="0600"))
        unit = (
            "[Unit]\nDescription=OpenShell sandbox supervisor\nAfter=network-online.target\n\n"
            f"[Service]\nUser=root\nEnvironmentFile={ENV_FILE}\nExecStart={BINARY}\n"
            "Restart=on-failure\nRestartSec=2\n"
        )
        return files, {SUPERVISOR_UNIT: unit}


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"config {key} {path!r} cannot be read: {exc.strerror}") from exc
