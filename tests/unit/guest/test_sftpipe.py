"""The SFTP session of a copy: what a copy says when the guest does not answer."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from vmsandbox.errors import Unavailable
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.guest.sftpipe import open_session
from vmsandbox.guest.ssh import Endpoint


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("via", ["openssh", "paramiko"])
def test_a_guest_that_does_not_answer_is_unavailable_with_the_reason(
    tmp_path: Path, via: str
) -> None:
    """UNAVAILABLE naming the address and why, never an internal error (the OpenSSH pipe
    once read ssh's last words after closing the pipe they come through)."""
    port = _closed_port()
    keys, _client, _host = SandboxKeys.create(tmp_path / "box", "vmsbx-box")
    with pytest.raises(Unavailable, match=rf"127\.0\.0\.1:{port}.*[Cc]onnect"):
        open_session(Endpoint("127.0.0.1", port, "sandbox"), keys, via=via)
