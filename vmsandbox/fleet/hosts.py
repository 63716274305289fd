"""The fleet's hosts, seen from Ray: each host's node, its agent's answer, and when it is lost.

``HostTable.refresh`` lists Ray's nodes (those with a ``vmsandbox.io/host`` label) and pings
every host's agent at once. A host is

- ``ready`` when its node is alive and its agent answers and says it is ready (its last
  reconcile succeeded, pinned claim placed: survivors covered, and its driver answers);
- ``joining`` while its node is alive but its agent is not there or not ready yet;
- ``lost`` when Ray marks its node dead, its agent died, MISSES pings in a row went unanswered
  for PING_TIMEOUT seconds each, or the agent says its driver (``vmsandbox serve``) has not
  answered for DRIVER_LOST seconds. With Ray's health checks at 1 s x 3 (how the fleet's head
  is started, docs/fleet.md) a killed host is marked lost within 5 s, and a host whose driver
  died within about 3 s (the agent's probe, agent.py). Pings never wait behind the agent's
  work (its concurrency groups): a busy host is not a lost one.

Ray's free amounts per host are computed from Ray's own records: node totals less every claim
placed on the node (claims.ray_free). Callbacks in ``on_lost`` run once per loss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import ray

from vmsandbox.fleet import claims, model
from vmsandbox.fleet.model import HostView

PING_TIMEOUT = 1.0  # seconds an agent has to answer a ping
MISSES = 3  # pings in a row without an answer before a host whose node lives is lost
DRIVER_LOST = 2.0  # seconds without an answer from the host's driver before the host is lost


class HostTable:
    """Every host the fleet has seen since this process started (or that Ray still lists)."""

    def __init__(self) -> None:
        self.views: dict[str, HostView] = {}
        self.refreshed = 0.0  # time.monotonic() of the last refresh
        self.on_lost: list[Callable[[HostView], None]] = []
        self._misses: dict[str, int] = {}
        self._lock = threading.Lock()

    def refresh(self, max_age: float = 0.0) -> dict[str, HostView]:
        """Look at Ray and the agents now, unless the last look is at most ``max_age`` seconds
        old; returns host name -> view."""
        with self._lock:
            if max_age and time.monotonic() - self.refreshed <= max_age:
                return dict(self.views)
            views = self._refresh()
            self.refreshed = time.monotonic()
            return views

    def _refresh(self) -> dict[str, HostView]:
        seen = claims.nodes()
        alive = {node.host: node for node in seen if node.alive}
        pings: dict[str, ray.ObjectRef] = {}
        for host in alive:
            try:
                agent = ray.get_actor(model.agent_name(host), namespace=model.NAMESPACE)
            except ValueError:
                continue  # not started yet, or gone with its node
            pings[host] = agent.ping.remote()
        answers = _gather(pings, PING_TIMEOUT)
        placed = claims.claims()
        newly_lost = []
        for host in sorted({node.host for node in seen} | set(self.views)):
            view = self.views.setdefault(host, HostView(name=host, state="joining"))
            node = alive.get(host)
            answer = answers.get(host)
            if isinstance(answer, dict):
                self._misses[host] = 0
                view.info = answer["info"] or view.info
                view.totals = answer["totals"]
                view.error = answer.get("error")
            elif node is not None and host in pings and answer is not _DIED:
                self._misses[host] = self._misses.get(host, 0) + 1
            state, why = state_of(
                view.state,
                alive=node is not None,
                agent=host in pings,
                answer=answer if isinstance(answer, dict) else None,
                died=answer is _DIED,
                misses=self._misses.get(host, 0),
            )
            if node is not None:
                view.node_id = node.node_id
                view.totals = view.totals or node.totals
                view.ray_free = claims.ray_free(node, placed)
            if state == "lost" and view.state != "lost":
                view.lost_at = time.time()
                view.error = why
                newly_lost.append(view)
            elif state != "lost":
                view.lost_at = None
            view.state = state
        for view in newly_lost:
            for callback in self.on_lost:
                callback(view)
        return dict(self.views)

    def ready(self) -> list[HostView]:
        with self._lock:
            return [view for view in self.views.values() if view.state == "ready"]

    def snapshot(self) -> list[HostView]:
        with self._lock:
            return list(self.views.values())


_DIED = object()  # the agent's actor is dead


def state_of(
    previous: str,
    *,
    alive: bool,
    agent: bool,
    answer: dict | None,
    died: bool,
    misses: int,
) -> tuple[str, str]:
    """A host's state (module docstring) and why, from what was seen of it now: its node
    ``alive``, an ``agent`` actor found, its ping's ``answer`` (None: none in time), the actor
    ``died``, ``misses`` pings in a row unanswered; ``previous``: its state before."""
    if not alive:
        return "lost", "Ray marks its node dead"
    if died:
        return "lost", "its agent died"
    if not agent:
        if previous == "ready":
            return "lost", "its agent is gone"
        return "joining", "its agent is not up yet"
    if answer is None:
        if misses >= MISSES:
            return "lost", f"its agent missed {misses} pings in a row"
        return previous, f"its agent missed {misses} pings"
    down = answer.get("driver_down_s")
    if down is not None and down >= DRIVER_LOST:
        return "lost", f"its driver has not answered for {down:.1f} s: {answer.get('error')}"
    if answer["ready"]:
        return "ready", ""
    return "joining", answer.get("error") or "its agent is not ready yet"


def _gather(pings: dict[str, ray.ObjectRef], timeout: float) -> dict[str, object]:
    """Host -> its ping's answer, _DIED, or None when it did not answer in time."""
    if not pings:
        return {}
    refs = list(pings.values())
    done, _pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    answers: dict[str, object] = {}
    finished = set(done)
    for host, ref in pings.items():
        if ref not in finished:
            answers[host] = None
            continue
        try:
            answers[host] = ray.get(ref)
        except ray.exceptions.ActorDiedError:
            answers[host] = _DIED
        except ray.exceptions.RayError:  # unreachable for now: counted as a miss
            answers[host] = None
    return answers
