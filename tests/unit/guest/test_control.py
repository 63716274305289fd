"""The control channel (guest/programs/control.py in the guest, guest/control.py on the host), on
the host: the guest's parser takes only ``claim NAME`` and ``hostname NAME`` with a sandbox name
and ``wake NANOSECONDS HEX`` with a clock and a 32-byte seed, and runs no program, and a claim
or a wake is answered ok only while sshd runs; its answers and its writes
go to a root folder of the test's own; the host's client talks to the guest's real request loop
over a socket pair standing in for the virtio port.
Its run in a real guest (the claim of a pooled guest) is covered by tests/e2e/test_pool.py."""

from __future__ import annotations

import ast
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vmsandbox import validate
from vmsandbox.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from vmsandbox.guest import control
from vmsandbox.guest.programs import control as guest_control
from vmsandbox.guest.programs.control import RequestError, answer, parse, set_hostname

SOURCE = Path(guest_control.__file__)


def test_the_guest_keeps_vmsandboxs_name_grammar() -> None:
    assert guest_control.NAME_RE.pattern == validate._NAME_RE.pattern
    assert guest_control.NAME_MAX == validate.NAME_MAX


@pytest.mark.parametrize("name", ["x", "box-7", "a" * 48, "0sandbox0"])
@pytest.mark.parametrize("verb", ["claim", "hostname"])
def test_a_sandbox_name_is_taken(verb: str, name: str) -> None:
    assert parse(f"{verb} {name}\n".encode()) == (verb, name)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"hostname x", "one line ending in a newline"),
        (b"hostname \xc3\xa9t\xc3\xa9\n", "ASCII"),
        (b"hostname\n", "is not a sandbox name"),
        (b"hostname \n", "is not a sandbox name"),
        (b"hostname -x\n", "is not a sandbox name"),
        (b"hostname x-\n", "is not a sandbox name"),
        (b"hostname X\n", "is not a sandbox name"),
        (b"hostname a.b\n", "is not a sandbox name"),
        (b"hostname x y\n", "is not a sandbox name"),
        (b"hostname x;reboot\n", "is not a sandbox name"),
        (b"hostname $(reboot)\n", "is not a sandbox name"),
        (b"hostname x\r\n", "is not a sandbox name"),
        (b"hostname " + b"a" * 49 + b"\n", "is not a sandbox name"),
        (b"claim x;reboot\n", "is not a sandbox name"),
        (b"claim\n", "is not a sandbox name"),
        (b"HOSTNAME x\n", "unknown request 'HOSTNAME'"),
        (b"reboot\n", "unknown request 'reboot'"),
        (b"\n", "unknown request ''"),
    ],
)
def test_anything_else_is_refused_with_why(line: bytes, why: str) -> None:
    with pytest.raises(RequestError, match=why.replace("(", r"\(").replace("$", r"\$")):
        parse(line)
    assert answer(line, apply=_never, sshd=_running).startswith(b"error: ")


def _never(name: str) -> None:
    raise AssertionError(f"a refused request reached the hostname: {name!r}")


def _running() -> None:
    return None


def test_a_wake_sets_the_clock_and_the_seed_then_checks_sshd() -> None:
    woken: list[tuple[int, bytes]] = []

    def wake(clock: int, seed: bytes) -> None:
        woken.append((clock, seed))

    line = f"wake 1764190000123456789 {'ab' * 32}\n".encode()
    assert answer(line, apply=_never, sshd=_running, woken=wake) == b"ok\n"
    assert woken == [(1764190000123456789, b"\xab" * 32)]
    dead = answer(line, apply=_never, sshd=lambda: "sshd is not running", woken=wake)
    assert dead == b"error: sshd is not running\n"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (f"wake x {'ab' * 32}\n", "is not a clock"),
        (f"wake -1 {'ab' * 32}\n", "is not a clock"),
        (f"wake {'1' * 21} {'ab' * 32}\n", "is not a clock"),
        ("wake 17\n", "the seed is not 32 bytes"),
        (f"wake 17 {'ab' * 31}\n", "the seed is not 32 bytes"),
        (f"wake 17 {'AB' * 32}\n", "the seed is not 32 bytes"),
        (f"wake 17 {'ab' * 32};reboot\n", "the seed is not 32 bytes"),
    ],
)
def test_a_wake_takes_only_a_clock_and_a_seed(line: str, why: str) -> None:
    with pytest.raises(RequestError, match=why):
        parse(line.encode())

    def never(_clock: int, _seed: bytes) -> None:
        raise AssertionError("a refused wake reached the clock")

    assert answer(line.encode(), apply=_never, sshd=_running, woken=never).startswith(b"error: ")


