"""The host's custody metrics (openshell/metrics.py): GPUs by custody state, and the sanitizes'
seconds per step as a Prometheus histogram, from a host document."""

from __future__ import annotations

import pytest

from vmsandbox.openshell.metrics import custody_metrics

pytest.importorskip("prometheus_client")


def test_gpus_by_custody_state_and_sanitize_seconds() -> None:
    info = {
        "gpus": [{"custody": "free"}, {"custody": "quarantined"}, {"custody": "free"}],
        "sanitize": [
            {"ok": True, "steps": {"reset": 0.03, "scrub": 0.8}},
            {"ok": True, "steps": {"reset": 1.5, "scrub": 0.7}},
        ],
    }
    states, seconds = custody_metrics(info)
    counts = {sample.labels["state"]: sample.value for sample in states.samples}
    assert counts["free"] == 2 and counts["quarantined"] == 1 and counts["failed"] == 0
    samples = {(s.name, s.labels.get("step"), s.labels.get("le")): s.value for s in seconds.samples}
    assert samples[("vmsandbox_gpu_sanitize_seconds_bucket", "reset", "0.05")] == 1
    assert samples[("vmsandbox_gpu_sanitize_seconds_bucket", "reset", "+Inf")] == 2
    assert samples[("vmsandbox_gpu_sanitize_seconds_count", "total", None)] == 2
    assert samples[("vmsandbox_gpu_sanitize_seconds_sum", "scrub", None)] == pytest.approx(1.5)
