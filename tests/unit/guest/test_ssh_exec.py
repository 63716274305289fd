"""What ``exec`` learns from the guest's sshd: the exit status, or the signal that killed the
command (sshd's ``exit-signal`` request, which paramiko itself ignores: the status stayed -1
and the CLI exited 255 without a word; issue 42, point 6)."""

from __future__ import annotations

import threading
from typing import Any

import paramiko

from vmsandbox.guest import ssh


class Channel:
    def __init__(self) -> None:
        self.exit_status = -1
        self.status_event = threading.Event()
        self.passed: list[str] = []


def request(*fields: Any) -> paramiko.Message:
    message = paramiko.Message()
    for value in fields:
        if isinstance(value, bool):
            message.add_boolean(value)
        else:
            message.add_string(value)
    message.rewind()
    return message


def handler() -> Any:
    ssh._paramiko()  # installs the handler
    return paramiko.Transport._channel_handler_table[paramiko.common.MSG_CHANNEL_REQUEST]


def test_exit_signal_sets_the_signal_and_a_shells_exit_status() -> None:
    channel = Channel()
    handler()(channel, request("exit-signal", False, "KILL", False, "", ""))
    assert channel.exit_signal == "KILL"  # type: ignore[attr-defined]
    assert channel.exit_status == 128 + 9 and channel.status_event.is_set()


def test_an_unknown_signal_reads_as_255_with_its_name() -> None:
    channel = Channel()
    handler()(channel, request("exit-signal", False, "NOSUCH", False, "", ""))
    assert (channel.exit_signal, channel.exit_status) == ("NOSUCH", 255)  # type: ignore[attr-defined]


def test_other_requests_reach_paramikos_own_handler() -> None:
    channel = Channel()
    channel.transport = type("T", (), {"server_object": None, "_send_user_message": print})()
    message = paramiko.Message()
    message.add_string("exit-status")
    message.add_boolean(False)
    message.add_int(3)
    message.rewind()
    handler()(channel, message)
    assert channel.exit_status == 3 and channel.status_event.is_set()


def test_the_handler_is_installed_once() -> None:
    first = handler()
    ssh._paramiko()
    assert handler() is first


def test_an_exec_result_says_how_the_command_ended() -> None:
    result = ssh.ExecResult(137, "", "", "KILL")
    assert result.to_dict() == {"exit_status": 137, "signal": "KILL", "stdout": "", "stderr": ""}