def test_the_client_wakes_a_guest_with_this_hosts_time(tmp_path: Path) -> None:
    """The host sends its clock and fresh bytes; an older guest's refusal is False (the
    caller falls back to SSH)."""
    path = tmp_path / "control.sock"
    seen: list[tuple[int, bytes]] = []

    def wake(clock: int, seed: bytes) -> None:
        seen.append((clock, seed))

    before = time.time_ns()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def reply() -> None:
        conn, _ = server.accept()
        with conn:
            line = conn.makefile("rb").readline()
            conn.sendall(answer(line, apply=_never, sshd=_running, woken=wake))
        server.close()

    thread = threading.Thread(target=reply, daemon=True)
    thread.start()
    assert control.wake(path, guest="box") is True
    thread.join()
    assert before <= seen[0][0] <= time.time_ns() and len(seen[0][1]) == 32
    path.unlink()
    old = b"error: unknown request 'wake' (they are 'claim NAME', 'hostname NAME')\n"
    thread = _one_answer(path, old)
    assert control.wake(path, guest="box") is False
    thread.join()


def test_a_parked_claim_wakes_and_claims_in_one_exchange(tmp_path: Path) -> None:
    """Both requests go on one connection and both answers come back on it; a claim the
    guest refuses (its sshd died) fails the wake."""
    path = tmp_path / "control.sock"
    names: list[str] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def reply(sshd: Callable[[], str | None]) -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as lines:
            for _ in range(2):
                line = lines.readline()
                conn.sendall(answer(line, apply=names.append, sshd=sshd, woken=_woken))

    thread = threading.Thread(target=reply, args=(_running,), daemon=True)
    thread.start()
    assert control.wake(path, guest="pool-1", claim="box") is True
    thread.join()
    assert names == ["box"]
    thread = threading.Thread(target=reply, args=(lambda: "sshd is not running",), daemon=True)
    thread.start()
    with pytest.raises(FailedPrecondition, match="sshd is not running"):
        control.wake(path, guest="pool-1", claim="box")
    thread.join()
    server.close()


def _woken(_clock: int, _seed: bytes) -> None:
    """A wake that sets nothing (the clock and the seed are the kernel's business)."""


def test_a_claim_takes_the_name_only_while_sshd_runs() -> None:
    names: list[str] = []
    assert answer(b"claim box\n", apply=names.append, sshd=_running) == b"ok\n"
    dead = answer(b"claim box\n", apply=_never, sshd=lambda: "sshd is not running (no pid)")
    assert dead == b"error: sshd is not running (no pid)\n"
    # the hostname alone, as older hosts ask, does not look at sshd
    assert answer(b"hostname box\n", apply=names.append, sshd=lambda: "dead") == b"ok\n"
    assert names == ["box", "box"]


def test_sshd_runs_when_its_pid_files_process_is_an_sshd(tmp_path: Path) -> None:
    pid_file, proc = tmp_path / "sshd.pid", tmp_path / "proc"
    assert "sshd is not running" in (guest_control.sshd_running(pid_file, proc) or "")
    pid_file.write_text("123\n")
    assert "sshd is not running" in (guest_control.sshd_running(pid_file, proc) or "")
    (proc / "123").mkdir(parents=True)
    (proc / "123" / "comm").write_text("bash\n")
    assert "process 123 of" in (guest_control.sshd_running(pid_file, proc) or "")
    (proc / "123" / "comm").write_text("sshd\n")
    assert guest_control.sshd_running(pid_file, proc) is None
    pid_file.write_text("garbage\n")
    assert "sshd is not running" in (guest_control.sshd_running(pid_file, proc) or "")


