"""Per-sandbox SSH keys: a client key pair and the guest's host key, pinned from birth.

Both are Ed25519, generated in-process with ``cryptography`` (which paramiko already needs).
The guest receives its host key through the cloud-init seed, so the client knows it before the
first connection and never trusts on first use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vmsandbox.errors import FailedPrecondition

CLIENT_KEY = "id_ed25519"
KNOWN_HOSTS = "known_hosts"


@dataclass(frozen=True)
class KeyPair:
    private_openssh: str
    public_openssh: str  # "ssh-ed25519 AAAA..."


def generate(comment: str) -> KeyPair:
    from cryptography.hazmat.primitives import serialization  # deferred: slow to import
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()
    public = (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )
    return KeyPair(private_openssh=private, public_openssh=f"{public} {comment}")


def write_private(path: Path, text: str) -> None:
    """Write a secret readable by its owner only (created 0600, never briefly wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


@dataclass(frozen=True)
class SandboxKeys:
    """The files of one sandbox's keys, in its owner-only folder."""

    folder: Path
    host_alias: str  # the name the host key is pinned under (OpenSSH HostKeyAlias)

    @property
    def client_key(self) -> Path:
        return self.folder / CLIENT_KEY

    @property
    def known_hosts(self) -> Path:
        return self.folder / KNOWN_HOSTS

    def host_public_key(self) -> str:
        """The pinned host key as ``ssh-ed25519 AAAA...``; FAILED_PRECONDITION when there is
        none (the client never falls back to trusting whatever key the guest shows)."""
        try:
            line = self.known_hosts.read_text().split()
        except OSError as exc:
            raise FailedPrecondition(
                f"the pinned host key of {self.host_alias} cannot be read: {exc}"
            ) from exc
        if len(line) < 3 or line[0] != self.host_alias:
            raise FailedPrecondition(
                f"{self.known_hosts} holds no host key pinned for {self.host_alias}; "
                "refusing to connect"
            )
        return f"{line[1]} {line[2]}"

    @classmethod
    def create(cls, folder: Path, host_alias: str) -> tuple[SandboxKeys, KeyPair, KeyPair]:
        """Make the folder (0700), the client key pair and the pinned host key.

        Returns the keys and both pairs; the host pair's private half is for the seed only and
        is not kept here.
        """
        folder.mkdir(mode=0o700, parents=False, exist_ok=False)
        os.chmod(folder, 0o700)
        keys = cls(folder=folder, host_alias=host_alias)
        client = generate(f"vmsandbox-client@{host_alias}")
        host = generate(f"vmsandbox-host@{host_alias}")
        write_private(keys.client_key, client.private_openssh)
        write_private(keys.client_key.with_suffix(".pub"), client.public_openssh + "\n")
        key_type, key_b64 = host.public_openssh.split()[:2]
        write_private(keys.known_hosts, f"{host_alias} {key_type} {key_b64}\n")
        return keys, client, host
