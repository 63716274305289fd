"""A suspended GPU sandbox resumed onto another card, on the nested GPU host with two cards of
one model (``setup/nested.sh`` with ``VMSANDBOX_NESTED_CARDS=twin``: two Rage 128 Pros).

Sandbox A takes one card (the first free by address) and writes a token into its guest's
memory (``/dev/shm``); A is suspended, which detaches and sanitizes its card; sandbox B is
created and takes that card (now again the first free); A is resumed, which can only take the
other card, attached at A's old guest slot. Everything is looked at in one go
(``HandOverRun``); the test module (tests/e2e/test_nested_suspend.py) asserts on it and
bench/suspend.py reports its figures.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from subprocess import CompletedProcess
from typing import Any

from framework.nested_host import NestedHost

from vmsandbox.sandbox.spec import generate_name

SMALL = ("--memory", "512", "--timeout", "420")  # L1 has 3 GiB; an L2 boots in about a minute
CREATE_LIMIT = 600.0
RAGE128P = ("0x1002", "0x5046")
TOKEN_FILE = "/dev/shm/handover-token"
# What A's guest shows: its token, its boot ID, and the PCI vendor and device ids it sees.
LOOK = (
    f"cat {TOKEN_FILE}; cat /proc/sys/kernel/random/boot_id;"
    " for d in /sys/bus/pci/devices/*; do echo $(cat $d/vendor) $(cat $d/device); done"
)
SANITIZE_LOG = "/var/lib/vmsandbox/custody/sanitize.jsonl"

Done = CompletedProcess[str]


@dataclass
class GuestView:
    """What A's guest showed at one moment."""

    token: str
    boot_id: str
    ids: list[tuple[str, ...]]


@dataclass
class HandOverRun:
    """What one L1 showed of A suspended, its card given to B, and A resumed."""

    a: str
    b: str
    token: str
    create_a: Done
    view_before: GuestView | None = None
    suspend: Done | None = None
    suspend_s: float = 0.0
    inventory_suspended: dict[str, Any] = field(default_factory=dict)
    sanitized: list[dict[str, Any]] = field(default_factory=list)
    create_b: Done | None = None
    resume: Done | None = None
    resume_s: float = 0.0
    view_after: GuestView | None = None
    verify: Done | None = None
    destroys: dict[str, Done] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    inventory_after: dict[str, Any] = field(default_factory=dict)


def json_of(done: Done | None) -> dict[str, Any]:
    """A command's JSON answer; fails naming the command when it did not succeed."""
    assert done is not None, "the step stopped before this command"
    assert done.returncode == 0, f"{' '.join(done.args)} failed:\n{done.stdout}\n{done.stderr}"
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def sandbox_of(done: Done | None) -> dict[str, Any]:
    """The sandbox a create (the sandbox itself) or a suspend or resume (a list) answered with."""
    answer = json_of(done)
    return dict(answer["sandboxes"][0]) if "sandboxes" in answer else answer


def vmsandbox(host: NestedHost, *args: str, limit: float = 300) -> Done:
    return host.run("vmsandbox", *args, limit=limit)


def look(host: NestedHost, name: str) -> GuestView | None:
    done = vmsandbox(host, "exec", name, "--", "sh", "-c", LOOK)
    if done.returncode != 0:
        return None
    token, boot_id, *ids = done.stdout.splitlines()
    return GuestView(token, boot_id, [tuple(line.split()) for line in ids])


def inventory(host: NestedHost) -> dict[str, Any]:
    done = vmsandbox(host, "gpus", "--json")
    return json.loads(done.stdout) if done.returncode == 0 else {}


def leftovers(host: NestedHost, names: list[str]) -> list[str]:
    """Domains and files of sandboxes ``names`` still in L1."""
    domains = host.run("virsh", "-q", "list", "--all", "--name").stdout.split()
    found = [f"domain {d}" for d in domains if d in {f"vmsbx-{n}" for n in names}]
    for name in names:
        files = host.run(
            "find", "/var/lib/vmsandbox", "/var/lib/libvirt/qemu/save", "-path",
            "/var/lib/vmsandbox/images", "-prune", "-o", "-name", f"*{name}*", "-print",
        )  # fmt: skip
        found += files.stdout.split()
    return found


def suspend_onto_the_other_card(host: NestedHost) -> HandOverRun:
    """The whole hand-over in the running L1 (module docstring); both sandboxes destroyed."""
    a, b = generate_name("a"), generate_name("b")
    token = secrets.token_hex(16)
    run = HandOverRun(a, b, token, vmsandbox(host, "--json", "create", a, "--gpu", "1", *SMALL,
                                             limit=CREATE_LIMIT))  # fmt: skip
    try:
        if run.create_a.returncode != 0:
            return run
        host.run("vmsandbox", "exec", a, "--", "sh", "-c", f"echo {token} > {TOKEN_FILE}")
        run.view_before = look(host, a)
        began = time.monotonic()
        run.suspend = vmsandbox(host, "--json", "suspend", a)
        run.suspend_s = time.monotonic() - began
        if run.suspend.returncode != 0:
            return run
        run.inventory_suspended = inventory(host)
        log = host.run("sh", "-c", f"cat {SANITIZE_LOG} 2>/dev/null || true").stdout
        run.sanitized = [json.loads(line) for line in log.splitlines() if line.strip()]
        run.create_b = vmsandbox(
            host, "--json", "create", b, "--gpu", "1", *SMALL, limit=CREATE_LIMIT
        )
        began = time.monotonic()
        run.resume = vmsandbox(host, "--json", "resume", a, limit=CREATE_LIMIT)
        run.resume_s = time.monotonic() - began
        if run.resume.returncode == 0:
            run.view_after = look(host, a)
            run.verify = vmsandbox(host, "--json", "verify", a)
    finally:
        run.destroys = {name: vmsandbox(host, "destroy", name) for name in (a, b)}
        run.leftovers = leftovers(host, [a, b])
        run.inventory_after = inventory(host)
    return run
