"""Talking to a booted guest over SSH with its pinned host key (paramiko).

No AutoAddPolicy: the only host key accepted is the one handed to the guest in its seed.
A guest presenting any other key is refused with FAILED_PRECONDITION.
"""

from __future__ import annotations

import base64
import io
import logging
import select
import shlex
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from vmsandbox.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.progress import Progress, silent

# paramiko logs every failed handshake with a traceback; while a guest boots those are expected.
logging.getLogger("paramiko").addHandler(logging.NullHandler())
logging.getLogger("paramiko").propagate = False

if TYPE_CHECKING:
    import paramiko


def _paramiko() -> Any:
    """paramiko, imported on first use: it costs ~150 ms, and most commands never SSH. Its
    channels are taught the ``exit-signal`` request (``_reading_exit_signal``)."""
    import paramiko

    table = paramiko.Transport._channel_handler_table  # type: ignore[attr-defined]
    request = paramiko.common.MSG_CHANNEL_REQUEST
    if not getattr(table[request], "reads_exit_signal", False):
        table[request] = _reading_exit_signal(table[request])
    return paramiko


def _reading_exit_signal(handle: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """paramiko's channel request handler, plus the ``exit-signal`` request (RFC 4254, 6.10)
    that paramiko ignores: sshd sends it instead of an exit status when the command was
    killed by a signal. The channel then has ``exit_signal`` (its name, such as "KILL") and
    the exit status a shell gives such a command, 128 + the signal's number."""

    def handle_request(channel: Any, message: Any) -> None:
        start = message.packet.tell()
        if message.get_text() != "exit-signal":
            message.packet.seek(start)
            handle(channel, message)
            return
        message.get_boolean()  # want-reply: false for this request
        name = message.get_text()
        channel.exit_signal = name
        number = getattr(signal.Signals, f"SIG{name}", None)
        channel.exit_status = 128 + number.value if number is not None else 255
        channel.status_event.set()

    handle_request.reads_exit_signal = True  # type: ignore[attr-defined]
    return handle_request


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    user: str


@dataclass(frozen=True)
class ExecResult:
    exit_status: int
    stdout: str
    stderr: str
    # The signal that killed the command (its name, such as "KILL"); its exit status is then
    # 128 + the signal's number, as a shell gives it.
    signal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "exit_status": self.exit_status,
            "signal": self.signal,
            "stdout": self.stdout,
            "stderr": self.stderr,
        }


class HostKeyMismatch(FailedPrecondition):
    """The guest answered with a host key other than the pinned one."""


def _client(
    endpoint: Endpoint, keys: SandboxKeys, timeout: float, sock: socket.socket | None = None
) -> paramiko.SSHClient:
    paramiko = _paramiko()
    client = paramiko.SSHClient()
    key_type, key_b64 = keys.host_public_key().split()[:2]
    pinned = paramiko.PKey.from_type_string(key_type, base64.b64decode(key_b64))
    lookup = endpoint.host if endpoint.port == 22 else f"[{endpoint.host}]:{endpoint.port}"
    client.get_host_keys().add(lookup, key_type, pinned)
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(
            endpoint.host,
            port=endpoint.port,
            username=endpoint.user,
            key_filename=str(keys.client_key),
            look_for_keys=False,
            allow_agent=False,
            sock=sock,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
        )
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise HostKeyMismatch(
            f"guest at {endpoint.host}:{endpoint.port} presented host key "
            f"{exc.key.get_fingerprint().hex()} ({exc.key.get_name()}), not the key pinned for "
            f"{keys.host_alias}; refusing to connect"
        ) from exc
    except BaseException:
        client.close()
        raise
    return client


# The signature algorithms of an RSA host key (the key's own type names none of them).
RSA_SIGNATURES = ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa")
BANNER_MAX = 255  # RFC 4253 4.2: the identification line, CR LF included


