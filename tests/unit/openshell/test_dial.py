"""A client of the driver's socket speaks only to a server of a trusted uid (openshell/dial.py):
a local user who binds the socket path while the driver is down receives nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.openshell_client import in_process

from vmsandbox.errors import FailedPrecondition
from vmsandbox.fleet.join import read_host

OTHER = 65534

# A listener bound by another user: it counts the bytes it receives (a stolen call).
_IMPOSTOR = """
import socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(4)
print("listening", flush=True)
got = 0
server.settimeout(3)
try:
    while True:
        conn, _ = server.accept()
        conn.settimeout(1)
        try:
            while data := conn.recv(65536):
                got += len(data)
        except OSError:
            pass
except OSError:
    pass
print(got, flush=True)
"""


@pytest.fixture
def public_folder() -> Iterator[Path]:
    """A folder anyone may write to, as /tmp is."""
    folder = Path(tempfile.mkdtemp(prefix="vmsbx-dial-"))
    os.chmod(folder, 0o1777)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="binds a socket as another uid: needs root")
def test_a_socket_bound_by_another_user_receives_nothing(public_folder: Path) -> None:
    path = public_folder / "driver.sock"
    impostor = subprocess.Popen(
        [sys.executable, "-c", _IMPOSTOR, str(path)],
        user=OTHER,
        group=OTHER,
        extra_groups=[],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert impostor.stdout is not None and impostor.stdout.readline().strip() == "listening"
    with pytest.raises(FailedPrecondition, match=f"runs as uid {OTHER}"):
        read_host(str(path), timeout=2, wait=False)
    out, _ = impostor.communicate(timeout=30)
    assert out.strip() == "0"


def test_the_driver_of_our_own_uid_answers(tmp_path: Path) -> None:
    started = time.monotonic()
    with in_process(unit_config(tmp_path), FakeHypervisor()) as path:
        info = read_host(str(path), timeout=30, wait=False)
    assert info["schema"] == 1 and info["sandboxes"] == []
    assert time.monotonic() - started < 30
