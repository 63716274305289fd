"""The SSH wait's knocks (ssh._knock) and a resumed guest's banner read (ssh.banner), against
real loopback sockets that behave as QEMU's user-mode forward does: a guest without network yet
(accepted, then silence), a guest whose network refuses the port (closed at once), and sshd (its
banner, left for the SSH client)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from vmsandbox.errors import DeadlineExceeded, Unavailable
from vmsandbox.guest import ssh

BANNER = b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n"


@pytest.fixture
def forward() -> Iterator[Callable[[Callable[[socket.socket], None]], ssh.Endpoint]]:
    """A listener on 127.0.0.1 that hands each accepted connection to ``behave``."""
    servers: list[socket.socket] = []
    held: list[socket.socket] = []

    def start(behave: Callable[[socket.socket], None]) -> ssh.Endpoint:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)

        def serve() -> None:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at teardown: nothing knocked
                return
            held.append(conn)
            behave(conn)

        threading.Thread(target=serve, daemon=True).start()
        return ssh.Endpoint("127.0.0.1", server.getsockname()[1], "sandbox")

    yield start
    for sock in held + servers:
        sock.close()


def test_a_silent_guest_is_given_up_within_the_wait(forward):
    endpoint = forward(lambda conn: None)  # accepted, nothing sent: no network in the guest yet
    with pytest.raises(ssh._Silent):
        ssh._knock(endpoint, 0.2)


def test_a_refused_port_is_an_eof(forward):
    endpoint = forward(lambda conn: conn.close())  # later knocks wait in the backlog, silent
    with pytest.raises(EOFError):
        ssh._knock(endpoint, 1.0)


def test_sshds_banner_is_left_unread_for_the_ssh_client(forward):
    endpoint = forward(lambda conn: conn.sendall(BANNER))
    sock = ssh._knock(endpoint, 5.0)
    assert sock.gettimeout() is None  # the SSH client sets its own
    try:
        assert sock.recv(len(BANNER), socket.MSG_WAITALL) == BANNER
    finally:
        sock.close()


def test_no_connection_is_made_while_the_console_says_sshd_is_not_up(forward):
    """Every knock the forward takes reaches the guest later, each one an sshd start there."""
    accepted = threading.Event()
    endpoint = forward(lambda conn: accepted.set())
    keys = None  # never used: the wait gives up before any connection
    with pytest.raises(DeadlineExceeded, match="did not accept SSH"):
        ssh.wait_ready(endpoint, keys, timeout=0.6, sshd_reported=lambda: False)  # type: ignore[arg-type]
    assert not accepted.wait(0.2)


def _listener(answer: Callable[[int, socket.socket], None]) -> tuple[ssh.Endpoint, list[int]]:
    """A listener that hands its n-th accepted connection (from 0) to ``answer``; the list
    counts the connections."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[int] = []

    def serve() -> None:
        with server:
            while len(seen) < 20:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                seen.append(len(seen))
                threading.Thread(target=answer, args=(seen[-1], conn), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return ssh.Endpoint("127.0.0.1", server.getsockname()[1], "sandbox"), seen


def test_a_guest_that_says_its_network_is_up_is_knocked_one_at_a_time(forward):
    """Refused knocks (sshd not listening yet) are followed by the next one soon; a knock sshd
    took is waited for alone, never doubled while its banner is on the way."""

    def answer(number: int, conn: socket.socket) -> None:
        if number < 3:
            conn.close()  # the guest's network refuses the port: sshd not up yet
            return
        threading.Event().wait(0.5)  # sshd starts a process for the connection
        conn.sendall(BANNER)

    endpoint, seen = _listener(answer)
    sock = ssh._knock(endpoint, 5.0, every=0.05, at_once=1)
    sock.close()
    assert seen == [0, 1, 2, 3]


# -- ssh.banner: a resumed guest's sshd answers ----------------------------------------------


def test_banner_reads_sshds_identification_line(forward):
    endpoint = forward(lambda conn: conn.sendall(BANNER))
    assert ssh.banner(endpoint, timeout=5.0) == "SSH-2.0-OpenSSH_9.2p1 Debian-2"


def test_a_port_that_does_not_answer_as_sshd_is_unavailable(forward):
    endpoint = forward(lambda conn: (conn.sendall(b"HTTP/1.1 400 Bad Request\r\n"), conn.close()))
    with pytest.raises(Unavailable, match="did not answer as an SSH server: 'HTTP"):
        ssh.banner(endpoint, timeout=5.0)


def test_a_silent_or_closed_port_is_unavailable(forward):
    silent = forward(lambda conn: None)
    with pytest.raises(Unavailable, match="no SSH answer"):
        ssh.banner(silent, timeout=0.2)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(Unavailable, match="no SSH answer"):
        ssh.banner(ssh.Endpoint("127.0.0.1", port, "sandbox"), timeout=1.0)