def prove_host_key(endpoint: Endpoint, keys: SandboxKeys, timeout: float = 10.0) -> None:
    """Check that sshd at ``endpoint`` answers with the pinned host key: a key exchange alone,
    no login and no command (about a third of what a login and a command cost under TCG).
    FAILED_PRECONDITION (HostKeyMismatch) for another key, UNAVAILABLE when sshd does not
    answer."""
    paramiko = _paramiko()
    key_type, key_b64 = keys.host_public_key().split()[:2]
    pinned = paramiko.PKey.from_type_string(key_type, base64.b64decode(key_b64))
    where = f"{endpoint.host}:{endpoint.port}"
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
    except OSError as exc:
        raise Unavailable(f"cannot reach the guest's sshd at {where}: {exc}") from exc
    transport = paramiko.Transport(sock)
    try:
        options = transport.get_security_options()
        # Only the pinned key's algorithms: sshd must show that key, no other it may hold.
        signed_as = RSA_SIGNATURES if key_type == "ssh-rsa" else (key_type,)
        options.key_types = [t for t in options.key_types if t in signed_as]
        transport.start_client(timeout=timeout)
        shown = transport.get_remote_server_key()
    except (OSError, paramiko.SSHException, EOFError) as exc:
        raise Unavailable(f"no SSH key exchange with the guest at {where}: {exc}") from exc
    finally:
        transport.close()
    if shown.asbytes() != pinned.asbytes():
        raise HostKeyMismatch(
            f"guest at {where} presented host key {shown.get_fingerprint().hex()} "
            f"({shown.get_name()}), not the key pinned for {keys.host_alias}"
        )


def banner(endpoint: Endpoint, timeout: float = 10.0) -> str:
    """sshd's identification line at ``endpoint`` ("SSH-2.0-..."): proof that it answers
    there, at the cost of a TCP connection (no key exchange, which takes a TCG guest tenths of
    a second). UNAVAILABLE when nothing there answers as an SSH server."""
    where = f"{endpoint.host}:{endpoint.port}"
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            seen = b""
            while b"\n" not in seen and len(seen) < BANNER_MAX:
                chunk = sock.recv(BANNER_MAX - len(seen))
                if not chunk:
                    break
                seen += chunk
    except OSError as exc:
        raise Unavailable(f"no SSH answer from the guest at {where}: {exc}") from exc
    line = seen.split(b"\n", 1)[0].rstrip(b"\r").decode("ascii", "replace")
    if not line.startswith("SSH-"):
        raise Unavailable(f"the guest at {where} did not answer as an SSH server: {line[:80]!r}")
    return line


def connect(endpoint: Endpoint, keys: SandboxKeys, timeout: float = 10.0) -> paramiko.SSHClient:
    """An authenticated client, or UNAVAILABLE when the guest does not answer."""
    try:
        return _client(endpoint, keys, timeout)
    except HostKeyMismatch:
        raise
    except (OSError, _paramiko().SSHException, EOFError) as exc:
        why = str(exc).removeprefix("[Errno None] ") or type(exc).__name__
        raise Unavailable(
            f"cannot reach the guest over SSH at {endpoint.host}:{endpoint.port}: {why}"
        ) from exc


# QEMU's user-mode networking accepts the host side of a forward at once and then knocks at the
# guest, which stays silent until its network is up; a knock it missed is retried only seconds
# later. So the wait for sshd keeps several connections open, a new one every KNOCK_EVERY_S,
# and takes the first on which sshd's banner arrives: sshd is found about as soon as it answers.
# None is given up early (sshd's first answer can take a second under TCG); each is closed after
# KNOCK_WAIT_S without a word, and the ones left when a banner comes are closed unread.
# A knock the forward has taken is delivered to the guest even after it is closed here, and each
# one that arrives once sshd listens costs a whole sshd start in the guest, on the vCPU the boot
# needs. So for a guest whose console says when it can be knocked at (the project's images: once
# sshd has started and the network is up, or, in their lean boot, once the network is up), the
# wait makes no connection until then (``sshd_reported``), and knocks every KNOCK_REPORTED_S
# after it, one at a time: the guest answers each knock from then on, a refusal at once (it
# starts nothing there), or sshd's banner once sshd has started a process for it, which a
# second knock meanwhile would only double.
KNOCK_EVERY_S = 0.5
KNOCK_WAIT_S = 5.0
KNOCKS_OPEN = 8
KNOCK_REPORTED_S = 0.1
GATE_POLL_S = 0.05


