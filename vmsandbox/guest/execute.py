"""Commands in a guest as scripts need them: environment variables, a working directory, another
user (sudo in the guest), standard input streamed in, and stdout and stderr handed back as they
come (``ExecStream``), over one SSH session with the pinned host key (ssh.py).

Every word reaches the guest quoted (``shlex``): names, values and paths cannot add shell syntax.
Environment variables are set by the guest's shell rather than sent as SSH ``env`` requests,
which sshd drops unless configured to accept them.
"""

from __future__ import annotations

import io
import re
import select
import shlex
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from vmsandbox.errors import DeadlineExceeded, InvalidArgument, Unavailable
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.guest.ssh import Endpoint, connect, shell_command

if TYPE_CHECKING:
    import paramiko

ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z")
_CHUNK = 65536
_POLL_S = 0.5  # how often a quiet command's deadline and connection are looked at
EOF_GRACE_S = 2.0


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as given, each name a shell variable name and each value a string without NUL;
    INVALID_ARGUMENT naming the first that is not."""
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME_RE.match(name):
            raise InvalidArgument(
                f"env name {name!r} is not valid: use letters, digits and '_', not starting "
                "with a digit",
                details={"field": "env", "value": repr(name)},
            )
        if not isinstance(value, str) or "\0" in value:
            raise InvalidArgument(
                f"env {name}: the value must be a string without NUL bytes",
                details={"field": "env", "value": repr(value)},
            )
    return dict(env)


def parse_env(assignments: Sequence[str]) -> dict[str, str]:
    """``K=V`` words (``--env``) as a mapping, later ones winning; INVALID_ARGUMENT for a word
    without ``=`` or with a name that is not valid."""
    env: dict[str, str] = {}
    for word in assignments:
        name, equals, value = word.partition("=")
        if not equals:
            raise InvalidArgument(
                f"--env {word!r} is not valid: write NAME=VALUE",
                details={"field": "--env", "value": repr(word)},
            )
        env[name] = value
    return check_env(env)


def command_line(
    command: Sequence[str] | str,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
) -> str:
    """The shell line that runs ``command`` (a list, quoted word by word, or a shell line) in
    ``cwd`` with ``env`` added, as ``user`` through ``sudo -n`` when given. A ``cd`` that fails
    ends it with status 1 before the command runs."""
    line = shell_command(command)
    prefix = ""
    if cwd is not None:
        if not isinstance(cwd, str) or not cwd or "\0" in cwd:
            raise InvalidArgument(
                f"cwd {cwd!r} is not a path", details={"field": "cwd", "value": repr(cwd)}
            )
        prefix += f"cd -- {shlex.quote(cwd)} || exit 1; "
    if env:
        exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in check_env(env).items())
        prefix += f"export {exports}; "
    if user is None:
        return prefix + line
    if not isinstance(user, str) or not USER_RE.match(user):
        raise InvalidArgument(
            f"user {user!r} is not a valid user name",
            details={"field": "user", "value": repr(user)},
        )
    return f"sudo -n -H -u {shlex.quote(user)} -- sh -c {shlex.quote(prefix + line)}"


@dataclass(frozen=True)
class Output:
    """A piece of a command's output as it arrived: ``stream`` is "stdout" or "stderr"."""

    stream: str
    data: bytes


class ExecStream:
    """A command running in the guest; iterate for its output as it comes, then read
    ``exit_status``. A context manager: leaving it closes the connection (and so ends a
    command still running). ``stdin`` (bytes or a binary stream) is sent as the command reads
    it, from a thread of its own, then closed; None gives the command an empty input.

    UNAVAILABLE when the guest cannot be reached or drops the session; DEADLINE_EXCEEDED when
    ``timeout`` seconds pass before the command exits."""

    def __init__(
        self,
        endpoint: Endpoint,
        keys: SandboxKeys,
        command: str,
        *,
        stdin: bytes | IO[bytes] | None = None,
        timeout: float | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.command = command
        self.timeout = timeout
        self.exit_status: int | None = None
        # The signal that killed the command (its name, such as "KILL"; ssh.ExecResult's).
        self.signal: str | None = None
        self._client = connect(endpoint, keys)
        try:
            transport = self._client.get_transport()
            if transport is None:
                raise EOFError("the SSH transport is closed")
            self._channel: paramiko.Channel = transport.open_session()
            self._channel.exec_command(command)
        except (OSError, EOFError, _ssh_exception()) as exc:
            self._client.close()
            raise self._broken(exc) from exc
        except BaseException:
            self._client.close()
            raise
        self._feeder: threading.Thread | None = None
        if stdin is None:
            self._channel.shutdown_write()
        else:  # fed from a thread: a command may write much before it reads its input
            source = io.BytesIO(bytes(stdin)) if isinstance(stdin, bytes | bytearray) else stdin
            self._feeder = threading.Thread(target=self._feed, args=(source,), daemon=True)
            self._feeder.start()

    def _feed(self, stdin: IO[bytes]) -> None:
        """Copy ``stdin`` into the command until it ends (or the command is gone)."""
        read = getattr(stdin, "read1", stdin.read)  # read1: what a pipe has, without waiting
        try:
            while data := read(_CHUNK):
                self._channel.sendall(data)
            self._channel.shutdown_write()
        except (OSError, EOFError, _ssh_exception()):
            pass  # the command exited or the session went: its end is reported by the reader

    def __iter__(self) -> Iterator[Output]:
        channel = self._channel
        deadline = time.monotonic() + self.timeout if self.timeout else None
        exited: float | None = None  # when the exit status came
        try:
            while True:
                if channel.recv_ready():
                    yield Output("stdout", channel.recv(_CHUNK))
                    continue
                if channel.recv_stderr_ready():
                    yield Output("stderr", channel.recv_stderr(_CHUNK))
                    continue
                if channel.exit_status_ready():
                    # sshd may send the exit status before the last output: the output is
                    # whole at its end of file, or after EOF_GRACE_S (a background process
                    # of the command's can hold its stdout open)
                    exited = exited or time.monotonic()
                    if channel.eof_received or time.monotonic() - exited > EOF_GRACE_S:
                        break
                elif channel.closed or not self._transport_active():
                    raise EOFError("the guest closed the session before the command exited")
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"command did not finish within {self.timeout}s: {self.command}"
                    )
                wait = _POLL_S if exited is None else 0.05
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                select.select([channel], [], [], max(0.0, wait))
            status = channel.recv_exit_status()
            if status == -1 and not self._transport_active():
                raise EOFError("the guest closed the connection before the command exited")
            self.exit_status = status
            self.signal = getattr(channel, "exit_signal", None)
        except (OSError, EOFError, _ssh_exception()) as exc:
            raise self._broken(exc) from exc

    def _transport_active(self) -> bool:
        transport = self._client.get_transport()
        return transport is not None and transport.is_active()

    def _broken(self, exc: BaseException) -> Unavailable:
        where = f"{self.endpoint.host}:{self.endpoint.port}"
        return Unavailable(
            f"the guest's SSH session at {where} broke while running a command: "
            f"{type(exc).__name__}: {str(exc) or 'the connection closed'}",
            details={"host": self.endpoint.host, "port": self.endpoint.port},
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ExecStream:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _ssh_exception() -> type[Exception]:
    import paramiko

    exception: type[Exception] = paramiko.SSHException
    return exception
