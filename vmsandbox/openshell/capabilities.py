"""What vmsandbox answers to GetCapabilities: the same for a host's driver and the fleet's."""

from __future__ import annotations

from typing import Any

import vmsandbox
from vmsandbox.openshell import negotiation
from vmsandbox.openshell.admission import AdmissionPolicy
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import DEFAULT_IMAGE


def capabilities(admission: AdmissionPolicy, *, reports_readiness: bool) -> Any:
    """The GetCapabilitiesResponse: CPU and memory limits, a GPU count and a GPU request
    without one (vmsandbox picks) are honoured; rootfs tar sources are not (no staging
    directory, size 0); a sandbox's token identifies it; the extension protocol and the
    operator's admission policy. ``reports_readiness``: the driver says when a sandbox is
    ready (else the gateway also waits for a supervisor to call back)."""
    return pb.GetCapabilitiesResponse(
        driver_name="vmsandbox",
        driver_version=vmsandbox.__version__,
        default_image=DEFAULT_IMAGE,
        gateway_manages_lifecycle=False,
        supports_sandbox_authentication=True,
        driver_reports_runtime_readiness=reports_readiness,
        resource_capabilities=pb.ResourceCapabilities(
            cpu=pb.CpuResourceCapabilities(limit_supported=True),
            memory=pb.MemoryResourceCapabilities(limit_supported=True),
            gpu=pb.GpuResourceCapabilities(
                default_selection_supported=True, count_selection_supported=True
            ),
        ),
        rootfs_tar_staging_dir="",
        rootfs_tar_max_bytes=0,
        extension=negotiation.driver_metadata(),
        resource_admission_policy=admission.acknowledgement(),
    )
