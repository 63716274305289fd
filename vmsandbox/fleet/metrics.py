"""The fleet server's Prometheus metrics (``vmsandbox fleet serve --metrics-address``), with the
standard Python client, in a registry of their own:

- ``vmsandbox_fleet_hosts{state}``: hosts ready, joining and lost;
- ``vmsandbox_fleet_gpus{host,model,state}``: each host's bindable GPUs, free and in use, as the
  host reports them; ``vmsandbox_fleet_slots_free{host,gpus}``: sandboxes of that many GPUs the
  host could still place (Fabric Manager partitions on shared NVSwitch boards);
  ``vmsandbox_fleet_pool_ready{host,shape}``: ready pooled guests;
- ``vmsandbox_fleet_gpu_custody{host,state}``: each host's GPUs by custody state (free,
  assigned, sanitizing, suspect, quarantined, resetting, failed);
- ``vmsandbox_fleet_drift{host}``: the sum over resources of |Ray's free - the host's free|
  (0 once quiet);
- ``vmsandbox_fleet_create_seconds``, ``vmsandbox_fleet_claim_seconds``,
  ``vmsandbox_fleet_delete_seconds``: latency histograms (claim: until Ray placed it);
- ``vmsandbox_fleet_errors_total{operation,code}``: failed calls by error code.
"""

from __future__ import annotations

from typing import Any

from vmsandbox.errors import FailedPrecondition
from vmsandbox.fleet.model import HostView
from vmsandbox.gpu.custody.state import STATES as CUSTODY_STATES

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def client() -> Any:
    """The prometheus_client module; FAILED_PRECONDITION naming the extra without it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise FailedPrecondition(
            "metrics need prometheus_client: pip install 'vmsandbox[fleet]'"
        ) from exc
    return prometheus_client


class FleetMetrics:
    """The fleet server's metrics, recorded by ``Fleet`` and the host monitor."""

    def __init__(self) -> None:
        prom = client()
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.hosts = prom.Gauge("vmsandbox_fleet_hosts", "Hosts by state", ["state"], registry=r)
        self.gpus = prom.Gauge(
            "vmsandbox_fleet_gpus",
            "Bindable GPUs by host, model and state",
            ["host", "model", "state"],
            registry=r,
        )
        self.slots = prom.Gauge(
            "vmsandbox_fleet_slots_free",
            "Sandboxes of this many GPUs the host could still place",
            ["host", "gpus"],
            registry=r,
        )
        self.pool = prom.Gauge(
            "vmsandbox_fleet_pool_ready", "Ready pooled guests", ["host", "shape"], registry=r
        )
        self.custody = prom.Gauge(
            "vmsandbox_fleet_gpu_custody",
            "GPUs by host and custody state",
            ["host", "state"],
            registry=r,
        )
        self.drift = prom.Gauge(
            "vmsandbox_fleet_drift",
            "Ray's free amounts less the host's, summed",
            ["host"],
            registry=r,
        )
        self.create_seconds = prom.Histogram(
            "vmsandbox_fleet_create_seconds", "Create latency", buckets=BUCKETS, registry=r
        )
        self.claim_seconds = prom.Histogram(
            "vmsandbox_fleet_claim_seconds",
            "Until Ray placed a create's claim",
            buckets=BUCKETS,
            registry=r,
        )
        self.delete_seconds = prom.Histogram(
            "vmsandbox_fleet_delete_seconds", "Delete latency", buckets=BUCKETS, registry=r
        )
        self.errors = prom.Counter(
            "vmsandbox_fleet_errors",
            "Failed calls by operation and code",
            ["operation", "code"],
            registry=r,
        )

    def created(self, seconds: float, claim_seconds: float) -> None:
        self.create_seconds.observe(seconds)
        self.claim_seconds.observe(claim_seconds)

    def deleted(self, seconds: float) -> None:
        self.delete_seconds.observe(seconds)

    def failed(self, operation: str, code: str) -> None:
        self.errors.labels(operation=operation, code=code).inc()

    def hosts_seen(self, views: list[HostView]) -> None:
        for state in ("ready", "joining", "lost"):
            self.hosts.labels(state=state).set(sum(1 for v in views if v.state == state))
        for view in views:
            info = view.info or {}
            held: dict[tuple[str, str], int] = {}
            for gpu in info.get("gpus", []):
                if gpu["bindable"]:
                    free = gpu["holder"] is None and gpu.get("custody", "free") == "free"
                    key = (gpu["model"], "free" if free else "in_use")
                    held[key] = held.get(key, 0) + 1
            for (model, state), count in held.items():
                self.gpus.labels(host=view.name, model=model, state=state).set(count)
            custody: dict[str, int] = dict.fromkeys(CUSTODY_STATES, 0)
            for gpu in info.get("gpus", []):
                custody[gpu.get("custody", "free")] = custody.get(gpu.get("custody", "free"), 0) + 1
            for state, count in custody.items():
                self.custody.labels(host=view.name, state=state).set(count)
            for size, count in info.get("capacity", {}).get("free", {}).items():
                self.slots.labels(host=view.name, gpus=size).set(count)
            for shape in info.get("pool", []):
                self.pool.labels(host=view.name, shape=shape["key"]).set(shape["ready"])
            self.drift.labels(host=view.name).set(sum(abs(d) for d in view.drift().values()))

    def serve(self, address: str) -> None:
        """Export on ``address`` (HOST:PORT) over HTTP, in a thread."""
        host, _, port = address.rpartition(":")
        client().start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
