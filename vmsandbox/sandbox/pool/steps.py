"""The warm pool's two paths, as steps (create.py): filling it, and claiming a guest from it.

``FILL_STEPS`` make a pooled guest: the create steps, with the shape's room checked in the
reservation (under the host lock: reservations of the shape count, guests still booting
too), ending in state ``pooled`` with a settled hold that names the shape (holds.py); a
``park`` shape's guest is saved to disk first and ends ``parked`` (park.py).

``CLAIM_STEPS`` turn a pooled guest into the sandbox: under the lock the name is checked, a
ready guest of the shape taken (its hold, current under the lock, must still be an unclaimed
pooled guest's: two claims never take one guest, and a drain never removes a claimed one),
the hold and the record rewritten for the sandbox; then, outside the lock, a parked guest is
restored and woken (park.py), and its hostname is
set through the guest's control channel or else over SSH. A GPU sandbox claims a GPU-ready
guest (spare root ports, gpu/hotplug.py) through ``GPU_CLAIM_STEPS``: its GPUs are chosen in
the same locked step as the guest, and attached live, seen and verified outside the lock
(gpu_steps.py). The claimed guest is addressed by its domain's UUID from then on; its undos
stop it (outside the lock), then remove it (under the lock, only while the claim owns it):
a half-claimed guest never returns to the pool. A claim that finds no guest has made nothing
and undoes nothing: the create boots cold.
"""

from __future__ import annotations

import shlex
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from vmsandbox.errors import FailedPrecondition
from vmsandbox.gpu.record import GpuRecord
from vmsandbox.guest import control, ssh
from vmsandbox.guest.ssh import Endpoint
from vmsandbox.sandbox import create, expiry, reserve
from vmsandbox.sandbox.holds import Hold, settled
from vmsandbox.sandbox.pool import gpu_steps, park
from vmsandbox.sandbox.pool.shapes import NoPooledGuest, holds
from vmsandbox.sandbox.record import (
    STATE_CREATING,
    STATE_PARKED,
    STATE_POOLED,
    SandboxFiles,
    SandboxRecord,
)

if TYPE_CHECKING:
    from vmsandbox.guest.keys import SandboxKeys
    from vmsandbox.vm.hypervisor import Stored


def _settle(c: create.Creation) -> None:
    """Fill: wait until the guest's boot has finished (late units such as cloud-init's last
    stages hold its vCPU): a claim then finds an idle guest that answers at once."""
    if not c.wait:
        return
    assert c.record is not None and c.endpoint is not None  # made by define and wait
    keys = c.files.keys(c.record.host_key_alias)
    c.progress(f"pooled guest {c.name} answers SSH; waiting for the rest of its boot")
    # As root first: the user's systemctl needs the system bus, which the project's images
    # start after sshd (it fails at once while the bus is not up); root's talks to systemd.
    wait = "systemctl is-system-running --wait"
    command = f"command -v systemctl >/dev/null && {{ sudo -n {wait} || {wait}; }}"
    ssh.run(c.endpoint, keys, f"{command} >/dev/null 2>&1; true", timeout=c.timeout or 300)


def _pooled(c: create.Creation) -> None:
    """Fill, under the lock: the guest answered SSH (and was parked, park.py); it is ready to
    be claimed. A parked guest's hold counts its save's size."""
    assert c.record is not None  # made by the define step
    hold = c.own()
    size = park.saved_bytes(c)
    c.state = STATE_POOLED if size is None else STATE_PARKED
    c.hypervisor.set_metadata(c.domain, c.record.to_dict(), c.state, uuid=c.uuid)
    c.holds.put(settled(replace(hold, saved_bytes=size or 0)))


