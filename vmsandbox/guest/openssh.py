"""The OpenSSH client's side of a sandbox: the ``ssh`` command line that logs in with the pinned
host key, the options a user may add to it, and ``Host`` stanzas for an ssh_config that give
``ssh -F``, scp, rsync, VS Code Remote-SSH and Ansible the same pinning.

Both pin the way the Python client does (ssh.py): the sandbox's own key only, its host key
from its ``known_hosts`` under its ``HostKeyAlias``, strict checking, no password, no agent.
OpenSSH takes the first value it is given for an option, and these come first, so no option a
user adds can turn host key checking off; the ones that would try are refused outright.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vmsandbox.errors import InvalidArgument
from vmsandbox.guest.keys import SandboxKeys
from vmsandbox.guest.ssh import Endpoint

# ssh(1)'s options: those that take an argument, and those that do not (OpenSSH 9).
_WITH_ARGUMENT = frozenset("BbcDEeFIiJLlmOoPpQRSWw")
_FLAGS = frozenset("46AaCfGgKkMNnqsTtVvXxYy")
# -o keywords that would loosen or move the host key pinning (lowercase, as ssh compares them).
_PINNING = frozenset(
    {
        "stricthostkeychecking",
        "userknownhostsfile",
        "globalknownhostsfile",
        "hostkeyalias",
        "knownhostscommand",
        "updatehostkeys",
        "verifyhostkeydns",
        "hostkeyalgorithms",
    }
)
AGENT_HINT = "add --allow-agent-forwarding to hand the guest your SSH agent"


def quote_value(value: str | Path, field: str) -> str:
    """A path or value as an ssh_config argument (and ``-o`` value): ``%`` doubled, since
    OpenSSH expands %-tokens in file names; double-quoted when it holds spaces. INVALID_ARGUMENT
    for what no ssh_config line can carry (a double quote, a line break, a control character)."""
    text = str(value)
    if '"' in text or any(not ch.isprintable() for ch in text):
        raise InvalidArgument(
            f"{field} {text!r} cannot be written in an ssh_config line: it holds a double "
            "quote or a control character",
            details={"field": field, "value": repr(text)},
        )
    text = text.replace("%", "%%")
    return f'"{text}"' if any(ch.isspace() for ch in text) else text


def pinned_options(keys: SandboxKeys, *, forward_agent: bool = False) -> list[tuple[str, str]]:
    """The ssh_config keywords and values that reach a sandbox with its key and pinned host
    key only (no agent keys, no password, no agent forwarding unless ``forward_agent``)."""
    return [
        ("IdentityFile", quote_value(keys.client_key, "IdentityFile")),
        ("IdentitiesOnly", "yes"),
        ("IdentityAgent", "none"),
        ("UserKnownHostsFile", quote_value(keys.known_hosts, "UserKnownHostsFile")),
        ("GlobalKnownHostsFile", "/dev/null"),
        ("HostKeyAlias", quote_value(keys.host_alias, "HostKeyAlias")),
        ("StrictHostKeyChecking", "yes"),
        ("UpdateHostKeys", "no"),
        ("PasswordAuthentication", "no"),
        ("ForwardAgent", "yes" if forward_agent else "no"),
    ]


def ssh_argv(
    endpoint: Endpoint,
    keys: SandboxKeys,
    command: Sequence[str] = (),
    *,
    options: Sequence[str] = (),
    forward_agent: bool = False,
) -> list[str]:
    """The OpenSSH command line that logs into ``endpoint`` with the pinned host key only;
    ``options`` (checked with ``check_options``) come after the pinning, which they cannot
    change, and ``forward_agent`` allows agent forwarding."""
    argv = ["ssh"]
    for keyword, value in pinned_options(keys, forward_agent=forward_agent):
        argv += ["-o", f"{keyword}={value}"]
    argv += [*check_options(options, allow_agent=forward_agent), "-p", str(endpoint.port)]
    argv += ["-l", endpoint.user, endpoint.host]
    return argv + (["--", *command] if command else [])


def split_options(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """OpenSSH options first, then the words of a command (from the first word that is not an
    option): ``-L 8080:localhost:80 -N`` and ``uname -a`` alike."""
    options: list[str] = []
    index = 0
    while index < len(words) and words[index].startswith("-") and words[index] != "-":
        word = words[index]
        options.append(word)
        index += 1
        letters = word[1:]
        for at, letter in enumerate(letters):
            if letter in _WITH_ARGUMENT:
                if at == len(letters) - 1 and index < len(words):  # its value is the next word
                    options.append(words[index])
                    index += 1
                break
    return options, list(words[index:])


def check_options(options: Sequence[str], *, allow_agent: bool = False) -> list[str]:
    """``options`` for ssh(1), as given once checked: INVALID_ARGUMENT for an option ssh does
    not have, one without its value, one that would change the host key pinning, and agent
    forwarding (``-A``, ``-o ForwardAgent``) unless ``allow_agent``."""
    checked: list[str] = []
    index = 0
    while index < len(options):
        word = options[index]
        index += 1
        checked.append(word)
        if not word.startswith("-") or word in ("-", "--"):
            raise InvalidArgument(
                f"{word!r} is not an OpenSSH option; write the command after '--'",
                details={"field": "ssh options", "value": word},
            )
        letters = word[1:]
        for at, letter in enumerate(letters):
            if letter not in _WITH_ARGUMENT | _FLAGS:
                raise InvalidArgument(
                    f"-{letter} is not an option of ssh(1)",
                    details={"field": "ssh options", "value": word},
                )
            if letter == "A" and not allow_agent:
                raise InvalidArgument(
                    f"agent forwarding (-A) is off for sandboxes: {AGENT_HINT}",
                    details={"field": "ssh options", "value": word},
                )
            if letter in _WITH_ARGUMENT:
                value = letters[at + 1 :]  # glued (-L8080:localhost:80), else the next word
                if not value:
                    if index == len(options):
                        raise InvalidArgument(
                            f"ssh option -{letter} needs a value",
                            details={"field": "ssh options", "value": word},
                        )
                    value = options[index]
                    checked.append(value)
                    index += 1
                if letter == "o":
                    _check_setting(value, allow_agent)
                break
    return checked


def _check_setting(setting: str, allow_agent: bool) -> None:
    """One ``-o Keyword=value`` (or ``-o "Keyword value"``)."""
    match = re.match(r"\s*([A-Za-z]*)\s*(?:=\s*|\s+|$)(.*)", setting, re.DOTALL)
    keyword, value = (match.group(1).lower(), match.group(2)) if match else ("", "")
    if keyword in _PINNING:
        raise InvalidArgument(
            f"-o {setting!r}: vmsandbox pins each sandbox's host key, and {keyword} would "
            "change that",
            details={"field": "ssh options", "value": setting},
        )
    if keyword == "forwardagent" and value.strip().lower() != "no" and not allow_agent:
        raise InvalidArgument(
            f"-o {setting!r}: agent forwarding is off for sandboxes: {AGENT_HINT}",
            details={"field": "ssh options", "value": setting},
        )


@dataclass(frozen=True)
class HostEntry:
    """One sandbox as an ssh_config ``Host``: the alias to type, where and how to log in."""

    alias: str
    endpoint: Endpoint
    keys: SandboxKeys


def render_config(entries: Iterable[HostEntry]) -> str:
    """``Host`` stanzas for ``entries``, one blank line between them."""
    stanzas = []
    for entry in entries:
        lines = [
            f"Host {quote_value(entry.alias, 'Host')}",
            f"  HostName {entry.endpoint.host}",
            f"  Port {entry.endpoint.port}",
            f"  User {quote_value(entry.endpoint.user, 'User')}",
            *(f"  {keyword} {value}" for keyword, value in pinned_options(entry.keys)),
        ]
        stanzas.append("\n".join(lines) + "\n")
    return "\n".join(stanzas)
