"""CLI GPU flags, after OpenShell's driver spec, turned into a GpuRequest.

- ``--gpu``: the default, one free GPU; ``--gpu N`` asks for N.
- ``--gpu-count N``: N GPUs, failing if the host cannot give N.
- ``--gpu-device ID`` (repeatable): those devices (PCI address, NVIDIA UUID or index).
- ``--gpu-all``: every free GPU.
- ``--gpu-vendor``, ``--gpu-model``, ``--gpu-memory`` (a Kubernetes quantity): filters.

Decided here: the filters alone imply one GPU (``--gpu-model H100`` means one H100), as a
filter on no GPU would be dropped silently. Conflicts are rejected before anything is
allocated, naming the flags: ``--gpu N`` with a different ``--gpu-count``; ``--gpu-all`` with
``--gpu``, ``--gpu-count`` or ``--gpu-device``; a count that differs from the number of
``--gpu-device`` flags. A bare ``--gpu`` counts as ``--gpu 1``, so with two ``--gpu-device``
flags, leave ``--gpu`` out.
"""

from __future__ import annotations

from collections.abc import Sequence

from vmsandbox.compat._wire import count_from_text
from vmsandbox.gpuquery import (
    bytes_to_mib,
    check_count_matches_devices,
    invalid,
    normalise_device_ids,
    normalise_model,
    normalise_vendor,
    parse_memory_quantity,
    require_count,
)
from vmsandbox.spec import GpuRequest


def parse_gpu_flag_value(text: str) -> int:
    """The N of ``--gpu N``, for argparse's ``type=`` (with ``nargs="?", const=1``).

    Raises ``InvalidArgument`` rather than an argparse error, so the CLI reports it like any
    other bad request.
    """
    return count_from_text(text, "--gpu")


def gpu_request_from_flags(
    *,
    gpu: int | None = None,
    gpu_count: int | None = None,
    gpu_devices: Sequence[str] = (),
    gpu_all: bool = False,
    gpu_vendor: str | None = None,
    gpu_model: str | None = None,
    gpu_memory: str | None = None,
) -> GpuRequest | None:
    """The GpuRequest the GPU flags ask for; None when no GPU flag is given.

    ``gpu`` is None without ``--gpu`` and 1 for a bare ``--gpu``.
    """
    if gpu is not None:
        require_count(gpu, "--gpu")
    if gpu_count is not None:
        require_count(gpu_count, "--gpu-count")
    devices = normalise_device_ids(gpu_devices, "--gpu-device")
    filters = {
        "vendor": None if gpu_vendor is None else normalise_vendor(gpu_vendor, "--gpu-vendor"),
        "model": None if gpu_model is None else normalise_model(gpu_model, "--gpu-model"),
        "min_memory_mib": None
        if gpu_memory is None
        else bytes_to_mib(parse_memory_quantity(gpu_memory, "--gpu-memory")),
    }
    if gpu is not None and gpu_count is not None and gpu != gpu_count:
        raise invalid(
            "--gpu-count",
            gpu_count,
            f"--gpu {gpu} and --gpu-count {gpu_count} ask for different numbers of GPUs: "
            "give one of them",
        )
    if gpu_all:
        for flag, given in (("--gpu", gpu), ("--gpu-count", gpu_count), ("--gpu-device", devices)):
            if given:
                raise invalid(
                    flag,
                    given,
                    f"--gpu-all takes every free GPU, so {flag} cannot be given with it: "
                    f"drop {flag} or --gpu-all",
                )
        return GpuRequest(all=True, **filters)

    count = gpu if gpu_count is None else gpu_count
    count_flag = "--gpu" if gpu_count is None else "--gpu-count"
    check_count_matches_devices(count, devices, count_flag, "--gpu-device")
    if count is None and not devices and not any(filters.values()):
        return None
    return GpuRequest(count=count, devices=devices, **filters)
