"""A host's Prometheus metrics (``vmsandbox serve --metrics-address HOST:PORT``), with the
standard Python client (``pip install 'vmsandbox[fleet]'``), in a registry of their own:

- at each scrape, from the host document (hostinfo.py): ``vmsandbox_gpus{model,state}``
  (bindable GPUs free and in use), ``vmsandbox_gpu_custody{state}`` (every GPU by its custody
  state: free, assigned, sanitizing, suspect, quarantined, resetting, failed),
  ``vmsandbox_gpu_sanitize_seconds{step}`` (a histogram of the last sanitizes' steps, and
  ``total``), ``vmsandbox_slots_free{gpus}`` (sandboxes of that many GPUs
  that still fit: Fabric Manager partitions in shared NVSwitch mode),
  ``vmsandbox_partitions{size,state}`` (active or not), ``vmsandbox_pool_ready{shape}`` and
  ``vmsandbox_sandboxes``;
- per RPC of the driver, from a gRPC interceptor: ``vmsandbox_rpc_seconds{method}`` (latency
  histograms, CreateSandbox and DeleteSandbox among them) and
  ``vmsandbox_rpc_errors_total{method,code}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from vmsandbox.errors import FailedPrecondition, VmSandboxError
from vmsandbox.gpu.custody.state import STATES as CUSTODY_STATES
from vmsandbox.openshell.caller import Caller
from vmsandbox.openshell.hostinfo import describe
from vmsandbox.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)
NOBODY = Caller(uid=-1)  # the metrics' reader: it owns no sandbox, and is shown none by name
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SANITIZE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise FailedPrecondition(
            "--metrics-address needs prometheus_client: pip install 'vmsandbox[fleet]'"
        ) from exc
    return prometheus_client


class HostMetrics:
    """The registry, its RPC metrics, and the collector that reads the host at each scrape."""

    def __init__(self, manager: Callable[[], SandboxManager]) -> None:
        prom = client()
        self._prom = prom
        self._manager = manager
        self.registry = prom.CollectorRegistry()
        self.rpc_seconds = prom.Histogram(
            "vmsandbox_rpc_seconds",
            "Driver RPC latency",
            ["method"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.rpc_errors = prom.Counter(
            "vmsandbox_rpc_errors",
            "Failed driver RPCs by code",
            ["method", "code"],
            registry=self.registry,
        )
        self.registry.register(self)

    def collect(self) -> Iterator[Any]:
        """The host's gauges, read now (nothing when the host cannot be read)."""
        from prometheus_client.core import GaugeMetricFamily

        try:
            with self._manager() as manager:
                info = describe(manager, NOBODY)  # counts only: no sandbox is named
        except VmSandboxError as exc:
            log.warning("metrics: reading the host failed: %s", exc.message)
            return
        gpus = GaugeMetricFamily("vmsandbox_gpus", "Bindable GPUs", labels=["model", "state"])
        counts: dict[tuple[str, str], int] = {}
        for gpu in info["gpus"]:
            if gpu["bindable"]:
                free = gpu["holder"] is None and gpu.get("custody", "free") == "free"
                key = (gpu["model"], "free" if free else "in_use")
                counts[key] = counts.get(key, 0) + 1
        for (model, state), count in sorted(counts.items()):
            gpus.add_metric([model, state], count)
        yield gpus
        yield from custody_metrics(info)
        slots = GaugeMetricFamily(
            "vmsandbox_slots_free", "Sandboxes of this many GPUs that still fit", labels=["gpus"]
        )
        for size, count in info["capacity"]["free"].items():
            slots.add_metric([size], count)
        yield slots
        parts = GaugeMetricFamily(
            "vmsandbox_partitions", "Fabric Manager partitions", labels=["size", "state"]
        )
        tally: dict[tuple[str, str], int] = {}
        for p in info["fabric"]["partitions"]:
            key = (str(p["size"]), "active" if p["active"] else "inactive")
            tally[key] = tally.get(key, 0) + 1
        for (size, state), count in sorted(tally.items()):
            parts.add_metric([size, state], count)
        yield parts
        pool = GaugeMetricFamily("vmsandbox_pool_ready", "Ready pooled guests", labels=["shape"])
        for shape in info["pool"]:
            pool.add_metric([shape["key"]], shape["ready"])
        yield pool
        yield GaugeMetricFamily("vmsandbox_sandboxes", "Sandboxes", value=len(info["sandboxes"]))

    def describe(self) -> list[Any]:
        """No samples at registration (collect reads the host)."""
        return []

    def interceptor(self) -> grpc.ServerInterceptor:
        return _Timing(self)

    def serve(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._prom.start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)


def custody_metrics(info: dict[str, Any]) -> Iterator[Any]:
    """GPUs by custody state, and the sanitizes' seconds per step as a histogram."""
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

    states = GaugeMetricFamily("vmsandbox_gpu_custody", "GPUs by custody state", labels=["state"])
    tally: dict[str, int] = dict.fromkeys(CUSTODY_STATES, 0)
    for gpu in info["gpus"]:
        tally[gpu.get("custody", "free")] = tally.get(gpu.get("custody", "free"), 0) + 1
    for state, count in tally.items():
        states.add_metric([state], count)
    yield states
    seconds = HistogramMetricFamily(
        "vmsandbox_gpu_sanitize_seconds", "Sanitize seconds by step", labels=["step"]
    )
    by_step: dict[str, list[float]] = {}
    for entry in info.get("sanitize", []):
        steps = entry.get("steps", {})
        for step, value in [*steps.items(), ("total", sum(steps.values()))]:
            by_step.setdefault(step, []).append(float(value))
    for step, values in sorted(by_step.items()):
        buckets = [(str(b), sum(1 for v in values if v <= b)) for b in SANITIZE_BUCKETS]
        seconds.add_metric([step], [*buckets, ("+Inf", len(values))], sum(values))
    yield seconds


class _Timing(grpc.ServerInterceptor):
    """Times every unary RPC and counts the failed ones by code."""

    def __init__(self, metrics: HostMetrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        inner = handler.unary_unary
        metrics = self.metrics

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            started = time.monotonic()
            try:
                return inner(request, context)
            except Exception:
                code = context.code() if hasattr(context, "code") else None
                name = code.name if isinstance(code, grpc.StatusCode) else "INTERNAL"
                metrics.rpc_errors.labels(method=method, code=name).inc()
                raise
            finally:
                metrics.rpc_seconds.labels(method=method).observe(time.monotonic() - started)

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
