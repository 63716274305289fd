"""One fleet create, under its sandbox's placement record (records.py): unknown is not no.

1. The record: made for a new id; taken over when the fleet process that worked on it is dead
   (its claim, still waiting for placement, removed: nobody else would); UNAVAILABLE while
   another live fleet process works on it.
2. When the record names a host (an earlier create's, whose outcome was not known, or a host
   that made it), that host is asked first, with the same request: a host's create is
   idempotent per (gateway, id), so it answers with the sandbox it made, or makes it now, or
   refuses. Only its own refusal lets the create go elsewhere; a host that is lost or does not
   answer is UNAVAILABLE, and the record stays.
3. Else placement.py places a claim and asks the host Ray chose. The record names that host
   before it is asked (``creating``), and says what came of it: ``placed``, or ``unknown``
   when no answer came (the agent died, the call timed out, the driver's connection dropped):
   the claim is kept and the create answers UNAVAILABLE. A host's own refusal (the error
   carries its ANSWERED mark, or nothing was sent) releases the claim and clears the record's
   host, and the next host is tried.

A create that fails for good drops its record (nothing was made anywhere); one of unknown
outcome keeps it, so listings, deletes and the next create see where the sandbox may be.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

from vmsandbox.errors import AlreadyExists, Unavailable
from vmsandbox.fleet import claims, model, placement
from vmsandbox.fleet.hosts import HostTable
from vmsandbox.fleet.model import Record, Wish
from vmsandbox.fleet.records import Records
from vmsandbox.openshell.proto import compute_driver_pb2 as pb

log = logging.getLogger("vmsandbox.fleet")
GONE_WAIT = 5.0  # seconds to wait for a removed claim to be gone before the next is made


class Fleet(Protocol):
    """What a create uses of ``core.Fleet``."""

    gateway: str
    job: str  # this process's Ray job
    records: Records
    table: HostTable
    place_timeout: float

    def call(self, host: str, method: str, *args: Any) -> dict[str, Any]: ...

    def legacy_host(self, sandbox_id: str) -> str | None: ...


class Create:
    """The create of ``sandbox`` (the gateway's DriverSandbox) through ``fleet``."""

    def __init__(self, fleet: Fleet, sandbox: pb.DriverSandbox, wish: Wish) -> None:
        self.fleet = fleet
        self.sandbox = sandbox
        self.wish = wish
        self.gateway = fleet.gateway
        self.claim = model.claim_name(fleet.gateway, sandbox.id)
        self.request = sandbox.SerializeToString()
        self.record = Record(fleet.gateway, sandbox.id, sandbox.name)

    def run(self) -> placement.Placed:
        self.record = self._take()
        try:
            refused: dict[str, str] = {}
            named = self.record.host
            if named is not None:
                placed, why = self._ask_first(named)
                if placed is not None:
                    return placed
                refused[named] = why
            steps = placement.plan(self.wish, self.fleet.table.ready(), self.fleet.place_timeout)
            return placement.run(
                steps, self.wish, self.claim, self._place, self._create, self._release, refused
            )
        except BaseException:
            if self.record.host is None:  # no host may hold it: a create that never was
                claims.remove(self.claim)
                self.fleet.records.drop(self.gateway, self.sandbox.id)
            raise

    # -- the record -------------------------------------------------------------------------

    def _write(self, host: str | None, state: str) -> None:
        self.record = self.record.on(host, state)
        self.fleet.records.write(self.record)

    def _take(self) -> Record:
        """The record this create works under (module docstring, 1)."""
        records, me = self.fleet.records, self.fleet.job
        while True:
            found = records.get(self.gateway, self.sandbox.id)
            if found is None:
                host = self.fleet.legacy_host(self.sandbox.id)
                made = Record(
                    self.gateway,
                    self.sandbox.id,
                    self.sandbox.name,
                    host=host,
                    state=model.UNKNOWN if host else model.PLACING,
                    job=me,
                )
                if records.add(made):
                    if host is None:  # a claim without a record is nobody's
                        claims.remove(self.claim)
                    return made
                continue  # made by another process meanwhile: read it
            if found.busy(claims.live_jobs(), me):
                raise Unavailable(
                    f"a create of sandbox {self.sandbox.id!r} is under way in another fleet "
                    "process: ask again once it answered",
                    details={"sandbox_id": self.sandbox.id, "host": found.host},
                )
            if found.state == model.PLACING:  # its process died waiting: its claim is nobody's
                claims.remove(self.claim)
                claims.wait_gone(self.claim, GONE_WAIT)
            taken = found.on(found.host, found.state, job=me)
            records.write(taken)
            return taken

    # -- the host that may hold it ----------------------------------------------------------

    def _ask_first(self, host: str) -> tuple[placement.Placed | None, str]:
        """Ask ``host``, which may hold the sandbox, for it again (module docstring, 2): the
        placement when it has or makes it, else why it refused (its claim released)."""
        view = self.fleet.table.views.get(host)
        if view is None or view.state == "lost":
            raise Unavailable(
                f"sandbox {self.sandbox.id!r} may be on host {host}, which is lost: ask again "
                "once the host is back",
                details={"sandbox_id": self.sandbox.id, "host": host},
            )
        answer = self._create(host)
        failure = answer.get("error")
        if failure is None:
            why = placement.misses(self.wish, answer["gpus"])
            if why is None:
                return (
                    placement.Placed(
                        host, answer["gpus"], 0.0, False, answer.get("runtime_identity", "")
                    ),
                    "",
                )
            if not self._release(host, why, True):
                raise placement.unknown(host, {"code": "UNAVAILABLE", "message": why})
            return None, why
        if not failure.get("answered"):  # no word from the host: it may hold it still
            raise placement.unknown(host, failure)
        if failure["code"] == "ALREADY_EXISTS":
            raise AlreadyExists(failure["message"], details={"host": host})
        self._release(host, failure["message"], False)
        if failure["code"] not in placement.RETRY_ON:
            raise placement.error(failure["code"], failure["message"])
        return None, f"{failure['code']}: {failure['message']}"

    # -- placement.run's steps --------------------------------------------------------------

    def _place(
        self, claim: str, bundle: dict[str, float], wait: float, selector: dict[str, str]
    ) -> str | None:
        try:
            node = claims.place(claim, bundle, wait, selector)
        except AlreadyExists as exc:
            raise Unavailable(
                f"a create of sandbox {self.sandbox.id!r} is under way in another fleet "
                "process (its claim exists): ask again once it answered",
                details={"sandbox_id": self.sandbox.id},
            ) from exc
        if node is None:
            return None
        return {n.node_id: n.host for n in claims.nodes()}.get(node)

    def _create(self, host: str) -> dict[str, Any]:
        """Ask ``host``'s agent to make the sandbox, the record naming the host first."""
        self._write(host, model.CREATING)
        answer = self.fleet.call(host, "create", self.request, self.gateway, self.claim)
        failure = answer.get("error")
        if failure is None and answer.get("name"):  # the name the host gave it, to list it lost
            self.record = replace(self.record, name=answer["name"])
        if failure is None or (failure["code"] == "ALREADY_EXISTS" and failure.get("answered")):
            self._write(host, model.PLACED)  # the host holds a sandbox of this id
        elif not placement.definite(failure):
            self._write(host, model.UNKNOWN)
            log.warning(
                "create %s: host %s did not answer (%s: %s): kept there, outcome unknown",
                self.sandbox.id, host, failure["code"], failure["message"],
            )  # fmt: skip
        return answer

    def _release(self, host: str, reason: str, made: bool) -> bool:
        """Give ``host``'s try back: the sandbox it ``made`` (not as wished) deleted there, its
        claim removed, the record's host cleared; False when the delete's outcome is not known
        (the record then says ``unknown``, the claim is kept)."""
        log.info("create %s: host %s: %s", self.sandbox.id, host, reason)
        if made:
            request = pb.DeleteSandboxRequest().SerializeToString()
            answer = self.fleet.call(
                host, "act", self.gateway, self.sandbox.id, "DeleteSandbox", request
            )
            if "error" in answer:
                self._write(host, model.UNKNOWN)
                return False
        claims.remove(self.claim)
        claims.wait_gone(self.claim, GONE_WAIT)
        self._write(None, model.PLACING)
        return True