class _Silent(Exception):
    """No connection got an answer from the guest within the wait given."""


def _knock(
    endpoint: Endpoint, wait: float, every: float = KNOCK_EVERY_S, at_once: int = KNOCKS_OPEN
) -> socket.socket:
    """A connection on which sshd's banner has arrived (peeked at, left for paramiko to read),
    knocking every ``every`` seconds with at most ``at_once`` connections open. _Silent when
    none had one within ``wait``; the last error when every connection failed."""
    knocks: dict[socket.socket, float] = {}  # connection -> when it is given up
    deadline = time.monotonic() + wait
    next_knock = 0.0
    error: Exception = _Silent()
    try:
        while True:
            now = time.monotonic()
            if now >= next_knock and len(knocks) < at_once:
                next_knock = now + every
                try:
                    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=wait)
                    knocks[sock] = now + KNOCK_WAIT_S
                except OSError as exc:
                    error = exc
            if now >= deadline:
                raise error
            for sock in [sock for sock, until in knocks.items() if until <= now]:
                del knocks[sock]
                sock.close()
            room = len(knocks) < at_once
            pause = max(0.0, next_knock - now) if room else every
            ready, _, _ = select.select(list(knocks), [], [], min(pause, deadline - now))
            for sock in ready:
                try:
                    if sock.recv(4, socket.MSG_PEEK):
                        del knocks[sock]
                        sock.settimeout(None)
                        return sock
                    error = EOFError("the guest closed the connection")
                except OSError as exc:
                    error = exc
                del knocks[sock]
                sock.close()
    finally:
        for sock in knocks:
            sock.close()


def _gate_opens(sshd_reported: Callable[[], bool], wait: float) -> bool:
    """Whether ``sshd_reported`` says yes within ``wait`` seconds, asked every GATE_POLL_S: the
    caller's other checks (is the domain still running, a libvirt call) come once per wait."""
    until = time.monotonic() + wait
    while not sshd_reported():
        if time.monotonic() >= until:
            return False
        time.sleep(GATE_POLL_S)
    return True


def wait_ready(
    endpoint: Endpoint,
    keys: SandboxKeys,
    *,
    timeout: float,
    interval: float = 0.2,
    progress: Progress = silent,
    still_running: Callable[[], bool] = lambda: True,
    stage: Callable[[], str | None] = lambda: None,
    sshd_reported: Callable[[], bool] | None = None,
) -> float:
    """Poll until SSH accepts the sandbox key; return the seconds waited.

    ``still_running`` lets the caller stop early when the domain has died; ``stage`` reports
    what the guest is doing (read from its console) for progress lines; ``sshd_reported``,
    for a guest that reports sshd's start, says whether it has (no connection before that).
    """
    start = time.monotonic()
    _paramiko()  # imported while the guest boots, not after sshd has answered
    deadline = start + timeout
    last_error = "no answer yet"
    last_report = 0.0
    while True:
        now = time.monotonic()
        if now >= deadline:
            raise DeadlineExceeded(
                f"guest did not accept SSH at {endpoint.host}:{endpoint.port} within "
                f"{timeout:.0f}s (last error: {last_error})"
            )
        if not still_running():
            raise DeadlineExceeded(
                f"guest stopped before SSH came up at {endpoint.host}:{endpoint.port}"
            )
        if now - last_report >= 5.0:
            last_report = now
            where = stage()
            progress(f"waiting for SSH ({now - start:.0f}s{', guest: ' + where if where else ''})")
        if sshd_reported is not None and not _gate_opens(sshd_reported, min(1.0, deadline - now)):
            continue
        wait = min(5.0, max(0.5, deadline - now))
        knocking = (KNOCK_EVERY_S, KNOCKS_OPEN) if sshd_reported is None else (KNOCK_REPORTED_S, 1)
        try:
            sock = _knock(endpoint, wait, *knocking)
            client = _client(endpoint, keys, timeout=wait, sock=sock)
        except _Silent:
            last_error = "no answer from the guest"
            continue
        except HostKeyMismatch:
            raise
        except (TimeoutError, OSError, _paramiko().SSHException, EOFError) as exc:
            last_error = str(exc) or type(exc).__name__
            time.sleep(interval)
            continue
        client.close()
        return time.monotonic() - start


