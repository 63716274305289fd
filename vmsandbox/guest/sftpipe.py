"""The SFTP session of a copy, over one of two SSH clients, both pinned to the sandbox's host key:

- OpenSSH's ``ssh -s sftp`` (openssh.ssh_argv), with paramiko's SFTP client speaking through its
  pipes: the transport scp uses, with its ciphers (chacha20-poly1305, which costs a guest
  without AES instructions, such as a TCG guest, a fraction of AES-CTR's) and its native speed;
- paramiko's own transport (ssh.connect), where no ``ssh`` command is installed.

bench/transfer.py measures the copies against scp.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
from typing import TYPE_CHECKING

from vmsandbox.errors import Unavailable
from vmsandbox.guest import openssh, ssh
from vmsandbox.guest.keys import SandboxKeys

if TYPE_CHECKING:
    import paramiko

# ssh(1) for a subsystem: no terminal, no X11, never a prompt, no shared master connection.
SFTP_OPTIONS = (
    *("-s", "-T", "-x", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"),
    *("-o", "ControlPath=none", "-o", "ConnectTimeout=15"),
)
SFTP_WINDOW = 64 * 2**20  # paramiko's transport: the SFTP channel's flow-control window
SFTP_PACKET = 32768
_CLOSE_GRACE_S = 5.0


class OpenSshPipe:
    """An ``ssh -s sftp`` process as the socket paramiko's SFTPClient reads and writes."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,  # a Ctrl-C reaches us, and we close the session in order
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in = self.proc.stdin.fileno()
        self._out = self.proc.stdout.fileno()
        self._said: str | None = None  # ssh's standard error, once read (``_last_words``)

    def send(self, data: bytes) -> int:
        try:
            return os.write(self._in, data)
        except BrokenPipeError as exc:
            raise EOFError(self.why()) from exc

    def recv(self, count: int) -> bytes:
        return os.read(self._out, count)

    def recv_ready(self) -> bool:
        return bool(select.select([self._out], [], [], 0)[0])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get_name(self) -> str:
        """What paramiko's log lines call the session."""
        return "ssh -s sftp"

    def why(self) -> str:
        """What ssh said on its way out (its last line), once it has ended; also after
        ``close``."""
        if self.alive():
            return "the ssh process is still running"
        text = self._last_words()
        return text.splitlines()[-1] if text else f"ssh exited with status {self.proc.returncode}"

    def _last_words(self) -> str:
        """ssh's standard error, read once it has ended and kept (``close`` reads it before
        it closes the pipe)."""
        if self._said is None:
            stream = self.proc.stderr
            raw = b"" if stream is None or stream.closed else stream.read()
            self._said = raw.decode(errors="replace").strip()
        return self._said

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        try:
            self.proc.wait(_CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self._last_words()
            self.proc.stderr.close()


class Session:
    """An SFTP client and what it runs over; ``close`` ends both."""

    def __init__(
        self,
        sftp: paramiko.SFTPClient,
        *,
        pipe: OpenSshPipe | None = None,
        client: paramiko.SSHClient | None = None,
    ) -> None:
        self.sftp = sftp
        self._pipe = pipe
        self._client = client

    def alive(self) -> bool:
        if self._pipe is not None:
            return self._pipe.alive()
        transport = self._client.get_transport() if self._client else None
        return transport is not None and transport.is_active()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.sftp.close()
        if self._pipe is not None:
            self._pipe.close()
        if self._client is not None:
            self._client.close()


def open_session(endpoint: ssh.Endpoint, keys: SandboxKeys, *, via: str | None = None) -> Session:
    """An SFTP session with the guest at ``endpoint``: over OpenSSH when ``ssh`` is installed
    (``via`` "openssh" or "paramiko" chooses). UNAVAILABLE when the guest does not answer;
    FAILED_PRECONDITION (HostKeyMismatch) when it shows another host key."""
    import paramiko

    if (via or ("openssh" if shutil.which("ssh") else "paramiko")) == "openssh":
        argv = openssh.ssh_argv(endpoint, keys, ["sftp"], options=SFTP_OPTIONS)
        pipe = OpenSshPipe(argv)
        try:
            return Session(paramiko.SFTPClient(pipe), pipe=pipe)  # type: ignore[arg-type]  # a socket
        except (OSError, EOFError, paramiko.SSHException) as exc:
            pipe.close()
            why = pipe.why()
            if "host key" in why.lower() or "REMOTE HOST IDENTIFICATION" in why:
                raise ssh.HostKeyMismatch(
                    f"guest at {endpoint.host}:{endpoint.port} did not show the host key "
                    f"pinned for {keys.host_alias}; refusing to connect ({why})"
                ) from exc
            raise Unavailable(
                f"no SFTP session with the guest at {endpoint.host}:{endpoint.port}: {why}"
            ) from exc
    client = ssh.connect(endpoint, keys)
    try:
        transport = client.get_transport()
        assert transport is not None  # ssh.connect returns a connected client
        sftp = paramiko.SFTPClient.from_transport(
            transport, window_size=SFTP_WINDOW, max_packet_size=SFTP_PACKET
        )
        if sftp is None:
            raise Unavailable(f"the guest at {endpoint.host}:{endpoint.port} refused SFTP")
        return Session(sftp, client=client)
    except BaseException:
        client.close()
        raise
