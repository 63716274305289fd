"""Where a fleet create goes: its wish as a Ray claim, Ray's choice, the host's final word.

``wish_of`` reads what a DriverSandbox asks for. ``plan`` turns a wish into the claims to try,
in order: first among the hosts with a ready pooled guest of its shape (when it may take one),
then among every ready host; with a model named, once per matching model of the fleet. ``run``
tries them: it makes the claim (Ray picks a host among those allowed, honouring the counts of
model.py), asks that host's agent to create the sandbox, and checks what the host gave. A
host that refuses (its lock is the final word: a partition taken meanwhile, a GPU gone) or
gives GPUs outside the wish has its claim released and is left out of the next try; after
ATTEMPTS tries the create fails with RESOURCE_EXHAUSTED naming each host's answer. A claim that
Ray cannot place within the timeout means no ready host has room now: RESOURCE_EXHAUSTED.

Unknown is not no: only a *definite* refusal moves a create on (``definite``: the host's
driver answered it, or nothing was sent). A call that ended without the host's word (the agent
died, the call or the driver's connection timed out or dropped) may have made the sandbox: the
create stops there with UNAVAILABLE (``unknown``), keeping the claim, and whoever asks again
asks that host first (create.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vmsandbox.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    VmSandboxError,
)
from vmsandbox.fleet import model
from vmsandbox.fleet.model import HostView, Wish
from vmsandbox.gpu.request import model_matches
from vmsandbox.openshell import quantity
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import DEFAULT_IMAGE, gives_guest_nothing

ATTEMPTS = 4  # hosts tried for one create
# Seconds a claim among the hosts with a ready pooled guest may wait before the fleet looks
# wider. Those hosts had room in Ray's view a moment ago, so the wait is rarely in vain; Ray
# places a claim in milliseconds, but at times takes a second or more.
POOL_WAIT = 2.0
# A host's own refusals that another host may not give: the create tries the next one. ABORTED:
# the agent found the fleet no longer places the sandbox there (agent.py).
RETRY_ON = (
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "ABORTED",
)
ERRORS = {
    cls.code: cls
    for cls in (InvalidArgument, FailedPrecondition, ResourceExhausted, AlreadyExists, Unavailable)
}


def error(code: str, message: str) -> VmSandboxError:
    """The vmsandbox error of a gRPC code name (INTERNAL for the others)."""
    cls = ERRORS.get(code)
    if cls is not None:
        return cls(message)
    made = VmSandboxError(message)
    made.code = code
    return made


def definite(failure: dict[str, Any]) -> bool:
    """Whether a failed create is known to have made nothing: its host answered it, or nothing
    was sent to the host."""
    return bool(failure.get("answered")) or failure.get("sent") is False


def unknown(host: str, failure: dict[str, Any]) -> Unavailable:
    """The error of a create whose outcome on ``host`` is not known (``failure``: what was
    seen of the call)."""
    return Unavailable(
        f"host {host} did not answer the create ({failure['code']}: {failure['message']}): it "
        f"may have made the sandbox, so it stays there, with its claim; ask again, and host "
        f"{host} is asked first",
        details={"host": host, "code": failure["code"]},
    )


def wish_of(sandbox: pb.DriverSandbox, model_name: str | None = None, numa: str = "any") -> Wish:
    """What ``sandbox`` asks of a host. Device ids name one host's GPUs, so a fleet refuses
    them: the count (and ``model_name``, ``numa``) choose."""
    spec = sandbox.spec
    template = spec.template
    if template.HasField("driver_config") and template.driver_config.fields:
        raise InvalidArgument(
            "template.driver_config names GPUs of one host; a fleet chooses the host: ask "
            "with resource_requirements.gpu.count instead",
            details={"field": "template.driver_config"},
        )
    gpus = 0
    if spec.resource_requirements.HasField("gpu"):
        gpu = spec.resource_requirements.gpu
        gpus = gpu.count if gpu.HasField("count") else 1
        if gpus < 1:
            raise InvalidArgument(
                f"resource_requirements.gpu.count {gpus} must be greater than 0",
                details={"field": "resource_requirements.gpu.count", "value": gpus},
            )
    resources = template.resources
    return Wish(
        gpus=gpus,
        model=model_name,
        numa=numa,
        image=template.image or DEFAULT_IMAGE,
        cpus=quantity.vcpus(
            resources.cpu_request, resources.cpu_limit, "template.resources.cpu", 1
        ),
        memory_mib=quantity.memory_mib(
            resources.memory_request, resources.memory_limit, "template.resources.memory", 1024
        ),
        plain=gives_guest_nothing(sandbox),
    )


@dataclass(frozen=True)
class Step:
    """One claim to try: its resources and the hosts it may land on."""

    bundle: dict[str, float]
    hosts: tuple[str, ...]
    wait: float
    pooled: bool = False


def plan(wish: Wish, ready: list[HostView], timeout: float) -> list[Step]:
    """The claims to try for ``wish`` among the ``ready`` hosts (see the module docstring)."""
    if not ready:
        raise Unavailable("no host of the fleet is ready: join one with `vmsandbox fleet join`")
    names = tuple(sorted(view.name for view in ready))
    models: list[tuple[str, ...]] = [()]
    if wish.model:
        found = sorted(
            {
                name
                for view in ready
                for name in (view.info or {}).get("capacity", {}).get("models_total", {})
                if model_matches(wish.model, name)
            }
        )
        if not found:
            raise FailedPrecondition(
                f"no host of the fleet has a GPU of model {wish.model!r}",
                details={"field": "model", "value": wish.model},
            )
        models = [(name,) for name in found]
    steps = []
    for chosen in models:
        bundle = wish.bundle(chosen)
        for resource in wish.pool_resources(_shapes(ready)):
            pooled = {**bundle, resource: 1.0}
            pool_hosts = tuple(
                view.name
                for view in ready
                if all(view.ray_free.get(key, 0.0) >= amount for key, amount in pooled.items())
            )
            if pool_hosts:
                steps.append(Step(pooled, pool_hosts, POOL_WAIT, True))
        steps.append(Step(bundle, names, timeout))
    return steps


def _shapes(ready: list[HostView]) -> list[dict[str, Any]]:
    return [shape for view in ready for shape in (view.info or {}).get("pool", [])]


@dataclass(frozen=True)
class Placed:
    """A created sandbox: its host, the GPUs it got, and how long claiming took."""

    host: str
    gpus: list[dict[str, Any]]
    claim_seconds: float
    pooled: bool
    runtime_identity: str = ""


def misses(wish: Wish, gpus: list[dict[str, Any]]) -> str | None:
    """Why the GPUs a host gave do not meet ``wish``; None when they do."""
    if wish.model and not all(model_matches(wish.model, gpu["model"]) for gpu in gpus):
        return f"gave GPUs of another model than {wish.model!r}"
    if wish.numa == "single" and len({gpu["numa_node"] for gpu in gpus}) > 1:
        return "gave GPUs on more than one NUMA node"
    return None


def run(
    steps: list[Step],
    wish: Wish,
    claim: str,
    place: Callable[[str, dict[str, float], float, dict[str, str]], str | None],
    create: Callable[[str], dict[str, Any]],
    release: Callable[[str, str, bool], bool],
    refused: dict[str, str] | None = None,
) -> Placed:
    """Try ``steps`` (``place`` makes a claim and answers its host or None; ``create`` asks a
    host's agent; ``release(host, reason, made)`` undoes a refused try, deleting what the host
    ``made``, False when that delete's outcome is not known) as the module docstring says;
    ``refused``: hosts already refused, left out."""
    refused = dict(refused or {})
    tries = 0
    for step in _cycle(steps):
        hosts = [host for host in step.hosts if host not in refused]
        if not hosts:
            continue
        if tries >= ATTEMPTS:
            break
        started = time.monotonic()
        host = place(claim, step.bundle, step.wait, {model.LABEL_HOST: f"in({','.join(hosts)})"})
        claimed = time.monotonic() - started
        if host is None:
            if step.pooled:
                continue
            raise ResourceExhausted(
                f"no ready host has room for {_what(wish)} now (waited {step.wait:g} s for "
                f"one among {', '.join(hosts)}){_refusals(refused)}; retry once sandboxes "
                "are deleted",
                details={"hosts": hosts, "refused": refused},
            )
        tries += 1
        answer = create(host)
        failure = answer.get("error")
        if failure is None:
            why = misses(wish, answer["gpus"])
            if why is None:
                identity = answer.get("runtime_identity", "")
                return Placed(host, answer["gpus"], claimed, step.pooled, identity)
            if not release(host, why, True):
                raise unknown(host, {"code": "UNAVAILABLE", "message": f"{why}, not deleted"})
            refused[host] = why
            continue
        if not definite(failure):
            raise unknown(host, failure)
        if failure["code"] == "ALREADY_EXISTS":  # the host holds a sandbox of that id: kept
            raise error(failure["code"], failure["message"])
        release(host, failure["message"], False)
        if failure["code"] not in RETRY_ON:
            raise error(failure["code"], failure["message"])
        refused[host] = f"{failure['code']}: {failure['message']}"
    raise ResourceExhausted(
        f"no host took {_what(wish)} after {tries} tries{_refusals(refused)}",
        details={"refused": refused},
    )


def _cycle(steps: list[Step]) -> Iterator[Step]:
    """The steps in order, then the last (widest) ones again while hosts remain untried."""
    yield from steps
    for _ in range(ATTEMPTS):
        yield from (step for step in steps if not step.pooled)


def _what(wish: Wish) -> str:
    if not wish.gpus:
        return "a sandbox without GPUs"
    what = f"{wish.gpus} GPU" + ("" if wish.gpus == 1 else "s")
    if wish.model:
        what += f" of model {wish.model!r}"
    if wish.numa == "single":
        what += " on one NUMA node"
    return what


def _refusals(refused: dict[str, str]) -> str:
    if not refused:
        return ""
    return "; " + "; ".join(f"host {host}: {why}" for host, why in sorted(refused.items()))
