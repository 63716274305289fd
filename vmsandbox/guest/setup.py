"""What a sandbox's guest receives at first boot besides its user and keys: environment
variables for every process, files (secrets among them) and a main process run by a unit.

It travels in the NoCloud seed (``write_files`` and ``runcmd``; applied by cloud-init in stock
images, by the first-boot unit in the project's own), never in the domain XML or its metadata:
the seed ISO is written 0600 in a 0711 folder, so a secret in a file of this setup is readable
on the host by root only.

- ``environment`` is appended to /etc/environment, which pam_env gives every SSH session
  (``vmsandbox exec`` included), and written to ENVIRONMENT_FILE for systemd units.
- ``files`` are written with their mode and owner before any unit starts.
- ``main`` (a command as a list of words) is run by MAIN_UNIT as the sandbox user, with the
  environment; its exit status is readable with ``systemctl show MAIN_UNIT``.
- ``units`` are extra systemd units (name -> unit text), started at first boot; with
  ``autostart`` false they (and MAIN_UNIT) are only installed, for the caller to start (the
  OpenShell driver starts them once it has resolved the workload's identity in the guest).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from vmsandbox.errors import InvalidArgument

ENVIRONMENT_FILE = "/etc/vmsandbox/environment"
MAIN_UNIT = "vmsandbox-main.service"
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_UNIT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]*\.service\Z")
_MODE_RE = re.compile(r"^0[0-7]{3}\Z")


@dataclass(frozen=True)
class GuestFile:
    """One file for the guest: absolute path, text, octal mode string and ``user:group``."""

    path: str
    content: str = field(repr=False)  # may be a secret: never in a repr, a log or a traceback
    mode: str = "0644"
    owner: str = "root:root"
    base64: bool = False  # ``content`` is base64 (a binary file)

    def __post_init__(self) -> None:
        if not self.path.startswith("/") or "\0" in self.path or "/../" in self.path + "/":
            raise InvalidArgument(
                f"guest file path {self.path!r} must be absolute, without '..' or NUL",
                details={"field": "path", "value": self.path},
            )
        if not _MODE_RE.match(self.mode):
            raise InvalidArgument(
                f"guest file mode {self.mode!r} must be four octal digits such as '0600'",
                details={"field": "mode", "value": self.mode},
            )


@dataclass(frozen=True)
class GuestSetup:
    """Environment, files, main command and units for one guest (see the module docstring)."""

    environment: dict[str, str] = field(default_factory=dict)
    files: tuple[GuestFile, ...] = ()
    main: tuple[str, ...] = ()
    units: dict[str, str] = field(default_factory=dict)
    autostart: bool = True

    def __post_init__(self) -> None:
        for key, value in self.environment.items():
            check_environment(key, value, "environment")
        check_command(self.main)
        for name in self.units:
            if not _UNIT_RE.match(name) or name == MAIN_UNIT:
                raise InvalidArgument(
                    f"unit name {name!r} must be a NAME.service other than {MAIN_UNIT}",
                    details={"field": "units", "value": name},
                )

    def cloud_config(self, user: str) -> dict[str, Any]:
        """The ``write_files`` and ``runcmd`` entries of this setup, for the seed's user-data."""
        files = [_write(item) for item in self.files]
        if self.environment:
            lines = "".join(f"{key}={value}\n" for key, value in sorted(self.environment.items()))
            files.append({"path": "/etc/environment", "content": lines, "append": True})
        systemd_env = "".join(
            f"{key}={systemd_quoted(value)}\n" for key, value in sorted(self.environment.items())
        )
        files.append(_write(GuestFile(ENVIRONMENT_FILE, systemd_env)))
        units = dict(self.units)
        if self.main:
            units[MAIN_UNIT] = _main_unit(self.main, user)
        for name, text in sorted(units.items()):
            files.append(_write(GuestFile(f"/etc/systemd/system/{name}", text)))
        if not units:
            return {"write_files": files}
        runcmd = [["systemctl", "daemon-reload"]]
        if self.autostart:
            runcmd.append(["systemctl", "start", "--no-block", *units])
        return {"write_files": files, "runcmd": runcmd}


def check_environment(key: object, value: object, what: str) -> None:
    """An environment entry: a shell-style name, and a value one line long without NUL."""
    if not isinstance(key, str) or not _ENV_KEY_RE.match(key):
        raise InvalidArgument(
            f"{what} key {key!r} is not a variable name: use letters, digits and '_', "
            "not starting with a digit",
            details={"field": what, "value": repr(key)},
        )
    if not isinstance(value, str) or any(ch in value for ch in "\n\r\0"):
        raise InvalidArgument(
            f"{what} value of {key} must be one line of text without NUL (got {value!r})",
            details={"field": f"{what}.{key}"},
        )


def _write(item: GuestFile) -> dict[str, Any]:
    entry = {"path": item.path, "content": item.content, "permissions": item.mode}
    entry["owner"] = item.owner
    if item.base64:
        entry["encoding"] = "b64"
    return entry


def systemd_quoted(value: str) -> str:
    """A value for a systemd EnvironmentFile: double-quoted, backslash and quote escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def check_command(command: tuple[str, ...] | list[str], field: str = "command") -> None:
    """A command's words: strings without control characters (a tab is fine). A unit file is
    read line by line, so a line break in an ExecStart word would end it and add directives
    of the caller's choosing (``User=root`` after the workload's user); NUL ends the text."""
    for index, word in enumerate(command):
        if not isinstance(word, str) or any(_control(ch) for ch in word):
            raise InvalidArgument(
                f"{field}[{index}] is {word!r}: a command's words must be text without line "
                "breaks, NUL or other control characters (a tab is fine)",
                details={"field": field, "index": index},
            )


def _control(ch: str) -> bool:
    return (ch < " " and ch != "\t") or ch == "\x7f"


def exec_line(command: tuple[str, ...] | list[str]) -> str:
    """``command`` as a unit's ExecStart value: systemd parses it like a shell line, so shlex
    quoting survives it, with '%' and '$' escaped; words with control characters are refused
    (``check_command``)."""
    check_command(command)
    return shlex.join(command).replace("%", "%%").replace("$", "$$")


def _main_unit(command: tuple[str, ...], user: str) -> str:
    """The unit of the sandbox's main process: started once, never restarted, so its exit
    status stays readable (``systemctl show -p ExecMainStatus``)."""
    line = exec_line(command)
    return (
        "[Unit]\nDescription=vmsandbox main process\nAfter=network-online.target\n\n"
        f"[Service]\nType=exec\nUser={user}\nEnvironmentFile={ENVIRONMENT_FILE}\n"
        f"WorkingDirectory=~\nExecStart={line}\n"
    )