def _claim(c: create.Creation) -> None:
    """Under the lock: the name checked, the GPUs chosen (a GPU sandbox), and a ready pooled
    guest of the shape taken: its hold and record name the sandbox, its labels, credential,
    GPUs (before any is attached: a killed claim leaves a record that says what to give back)
    and this claim as their owner; state creating until it is ready."""
    assert c.view is not None and c.owner is not None
    now = reserve.taken(c.view, c.holds)
    reserve.check_name(c.name, now, c.hypervisor)
    if c.spec.gpu is not None:
        c.allocation = c.allocate(now)
        if c.allocation is not None and c.allocation.switches:
            raise NoPooledGuest(c.spec.image)  # NVSwitches cannot be attached: boot cold
    found = _pick(c, now)
    if found is None:
        raise NoPooledGuest(c.spec.image)
    record, stored, hold = found
    c.uuid = stored.uuid
    c.files = SandboxFiles.of(c.config, record.stem)  # from here on undos remove that guest
    partition = c.allocation.partition if c.allocation else None
    c.holds.put(
        replace(
            hold,
            name=c.name,
            pool=None,
            image_id=None,
            gpus=reserve.held_functions(c.allocation),
            partition=partition.id if partition else None,
            owner=c.owner.identity,
            doing="claim",  # a parked guest's save stays counted until park.restore is done
        )
    )
    c.record = replace(
        record,
        name=c.name,
        guest=record.stem,
        labels=dict(c.spec.labels),
        credential=c.spec.credential,
        owner=c.spec.owner,
        created_at=expiry.stamp(expiry.now()),
        expires_at=expiry.ends_at(c.spec.ttl),
        creator=c.owner.identity,
        gpus=tuple(GpuRecord.of(gpu) for gpu in c.gpus),
        fabric_partition=partition.id if partition else None,
    )
    c.hypervisor.set_metadata(c.domain, c.record.to_dict(), STATE_CREATING, uuid=c.uuid)
    create.show_gpus(c)


def _pick(c: create.Creation, now: reserve.Taken) -> tuple[SandboxRecord, Stored, Hold] | None:
    """A ready guest of the claim's shape, image build and virt type, with a spare port per
    GPU chosen, whose hold says it is still unclaimed."""
    assert c.view is not None
    shape = next(s for s in c.config.pool if s.key == c.pool_key)
    for record, stored in c.view.ours(c.config):
        hold = now.holds.get(stored.uuid)
        ports = len(record.hotplug.buses) if record.hotplug else 0
        if (
            hold is not None
            and hold.pool == shape.key
            and hold.owner is None
            and stored.state in (STATE_POOLED, STATE_PARKED)
            and holds(shape, record)
            and record.image_id == c.image.id
            and record.virt_type == c.virt_type
            and ports >= len(c.gpus)
        ):
            return record, stored, hold
    return None


def _hostname(c: create.Creation) -> None:
    """Give the claimed guest the sandbox's name as its hostname: through its control channel
    where it has one, which checks that sshd still runs (its pinned host key was proven when
    the guest entered the pool); a guest of an older build that does not check it gets the
    hostname while a key exchange proves that its sshd answers with the pinned host key.
    Otherwise (stock or imported images, guests pooled before the channel) over SSH."""
    assert c.record is not None  # made by the claim step
    ssh = c.record.ssh
    assert ssh.port is not None  # pooled guests were waited for: their endpoint is known
    c.endpoint = Endpoint(ssh.host, ssh.port, ssh.user)
    keys = c.files.keys(c.record.host_key_alias)
    if c.hostname_set:  # a parked guest: its wake took the claim, sshd checked (park.py)
        c.boot_seconds = 0.0
        return
    started = time.monotonic()
    if not c.files.control.exists():
        _hostname_over_ssh(c, keys)
    elif not control.claim(c.files.control, c.name, guest=c.files.name):
        proof = _Proof(c.endpoint, keys)
        proof.start()
        try:
            control.set_hostname(c.files.control, c.name, guest=c.files.name)
        finally:
            proof.join()
        if proof.error is not None:
            raise proof.error
    c.boot_seconds = round(time.monotonic() - started, 3)