def test_no_shell_or_program_anywhere_in_the_guest_tool() -> None:
    """The guest side starts no program at all: no subprocess, os.system/exec*/spawn*/popen."""
    tree = ast.parse(SOURCE.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert not imported & {"subprocess", "shlex", "pty", "multiprocessing"}
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }
    assert not {c for c in called if c == "system" or c.startswith(("exec", "spawn", "popen"))}


def test_the_hostname_goes_to_the_kernel_hostname_and_hosts(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hosts").write_text("127.0.0.1 localhost\n127.0.1.1 pool-ab12\n::1 ip6\n")
    kernel = tmp_path / "kernel-hostname"
    kernel.write_text("pool-ab12")
    set_hostname("box", tmp_path, kernel)
    assert kernel.read_text() == "box"
    assert (tmp_path / "etc/hostname").read_text() == "box\n"
    assert (tmp_path / "etc/hosts").read_text() == "127.0.0.1 localhost\n::1 ip6\n127.0.1.1 box\n"
    for name in ("hosts", "hostname"):
        assert stat.S_IMODE((tmp_path / "etc" / name).stat().st_mode) == 0o644
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == ["hostname", "hosts"]


def test_a_failed_write_is_answered_as_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-root"
    reply = answer(b"hostname box\n", apply=lambda n: set_hostname(n, missing, missing / "k"))
    assert reply.startswith(b"error: setting the hostname failed: ")


def test_the_port_is_found_by_its_name(tmp_path: Path) -> None:
    ports = (("vport1p1", "org.qemu.guest_agent.0"), ("vport2p1", guest_control.PORT_NAME))
    for port, name in ports:
        (tmp_path / port).mkdir()
        (tmp_path / port / "name").write_text(name + "\n")
    assert guest_control.find_port(tmp_path, wait=0) == "vport2p1"
    (tmp_path / "vport2p1" / "name").write_text("other\n")
    assert guest_control.find_port(tmp_path, wait=0) == ""


# -- the host's client against the guest's request loop -----------------------------------------


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A listening socket in a private folder; each connection is served by the guest tool's
    answer(), recording the names it would set."""
    folder = tmp_path / "sandbox"
    folder.mkdir(mode=0o700)
    path = folder / "control.sock"
    names: list[str] = []
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o775)  # as QEMU leaves it
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                line = conn.makefile("rb").readline()
                conn.sendall(answer(line, apply=names.append, sshd=_running))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, names
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept() (a close alone would not)
    server.close()
    thread.join()


def test_the_client_sets_the_hostname_and_tightens_the_socket(
    channel: tuple[Path, list[str]],
) -> None:
    path, names = channel
    control.set_hostname(path, "box-1", guest="pool-ab12")
    assert names == ["box-1"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_claim_sets_the_hostname(channel: tuple[Path, list[str]]) -> None:
    path, names = channel
    assert control.claim(path, "box-1", guest="pool-ab12") is True
    assert names == ["box-1"]


def _one_answer(path: Path, text: bytes) -> threading.Thread:
    """A stand-in guest on ``path`` that answers one request with ``text``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def reply() -> None:
        conn, _ = server.accept()
        with conn:
            conn.makefile("rb").readline()
            conn.sendall(text)
        server.close()

    thread = threading.Thread(target=reply, daemon=True)
    thread.start()
    return thread


def test_a_guest_of_an_older_build_is_told_apart_from_a_refusal(tmp_path: Path) -> None:
    """An older guest knows only ``hostname``: claim() says False (the caller falls back);
    a guest whose sshd is dead refuses: FAILED_PRECONDITION with its answer."""
    path = tmp_path / "control.sock"
    old = b"error: unknown request 'claim' (the only one is 'hostname NAME')\n"
    thread = _one_answer(path, old)
    assert control.claim(path, "box", guest="pool-ab12") is False
    thread.join()
    path.unlink()
    thread = _one_answer(path, answer(b"claim box\n", apply=_never, sshd=lambda: "sshd gone"))
    with pytest.raises(FailedPrecondition, match=r"refused hostname 'box' .*sshd gone") as caught:
        control.claim(path, "box", guest="pool-ab12")
    thread.join()
    assert caught.value.details["answer"] == "error: sshd gone"


def test_the_client_refuses_a_bad_name_before_sending(channel: tuple[Path, list[str]]) -> None:
    path, names = channel
    with pytest.raises(InvalidArgument, match=r"name 'x;reboot' is not valid"):
        control.set_hostname(path, "x;reboot", guest="pool-ab12")
    assert names == []


def test_a_guest_error_is_a_failed_precondition_naming_the_answer(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def refuse() -> None:
        conn, _ = server.accept()
        with conn:
            conn.makefile("rb").readline()
            conn.sendall(b"error: setting the hostname failed: Read-only file system\n")

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    with pytest.raises(FailedPrecondition, match=r"refused hostname 'box' .*Read-only") as caught:
        control.set_hostname(path, "box", guest="pool-ab12")
    thread.join()
    server.close()
    assert caught.value.details["guest"] == "pool-ab12"


def test_a_silent_guest_is_a_deadline(tmp_path: Path) -> None:
    """A guest whose server is not running: QEMU accepts the connection, nothing answers."""
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)
        with pytest.raises(DeadlineExceeded, match="did not answer on its control channel"):
            control.set_hostname(path, "box", guest="pool-ab12", timeout=0.2)


def test_no_socket_or_not_a_socket_is_a_failed_precondition(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="has no control channel"):
        control.set_hostname(tmp_path / "control.sock", "box", guest="pool-ab12")
    (tmp_path / "control.sock").symlink_to("/etc/passwd")
    with pytest.raises(FailedPrecondition, match="is not a socket"):
        control.set_hostname(tmp_path / "control.sock", "box", guest="pool-ab12")


def test_the_request_loop_answers_each_line_and_drops_an_overlong_one() -> None:
    """serve() in a child process of its own on one end of a socket pair (a stand-in for the
    port; its hostname writes go to a pipe): requests split across writes, two in one write,
    a refused one, and one longer than REQUEST_MAX (answered once, the rest of it dropped)."""
    host, port = socket.socketpair()
    names_r, names_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's exit status is what the parent checks)
        host.close()
        try:
            guest_control.serve(port.fileno(), apply=lambda n: os.write(names_w, n.encode() + b","))
        finally:
            os._exit(1)
    port.close()
    os.close(names_w)
    try:
        host.settimeout(30)  # a loop that stopped answering fails the test, never hangs it
        reader = host.makefile("rb")
        host.sendall(b"hostname bo")
        host.sendall(b"x-1\nhostname x;id\nhostname y\n")
        assert [reader.readline() for _ in range(3)][::2] == [b"ok\n", b"ok\n"]
        host.sendall(b"hostname " + b"a" * guest_control.REQUEST_MAX + b"\n")
        assert reader.readline().startswith(b"error: a request is at most")
        host.sendall(b"reboot\n")
        assert reader.readline().startswith(b"error: unknown request 'reboot'")
        assert os.read(names_r, 100) == b"box-1,y,"
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
        os.close(names_r)
        host.close()


def test_restrict_makes_the_socket_the_owners_alone(tmp_path: Path) -> None:
    """QEMU makes the host end group-writable (0775 under umask 0): start makes it 0600."""
    path = tmp_path / "control.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        os.chmod(path, 0o775)
        control.restrict(path)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
    control.restrict(tmp_path / "absent.sock")  # no channel: nothing to do
    plain = tmp_path / "plain"
    plain.write_text("")
    os.chmod(plain, 0o644)
    control.restrict(plain)  # not a socket: left alone
    assert stat.S_IMODE(plain.stat().st_mode) == 0o644