def run(
    endpoint: Endpoint,
    keys: SandboxKeys,
    command: str,
    *,
    timeout: float | None = None,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
    stdin: bytes | None = None,
) -> ExecResult:
    """Run ``command`` (a shell string, already quoted by the caller) and wait for it.

    With ``stdout``/``stderr`` streams given, output is copied there as it arrives (and the
    returned texts are empty); otherwise it is collected.
    """
    client = connect(endpoint, keys)
    try:
        return _session(client, command, timeout, stdout, stderr, stdin)
    except DeadlineExceeded:
        raise
    except (OSError, EOFError, _paramiko().SSHException) as exc:
        # The guest dropped the session midway (its sshd restarted, its network went, the
        # guest stopped): UNAVAILABLE, like a guest that does not answer at all.
        where = f"{endpoint.host}:{endpoint.port}"
        raise Unavailable(
            f"the guest's SSH session at {where} broke while running a command: "
            f"{type(exc).__name__}: {str(exc) or 'the connection closed'}",
            details={"host": endpoint.host, "port": endpoint.port},
        ) from exc
    finally:
        client.close()


def _session(
    client: paramiko.SSHClient,
    command: str,
    timeout: float | None,
    stdout: IO[bytes] | None,
    stderr: IO[bytes] | None,
    stdin: bytes | None,
) -> ExecResult:
    transport = client.get_transport()
    if transport is None:
        raise EOFError("the SSH transport is closed")
    channel = transport.open_session()
    channel.settimeout(timeout)
    channel.exec_command(command)
    if stdin is not None:
        channel.sendall(stdin)
    channel.shutdown_write()
    collected_out, collected_err = io.BytesIO(), io.BytesIO()  # read when no stream is given
    out_sink = collected_out if stdout is None else stdout
    err_sink = collected_err if stderr is None else stderr
    deadline = time.monotonic() + timeout if timeout else None
    while True:
        got = False
        if channel.recv_ready():
            out_sink.write(channel.recv(65536))
            got = True
        if channel.recv_stderr_ready():
            err_sink.write(channel.recv_stderr(65536))
            got = True
        if (
            channel.exit_status_ready()
            and not channel.recv_ready()
            and not (channel.recv_stderr_ready())
        ):
            break
        if channel.closed and not got and not channel.exit_status_ready():
            raise EOFError("the guest closed the session before the command exited")
        if deadline and time.monotonic() > deadline:
            raise DeadlineExceeded(f"command did not finish within {timeout}s: {command}")
        if not got:
            time.sleep(0.01)
        for sink in (out_sink, err_sink):
            if sink in (sys.stdout.buffer, sys.stderr.buffer):
                sink.flush()
    status = channel.recv_exit_status()
    if status == -1 and not transport.is_active():
        # paramiko's "no exit status" when the connection went away before the command ended
        raise EOFError("the guest closed the connection before the command exited")
    return ExecResult(
        exit_status=status,
        stdout=collected_out.getvalue().decode(errors="replace") if stdout is None else "",
        stderr=collected_err.getvalue().decode(errors="replace") if stderr is None else "",
        signal=getattr(channel, "exit_signal", None),
    )


def shell_command(command: Sequence[str] | str) -> str:
    """The shell line for ``command``: a list is quoted word by word; a string is used as is.
    INVALID_ARGUMENT for an empty list, a word that is not a string, or a NUL byte."""
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
    return command
