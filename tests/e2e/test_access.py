"""What people and agents do with a running sandbox, on the session's shared guest: files in and
out (hostile names, links and full disks included), ssh-config used by the real ssh and scp,
OpenSSH options, port forwards, exec with environment, folder, user and input, output streamed
as it comes, and the console log."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework.sandboxes import cli, cli_env

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, NotFound, ResourceExhausted
from vmsandbox.guest.keys import generate
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager

ODD_NAMES = ["with space", 'it\'s "quoted"', "new\nline", "..dots", "a..b", "-dash", "ünï"]


def guest(manager: SandboxManager, box: Sandbox, line: str, *, user: str | None = None) -> str:
    done = manager.exec(box.name, line, user=user, timeout=120)
    assert done.exit_status == 0, done.stderr
    return done.stdout


@pytest.fixture
def home(manager: SandboxManager, booted: Sandbox) -> Iterator[str]:
    """A fresh folder in the guest user's home, removed afterwards."""
    folder = f"t-{os.getpid()}-{time.monotonic_ns()}"
    guest(manager, booted, f"mkdir {folder}")
    yield folder
    guest(manager, booted, f"rm -rf {folder}")


def ctrl_c_works() -> None:
    """In the child: SIGINT's default action back, as in a terminal. A suite run in the
    background (``make test &``, nohup) has SIGINT ignored, children inherit that, and Python
    then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# -- files ------------------------------------------------------------------------------------


def test_cp_copies_a_folder_in_and_out_with_modes_links_and_odd_names(
    config: Config, booted: Sandbox, manager: SandboxManager, home: str, tmp_path: Path
) -> None:
    source = tmp_path / "tree"
    (source / "sub").mkdir(parents=True)
    for index, name in enumerate(ODD_NAMES):
        (source / "sub" / name).write_bytes(f"{index}:{name}".encode())
    (source / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (source / "run.sh").chmod(0o750)
    (source / "sub").chmod(0o700)
    (source / "inner").symlink_to("sub/..dots")
    (source / "outer").symlink_to("/etc/passwd")
    done = cli("cp", "--json", str(source), f"{booted.name}:{home}", config=config)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["files"], summary["directories"], summary["symlinks"]) == (8, 2, 1)
    assert [item["path"] for item in summary["skipped"]] == [str(source / "outer")]
    assert guest(manager, booted, f"{home}/tree/run.sh") == "ran\n"
    modes = guest(manager, booted, f"stat -c '%a %n' {home}/tree/run.sh {home}/tree/sub")
    assert modes.split("\n")[:2] == [f"750 {home}/tree/run.sh", f"700 {home}/tree/sub"]

    back = tmp_path / "back"
    back.mkdir()
    done = cli("cp", f"{booted.name}:{home}/tree", str(back), config=config)
    assert done.returncode == 0, done.stderr
    for index, name in enumerate(ODD_NAMES):
        assert (back / "tree" / "sub" / name).read_bytes() == f"{index}:{name}".encode()
    assert stat.S_IMODE((back / "tree" / "run.sh").stat().st_mode) == 0o750
    assert stat.S_IMODE((back / "tree" / "sub").stat().st_mode) == 0o700
    assert os.readlink(back / "tree" / "inner") == "sub/..dots"
    assert not (back / "tree" / "outer").exists()


def test_bytes_and_streams_go_in_and_out_in_pieces(
    booted: Sandbox, manager: SandboxManager, home: str
) -> None:
    manager.upload(booted.name, b"small\x00bytes", f"{home}/small.bin", mode=0o600)
    sink = io.BytesIO()
    manager.download(booted.name, f"{home}/small.bin", sink)
    assert sink.getvalue() == b"small\x00bytes"
    assert guest(manager, booted, f"stat -c %a {home}/small.bin") == "600\n"

    class Pieces(io.RawIOBase):
        """12 MiB handed out 64 KiB at a time, never as one buffer; counts the largest read."""

        def __init__(self) -> None:
            self.left, self.largest = 12 * 2**20, 0

        def readable(self) -> bool:
            return True

        def read(self, size: int = -1) -> bytes:
            size = 65536 if size < 0 else min(size, 65536)
            self.largest = max(self.largest, size)
            piece = b"x" * min(size, self.left)
            self.left -= len(piece)
            return piece

    stream = Pieces()
    summary = manager.upload(booted.name, stream, f"{home}/big.bin")  # type: ignore[arg-type]
    assert summary.bytes == 12 * 2**20 and stream.largest <= 65536
    assert guest(manager, booted, f"wc -c < {home}/big.bin") == f"{12 * 2**20}\n"

    class Counting(io.RawIOBase):
        def __init__(self) -> None:
            self.total, self.largest = 0, 0

        def writable(self) -> bool:
            return True

        def write(self, data: bytes) -> int:  # type: ignore[override]
            self.total += len(data)
            self.largest = max(self.largest, len(data))
            return len(data)

    counting = Counting()
    manager.download(booted.name, f"{home}/big.bin", counting)  # type: ignore[arg-type]
    assert counting.total == 12 * 2**20 and counting.largest <= 2**20


def test_a_guest_link_out_of_the_folder_never_makes_a_download_write_outside(
    booted: Sandbox, manager: SandboxManager, home: str, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    guest(
        manager,
        booted,
        f"mkdir -p {home}/d/sub && echo in > {home}/d/sub/f && ln -s /tmp {home}/d/abs && "
        f"ln -s ../../.. {home}/d/up && ln -s sub {home}/d/inside && ln -s sub/f {home}/d/file",
    )
    dest = tmp_path / "dest"
    dest.mkdir()
    summary = manager.download(booted.name, f"{home}/d", dest)
    assert sorted(item["path"].rsplit("/", 1)[1] for item in summary.skipped) == ["abs", "up"]
    assert os.readlink(dest / "d" / "inside") == "sub" and (dest / "d" / "file").read_text()
    assert not (dest / "d" / "abs").exists() and not (dest / "d" / "up").is_symlink()
    # A link already in the destination, where the guest has a folder: refused, not followed.
    again = tmp_path / "again"
    (again / "d").mkdir(parents=True)
    (again / "d" / "sub").symlink_to(outside)
    with pytest.raises(FailedPrecondition, match="in the way"):
        manager.download(booted.name, f"{home}/d", again)
    assert list(outside.iterdir()) == []


def test_missing_paths_and_denied_ones_say_which_side(
    config: Config, booted: Sandbox, manager: SandboxManager, tmp_path: Path
) -> None:
    with pytest.raises(NotFound, match="does not exist in the guest") as caught:
        manager.download(booted.name, "/no/such/file", tmp_path)
    assert caught.value.details["side"] == "guest"
    with pytest.raises(NotFound, match="does not exist on this host") as caught:
        manager.upload(booted.name, tmp_path / "nothing", "/tmp")
    assert caught.value.details["side"] == "host"
    with pytest.raises(NotFound, match="no such folder in the guest"):
        manager.upload(booted.name, b"x", "/no/such/folder/file")
    with pytest.raises(FailedPrecondition, match="permission denied in the guest"):
        manager.download(booted.name, "/etc/shadow", tmp_path)
    done = cli("cp", str(tmp_path), f"{booted.name}:/root/", config=config)
    assert done.returncode == 5 and "permission denied in the guest" in done.stderr
    done = cli("cp", "./no:such", f"{booted.name}:", config=config)
    assert done.returncode == 3 and "on this host" in done.stderr


def test_a_file_larger_than_the_guests_free_space_leaves_nothing(
    booted: Sandbox, manager: SandboxManager, tmp_path: Path
) -> None:
    small = f"/mnt/small-{os.getpid()}"
    guest(
        manager,
        booted,
        f"mkdir -p {small} && mount -t tmpfs -o size=1m,mode=1777 t {small}",
        user="root",
    )
    try:
        big = tmp_path / "big.bin"
        big.write_bytes(os.urandom(3 * 2**20))
        with pytest.raises(ResourceExhausted, match="not enough space in the guest"):
            manager.upload(booted.name, big, f"{small}/big.bin")
        with pytest.raises(ResourceExhausted, match="ran out of space"):
            manager.upload(booted.name, _Unsized(big), f"{small}/s.bin")  # type: ignore[arg-type]
        assert guest(manager, booted, f"ls -A {small}") == ""
    finally:
        guest(manager, booted, f"umount {small} && rmdir {small}", user="root")


class _Unsized(io.RawIOBase):
    """A file read as a stream whose size nobody tells in advance."""

    def __init__(self, path: Path) -> None:
        self.handle = path.open("rb")

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self.handle.read(size)


# -- OpenSSH ----------------------------------------------------------------------------------


def test_ssh_config_is_what_ssh_and_scp_need(
    config: Config, booted: Sandbox, tmp_path: Path
) -> None:
    done = cli("ssh-config", "--prefix", "vm-", booted.name, config=config)
    assert done.returncode == 0, done.stderr
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(done.stdout)
    alias = f"vm-{booted.name}"
    ran = subprocess.run(
        ["ssh", "-F", str(ssh_config), alias, "echo", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (ran.returncode, ran.stdout) == (0, "hello\n"), ran.stderr
    (tmp_path / "f").write_text("via scp")
    for argv in (
        ["scp", "-F", str(ssh_config), str(tmp_path / "f"), f"{alias}:scp-test"],
        ["scp", "-F", str(ssh_config), f"{alias}:scp-test", str(tmp_path / "g")],
    ):
        ran = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "g").read_text() == "via scp"
    # The pinning holds: another known host key for the alias fails the connection.
    keys = next(line for line in done.stdout.splitlines() if "UserKnownHostsFile" in line)
    wrong = tmp_path / "known_hosts"
    alias_pinned = Path(keys.split()[1]).read_text().split()[0]
    other = generate("another guest").public_openssh.split()[:2]
    wrong.write_text(f"{alias_pinned} {other[0]} {other[1]}\n")
    ssh_config.write_text(done.stdout.replace(keys.split()[1], str(wrong)))
    ran = subprocess.run(
        ["ssh", "-F", str(ssh_config), alias, "true"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 255


def test_ssh_passes_options_and_refuses_agent_forwarding(config: Config, booted: Sandbox) -> None:
    env = cli_env(config)
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "vmsandbox.cli",
            "ssh",
            booted.name,
            "-q",
            "-o",
            "ConnectTimeout=60",
            "--",
            "echo",
            "opts",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert (ran.returncode, ran.stdout) == (0, "opts\n"), ran.stderr
    for words in (["-A"], ["-o", "ForwardAgent=yes"], ["-o", "StrictHostKeyChecking=no"]):
        done = cli("ssh", booted.name, *words, "--", "true", config=config)
        assert done.returncode == 2 and "INVALID_ARGUMENT" in done.stderr, words


# -- ports ------------------------------------------------------------------------------------


def _banner(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        return conn.recv(64)


def test_a_forward_reaches_a_guest_service_and_survives_a_closed_port(
    booted: Sandbox, manager: SandboxManager
) -> None:
    events: list[str] = []
    with manager.forward(booted.name, "0:22", "0:9", on_event=events.append) as fwd:
        ssh_port, closed_port = (forward.port for forward in fwd.listening)
        assert all(forward.address == "127.0.0.1" for forward in fwd.listening)
        assert _banner(ssh_port).startswith(b"SSH-2.0-")
        with socket.create_connection(("127.0.0.1", closed_port), timeout=60) as conn:
            conn.settimeout(60)
            assert conn.recv(64) == b""  # closed by the forwarder
        deadline = time.monotonic() + 30
        while not events and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "nothing listens on guest port 9" in events[0]
        assert _banner(ssh_port).startswith(b"SSH-2.0-")  # still forwarding


def test_the_forward_command_says_where_it_listens_and_stops_on_ctrl_c(
    config: Config, booted: Sandbox
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vmsandbox.cli", "forward", "--json", booted.name, "0:22"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(config),
        preexec_fn=ctrl_c_works,
    )
    try:
        assert proc.stdout is not None
        lines = []
        while not lines or lines[-1] != "}\n":
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            lines.append(line)
        [forward] = json.loads("".join(lines))["forwards"]
        assert forward["address"] == "127.0.0.1" and forward["remote_port"] == 22
        assert _banner(forward["port"]).startswith(b"SSH-2.0-")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


# -- commands ---------------------------------------------------------------------------------


def test_exec_takes_env_cwd_user_and_stdin(config: Config, booted: Sandbox) -> None:
    env = cli_env(config)
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "vmsandbox.cli",
            "exec",
            booted.name,
            "--env",
            'GREETING=it\'s "hi" $HOME',
            "--cwd",
            "/tmp",
            "--",
            "sh",
            "-c",
            'pwd; printf "%s\\n" "$GREETING"; cat',
        ],
        input="from stdin\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == '/tmp\nit\'s "hi" $HOME\nfrom stdin\n'
    done = cli("exec", booted.name, "--user", "root", "--", "id", "-u", config=config)
    assert (done.returncode, done.stdout) == (0, "0\n")
    done = cli("exec", booted.name, "--env", "1BAD=x", "--", "true", config=config)
    assert done.returncode == 2 and "env name '1BAD'" in done.stderr
    done = cli("exec", booted.name, "--cwd", "/no/such", "--", "true", config=config)
    assert done.returncode == 1


def test_stream_hands_output_over_as_it_comes(booted: Sandbox, manager: SandboxManager) -> None:
    seen: list[tuple[float, str, bytes]] = []
    start = time.monotonic()
    with manager.stream(booted.name, "echo first; echo oops >&2; sleep 3; echo last") as running:
        for piece in running:
            seen.append((time.monotonic() - start, piece.stream, piece.data))
    assert running.exit_status == 0
    streams = {
        stream: b"".join(d for _t, s, d in seen if s == stream) for stream in ("stdout", "stderr")
    }
    assert streams == {"stdout": b"first\nlast\n", "stderr": b"oops\n"}
    first = next(t for t, s, d in seen if d.startswith(b"first"))
    assert seen[-1][0] - first >= 2.5  # "first" arrived before the command slept


# -- console ----------------------------------------------------------------------------------


def test_logs_print_the_console_and_follow_it(config: Config, booted: Sandbox) -> None:
    done = cli("logs", booted.name, config=config)
    assert done.returncode == 0 and "vmsandbox-boot: " in done.stdout  # the boot's own lines
    assert "\x1b" not in done.stdout
    done = cli("logs", booted.name, "--lines", "3", "--json", config=config)
    assert len(json.loads(done.stdout)["lines"]) == 3
    proc = subprocess.Popen(
        [sys.executable, "-m", "vmsandbox.cli", "logs", booted.name, "--follow", "--lines", "2"],
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(config),
        preexec_fn=ctrl_c_works,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() and proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
