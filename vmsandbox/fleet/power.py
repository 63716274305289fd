"""Stop and start through the fleet, on the host that the sandbox's placement record names:
a suspended sandbox gives its Ray claim back and takes it again on the host that holds its save.

- A stop goes to the record's host. When the host maps it to suspend (``openshell_stop_suspends``:
  the sandbox is ``suspended`` after it, its GPUs back in the host's custody), the sandbox's
  claim is removed, so its GPUs are the fleet's capacity again, and the record keeps the host
  and the claim's shape (``Record.suspended``): the sandbox is still listed there, never deleted
  nor placed elsewhere. A stop whose outcome is not known keeps the claim (capacity held a
  while longer, never given twice); stopping again releases it.
- A start of a suspended sandbox goes to the host that holds its save and only there: first a
  claim of the same shape is placed on that host (within ``place_timeout``), then the host is
  asked to resume. No room on that host in Ray's view, or the host's own RESOURCE_EXHAUSTED:
  RESOURCE_EXHAUSTED, and the sandbox stays suspended, nothing held. A host's other refusal
  removes the claim too; a resume whose outcome is not known keeps the claim (the host may
  have taken the GPUs) and the next start reuses it.
- A host that is lost answers UNAVAILABLE (unknown is not no): its sandbox is never resumed
  elsewhere. A stop or start of a sandbox that is not suspended is only passed on.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

from vmsandbox.errors import AlreadyExists, NotFound, ResourceExhausted, Unavailable
from vmsandbox.fleet import claims, model, placement
from vmsandbox.fleet.hosts import HostTable
from vmsandbox.fleet.model import Record, Wish
from vmsandbox.fleet.records import Records

log = logging.getLogger("vmsandbox.fleet")
SUSPENDED = "suspended"  # a host sandbox's state once suspended (sandbox/record.py)
STOP, START = "StopSandbox", "StartSandbox"


class Fleet(Protocol):
    """What a stop or start uses of ``core.Fleet``."""

    gateway: str
    records: Records
    table: HostTable
    place_timeout: float

    def call(self, host: str, method: str, *args: Any) -> dict[str, Any]: ...

    def legacy_host(self, sandbox_id: str) -> str | None: ...


class Power:
    """Stop or start (``rpc``, with ``request`` serialized) of the gateway's sandbox
    ``sandbox_id`` through ``fleet``."""

    def __init__(self, fleet: Fleet, sandbox_id: str, rpc: str, request: bytes) -> None:
        self.fleet = fleet
        self.sandbox_id = sandbox_id
        self.rpc = rpc
        self.request = request
        self.claim = model.claim_name(fleet.gateway, sandbox_id)

    def run(self) -> str:
        """The runtime identity a start answers (empty for a stop)."""
        record = self._record()
        assert record.host is not None
        if self.rpc == START and record.suspended is not None:
            return self._resume(record, record.host, record.suspended)
        bundle = claims.find(self.claim)
        answer = self._act(record.host)
        if self.rpc == STOP and answer.get("state") == SUSPENDED:
            shape = bundle.bundle if bundle is not None else record.suspended
            if shape is None:  # no claim (a survivor adopted by the host): the sandbox's size
                shape = Wish(gpus=int(answer.get("gpus_before", 0))).bundle()
            self.fleet.records.write(replace(record, suspended=dict(shape)))
            claims.remove(self.claim)
            log.info("sandbox %s suspended on host %s: claim %s given back", self.sandbox_id,
                     record.host, shape)  # fmt: skip
        return str(answer.get("runtime_identity", ""))

    def _record(self) -> Record:
        """The sandbox's record (one made for a sandbox made before records were kept), its
        host not lost."""
        gateway, records = self.fleet.gateway, self.fleet.records
        record = records.get(gateway, self.sandbox_id)
        if record is None or record.host is None:
            host = self.fleet.legacy_host(self.sandbox_id)
            if host is None:
                raise NotFound(
                    f"sandbox {self.sandbox_id!r} does not exist in this gateway's fleet",
                    details={"sandbox_id": self.sandbox_id},
                )
            record = Record(gateway, self.sandbox_id, host=host, state=model.PLACED)
        view = self.fleet.table.views.get(record.host or "")
        if view is None or view.state == "lost":
            raise Unavailable(
                f"sandbox {self.sandbox_id!r} is on host {record.host}, which is lost: ask "
                "again once the host is back (it is never started elsewhere)",
                details={"sandbox_id": self.sandbox_id, "host": record.host},
            )
        return record

    def _act(self, host: str) -> dict[str, Any]:
        answer = self.fleet.call(
            host, "act", self.fleet.gateway, self.sandbox_id, self.rpc, self.request
        )
        failure = answer.get("error")
        if failure is not None:
            raise placement.error(failure["code"], failure["message"])
        if not answer.get("found", True):
            raise NotFound(
                f"sandbox {self.sandbox_id!r} is not on host {host}",
                details={"sandbox_id": self.sandbox_id, "host": host},
            )
        return answer

    def _resume(self, record: Record, host: str, shape: dict[str, float]) -> str:
        """Take a claim of ``shape`` on ``host`` again, then resume there (module docstring)."""
        try:
            node = claims.place(
                self.claim, shape, self.fleet.place_timeout, {model.LABEL_HOST: f"in({host})"}
            )
        except AlreadyExists:  # an earlier resume's, whose outcome was not known: reuse it
            found = claims.find(self.claim)
            node = found.node_id if found is not None and found.state == "CREATED" else None
            if node is None:  # one still waiting for room holds nothing: not left to wait
                claims.remove(self.claim)
        if node is None:
            raise ResourceExhausted(
                f"host {host}, which holds the save of sandbox {self.sandbox_id!r}, has no room "
                f"for it now ({_what(shape)}): it stays suspended there; start it again once "
                "sandboxes there are deleted or suspended",
                details={"sandbox_id": self.sandbox_id, "host": host, "claim": shape},
            )
        answer = self.fleet.call(
            host, "act", self.fleet.gateway, self.sandbox_id, self.rpc, self.request
        )
        failure = answer.get("error")
        if failure is not None:
            if placement.definite(failure):  # the host said no: nothing taken there
                claims.remove(self.claim)
            raise placement.error(failure["code"], failure["message"])
        if not answer.get("found", True):
            claims.remove(self.claim)
            raise NotFound(
                f"sandbox {self.sandbox_id!r} is not on host {host}",
                details={"sandbox_id": self.sandbox_id, "host": host},
            )
        self.fleet.records.write(replace(record, suspended=None))
        return str(answer.get("runtime_identity", ""))


def _what(shape: dict[str, float]) -> str:
    gpus = int(shape.get(model.GPU, 0))
    if not gpus:
        return "a sandbox without GPUs"
    return f"{gpus} GPU" + ("" if gpus == 1 else "s")