class _Proof(threading.Thread):
    """ssh.prove_host_key in a thread of its own, beside the control channel's request."""

    def __init__(self, endpoint: Endpoint, keys: SandboxKeys) -> None:
        super().__init__(name="prove-host-key", daemon=True)
        self.endpoint = endpoint
        self.keys = keys
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            ssh.prove_host_key(self.endpoint, self.keys)
        except Exception as exc:  # raised again by the claim's own thread
            self.error = exc


def _hostname_over_ssh(c: create.Creation, keys: SandboxKeys) -> None:
    """The hostname through an SSH login and sudo, for guests without the control channel."""
    assert c.endpoint is not None and c.record is not None
    # One sudo running one shell, with builtins only (each program started costs tens of ms
    # under TCG): /etc/hosts first, since sudo looks up the host's name and a name missing from
    # /etc/hosts goes to DNS, which a sandbox without outbound network waits out.
    script = (
        "hosts=$(while IFS= read -r line; do case $line in 127.0.1.1[[:space:]]*) ;; "
        '*) printf "%s\\n" "$line" ;; esac; done < /etc/hosts) && '
        f'printf "%s\\n127.0.1.1 %s\\n" "$hosts" {c.name} > /etc/hosts && '
        f"echo {c.name} > /etc/hostname && echo {c.name} > /proc/sys/kernel/hostname"
    )
    command = f"sudo sh -c {shlex.quote(script)}"
    result = c.guest_run(c.endpoint, keys, command, timeout=60)
    if result.exit_status != 0:
        raise FailedPrecondition(
            f"setting the hostname of sandbox {c.name!r} in pooled guest {c.files.name!r} "
            f"failed (exit {result.exit_status}): {result.stderr.strip()}",
            details={"name": c.name, "guest": c.files.name},
        )


def _stop_guest(r: create.Remains) -> None:
    """Undo, outside the lock: stop the claimed guest (libvirt gives its attached GPUs back to
    their host drivers as QEMU ends; libvirt 9.0 cannot hot-unplug one function of a card
    with companions, so GPUs are never detached one by one)."""
    if r.uuid:
        r.hypervisor.stop(r.domain, uuid=r.uuid)


def _give_up(r: create.Remains) -> None:
    """Undo, under the lock: remove the guest the claim took, while the claim owns it."""
    if r.mine() is None:
        return  # took none (no pooled guest), or a destroy has taken it over
    r.hypervisor.stop(r.domain, uuid=r.uuid)
    r.hypervisor.undefine(r.domain, uuid=r.uuid)
    r.files.remove()
    r.holds.drop(r.uuid)


def _create_step(name: str) -> create.Step:
    return next(step for step in create.CREATE_STEPS if step.name == name)


# A pooled guest: the create steps (no GPU, nothing to verify), ending in "pooled".
FILL_STEPS: tuple[create.Step, ...] = (
    *(step for step in create.CREATE_STEPS if step.name not in ("fabric", "verify", "ready")),
    create.Step("settle", _settle),
    create.Step("park", park.park),
    create.Step("pooled", _pooled, locked=True),
)
_CLAIM = create.Step("claim", _claim, _give_up, locked=True)
_TAKEN = create.Step("taken", create.nothing, _stop_guest)
_RESTORE = create.Step("restore", park.restore)
CLAIM_STEPS: tuple[create.Step, ...] = (
    _create_step("look"),
    _CLAIM,
    _TAKEN,
    _RESTORE,
    create.Step("hostname", _hostname),
    _create_step("ready"),
)
# A GPU-ready guest for a GPU sandbox: the partition is activated, then the guest's undo
# placed (stopped before the partition is released), the GPUs attached, seen and verified.
GPU_CLAIM_STEPS: tuple[create.Step, ...] = (
    _create_step("look"),
    _CLAIM,
    _create_step("fabric"),
    _TAKEN,
    _RESTORE,
    create.Step("attach", gpu_steps.attach),
    create.Step("hostname", _hostname),
    create.Step("seen", gpu_steps.seen),
    create.Step("verify", gpu_steps.verified),
    _create_step("ready"),
)
