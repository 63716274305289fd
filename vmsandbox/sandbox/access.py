"""Using a sandbox once it runs: commands (collected, or streamed as they come), files in and
out, its TCP ports on this host, the OpenSSH command line and ssh_config stanzas that reach it,
and its serial console log. ``SandboxManager`` has these methods (``SandboxAccess``); each
connects with the sandbox's own key and pinned host key (vmsandbox/guest/)."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition
from vmsandbox.guest import download, execute, openssh, sftpipe, ssh, upload
from vmsandbox.guest.forward import Forwarder, ForwardSpec, parse_forward
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.guest.transfer import GuestFiles, Progress, TransferSummary
from vmsandbox.sandbox.boot import check_timeout
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.record import SandboxFiles, SandboxRecord
from vmsandbox.sandbox.settle import require_running
from vmsandbox.vm import console
from vmsandbox.vm.domain import DOMAIN_PREFIX

if TYPE_CHECKING:
    import paramiko

Source = str | Path | bytes | bytearray | IO[bytes]


class SandboxAccess:
    """The methods of ``SandboxManager`` that use a running sandbox."""

    config: Config

    def get(self, name: str, *, uuid: str | None = None) -> Sandbox:
        raise NotImplementedError  # SandboxManager's

    def list(self) -> builtins.list[Sandbox]:
        raise NotImplementedError  # SandboxManager's

    def keys_of(self, sandbox: Sandbox) -> SandboxKeys:
        stem = sandbox.domain.removeprefix(DOMAIN_PREFIX)  # a claimed guest's files keep its name
        return SandboxFiles.of(self.config, stem).keys(sandbox.host_key_alias)

    def _endpoint(self, record: SandboxRecord) -> ssh.Endpoint:
        if record.ssh.port is None:
            raise FailedPrecondition(f"sandbox {record.name!r} has no SSH endpoint yet")
        return ssh.Endpoint(record.ssh.host, record.ssh.port, record.ssh.user)

    def _reach(
        self, name: str, doing: str = "connect to"
    ) -> tuple[Sandbox, ssh.Endpoint, SandboxKeys]:
        """The sandbox, its SSH endpoint and keys; FAILED_PRECONDITION saying how to start it
        when its guest does not run (settle.py)."""
        sandbox = self.get(name)
        require_running(sandbox, doing)
        assert sandbox.ssh is not None  # require_running
        return sandbox, sandbox.ssh, self.keys_of(sandbox)

    def connect(self, name: str) -> paramiko.SSHClient:
        """An SSH client logged into sandbox ``name`` (paramiko; the caller closes it)."""
        _, endpoint, keys = self._reach(name)
        return ssh.connect(endpoint, keys)

    # -- commands -----------------------------------------------------------------------------

    def exec(
        self,
        name: str,
        command: Sequence[str] | str,
        *,
        timeout: float | None = None,
        stdout: IO[bytes] | None = None,
        stderr: IO[bytes] | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> ssh.ExecResult:
        """Run a command in the sandbox and wait for it: a list is quoted word by word; a
        string is a shell line. ``env`` adds variables, ``cwd`` is where it runs, ``user``
        runs it as that user through ``sudo -n`` (``"root"``: as the image's sudo allows).
        Output is collected, or copied to ``stdout``/``stderr`` as it comes."""
        _, endpoint, keys = self._reach(name, "run a command in")
        check_timeout(timeout)
        line = execute.command_line(command, env=env, cwd=cwd, user=user)
        return ssh.run(
            endpoint, keys, line, timeout=timeout, stdout=stdout, stderr=stderr, stdin=stdin
        )

    def stream(
        self,
        name: str,
        command: Sequence[str] | str,
        *,
        stdin: bytes | IO[bytes] | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
    ) -> execute.ExecStream:
        """Start a command (as ``exec``) and hand back its output as it comes: iterate the
        returned ``ExecStream`` for ``Output(stream, data)`` pieces, then read its
        ``exit_status``; use it in a ``with`` block so its connection is closed. ``stdin``
        (bytes or a binary stream) is fed to the command as it reads."""
        _, endpoint, keys = self._reach(name)
        check_timeout(timeout)
        line = execute.command_line(command, env=env, cwd=cwd, user=user)
        return execute.ExecStream(endpoint, keys, line, stdin=stdin, timeout=timeout)

    # -- files --------------------------------------------------------------------------------

    def files(self, name: str, *, progress: Progress | None = None) -> GuestFiles:
        """An SFTP session with sandbox ``name`` for several copies (``upload``, ``download``
        take one each); close it, or use it in a ``with`` block."""
        _, endpoint, keys = self._reach(name)
        session = sftpipe.open_session(endpoint, keys)
        try:
            return GuestFiles(session, sandbox=name, user=endpoint.user, progress=progress)
        except BaseException:
            session.close()
            raise

    def upload(
        self,
        name: str,
        source: Source,
        destination: str,
        *,
        mode: int = 0o644,
        progress: Progress | None = None,
    ) -> TransferSummary:
        """Copy into the sandbox: ``source`` a local file or folder (a path; a folder with all
        below it), or the bytes of one file (``bytes``, or a binary stream read to its end,
        never held whole; written with permission bits ``mode``). ``destination`` is a guest
        path, relative to the user's home; a file or folder lands inside it when it is a
        folder. Permission bits and modification times are kept; a file appears only whole."""
        with self.files(name, progress=progress) as files:
            if isinstance(source, str | Path):
                return upload.upload(files, source, destination)
            return upload.upload_stream(files, source, destination, mode)

    def download(
        self,
        name: str,
        source: str,
        destination: str | Path | IO[bytes],
        *,
        progress: Progress | None = None,
    ) -> TransferSummary:
        """Copy out of the sandbox: guest file or folder ``source`` to a local path (into it
        when it is a folder), or a guest file into a binary stream ``destination``, chunk by
        chunk. Links that point out of a copied folder are not made (``skipped``)."""
        with self.files(name, progress=progress) as files:
            if isinstance(destination, str | Path):
                return download.download(files, source, destination)
            return download.download_stream(files, source, destination)

    # -- ports --------------------------------------------------------------------------------

    def forward(
        self, name: str, *specs: str | ForwardSpec, on_event: Callable[[str], None] | None = None
    ) -> Forwarder:
        """Forwards of guest TCP ports to this host, ``"[ADDRESS:][LOCAL:]REMOTE"`` each
        (127.0.0.1 unless an address is named; LOCAL 0 picks a free port), over the sandbox's
        SSH connection: ``with manager.forward("box", "8080:80") as fwd:``, then
        ``fwd.listening`` says where each listens. ``on_event`` hears of connections that could
        not be carried (a guest port nobody listens on)."""
        _, endpoint, keys = self._reach(name)
        parsed = [spec if isinstance(spec, ForwardSpec) else parse_forward(spec) for spec in specs]
        return Forwarder(
            lambda: ssh.connect(endpoint, keys), parsed, on_event=on_event or (lambda _line: None)
        )

    # -- OpenSSH ------------------------------------------------------------------------------

    def ssh_argv(
        self,
        name: str,
        command: Sequence[str] = (),
        *,
        options: Sequence[str] = (),
        forward_agent: bool = False,
    ) -> builtins.list[str]:
        """The OpenSSH command line that logs into the sandbox with its pinned host key, with
        the ssh(1) ``options`` given (none that change the pinning; agent forwarding only with
        ``forward_agent``)."""
        _, endpoint, keys = self._reach(name, "log into")
        return openssh.ssh_argv(
            endpoint, keys, command, options=options, forward_agent=forward_agent
        )

    def ssh_config(self, names: Sequence[str] = (), *, prefix: str = "") -> str:
        """OpenSSH ``Host`` stanzas for the sandboxes ``names`` (every one with an SSH endpoint
        when none is named), each called ``prefix`` + its name, pinned as vmsandbox pins."""
        chosen = [self.get(name) for name in names] if names else [s for s in self.list() if s.ssh]
        entries = []
        for sandbox in chosen:
            if sandbox.ssh is None:
                raise FailedPrecondition(f"sandbox {sandbox.name!r} has no SSH endpoint yet")
            keys = self.keys_of(sandbox)
            entries.append(openssh.HostEntry(prefix + sandbox.name, sandbox.ssh, keys))
        return openssh.render_config(entries)

    # -- console ------------------------------------------------------------------------------

    def console_log(self, name: str) -> Path:
        """The file of the sandbox's serial console log (vm/console.py reads it)."""
        sandbox = self.get(name)
        return SandboxFiles.of(self.config, sandbox.domain.removeprefix(DOMAIN_PREFIX)).console_log

    def logs(self, name: str, lines: int | None = None) -> str:
        """The sandbox's serial console log (its last ``lines`` lines), cleaned of terminal
        escapes: firmware, kernel and boot messages, a panic."""
        return console.read_lines(self.console_log(name), lines)

    def follow_logs(self, name: str, lines: int | None = 10) -> Iterator[str]:
        """The console log's last ``lines`` lines, then each line as the guest writes it,
        until the sandbox is destroyed."""
        return console.follow(self.console_log(name), lines)
