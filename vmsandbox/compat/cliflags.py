"""CLI GPU flags, after OpenShell's CLI, turned into a GpuRequest.

OpenShell main (2f7fb655, ``crates/openshell-cli/src/main.rs``: ``--gpu [COUNT]``,
``parse_gpu_request``) has one flag:

- ``--gpu``: one GPU (the driver's default); ``--gpu N`` asks for N. N is what Rust's
  ``u32`` parser reads (ASCII digits, an optional leading "+", at most 4294967295) and must be
  greater than 0.

Kept from the earlier request spec, as aliases: ``--gpu-count N`` (N GPUs) and
``--gpu-device ID`` (repeatable; a PCI address, NVIDIA or ROCm UUID, DRM card name or
inventory index; OpenShell's CLI had it before 1dc59853). vmsandbox's own additions:
``--gpu-all`` (every free GPU) and the filters ``--gpu-vendor``, ``--gpu-model`` and
``--gpu-memory`` (a Kubernetes quantity).

Decided here: the filters alone imply one GPU (``--gpu-model H100`` means one H100), as a
filter on no GPU would be dropped silently. Conflicts are rejected before anything is
allocated, naming the flags: ``--gpu N`` with a different ``--gpu-count``; ``--gpu-all`` with
``--gpu``, ``--gpu-count`` or ``--gpu-device``; a count that differs from the number of
``--gpu-device`` flags. As in OpenShell, a bare ``--gpu`` counts as one GPU, so with two
``--gpu-device`` flags give ``--gpu 2`` or leave ``--gpu`` out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vmsandbox.gpu.request import (
    GpuRequest,
    bytes_to_mib,
    check_count_matches_devices,
    invalid,
    normalise_device_ids,
    normalise_model,
    normalise_vendor,
    parse_memory_quantity,
    require_count,
    shown,
)

_U32_RE = re.compile(r"\+?0*([0-9]{1,10})", re.A)  # what Rust's u32::from_str reads
_U32_MAX = 2**32 - 1


def parse_gpu_flag_value(text: str) -> int:
    """The N of ``--gpu N``, for argparse's ``type=`` (with ``nargs="?", const=1``).

    Raises ``InvalidArgument`` rather than an argparse error, so the CLI reports it like any
    other bad request.
    """
    match = _U32_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None or int(match.group(1)) > _U32_MAX:
        raise invalid(
            "--gpu",
            text,
            f"--gpu COUNT must be a positive integer (digits, at most {_U32_MAX}), got "
            f"{shown(text)}",
        )
    return require_count(int(match.group(1)), "--gpu")


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
    vendor = None if gpu_vendor is None else normalise_vendor(gpu_vendor, "--gpu-vendor")
    model = None if gpu_model is None else normalise_model(gpu_model, "--gpu-model")
    min_memory_mib = (
        None
        if gpu_memory is None
        else bytes_to_mib(parse_memory_quantity(gpu_memory, "--gpu-memory"))
    )
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
        return GpuRequest(all=True, vendor=vendor, model=model, min_memory_mib=min_memory_mib)

    count = gpu if gpu_count is None else gpu_count
    count_flag = "--gpu" if gpu_count is None else "--gpu-count"
    check_count_matches_devices(count, devices, count_flag, "--gpu-device")
    if count is None and not devices and not any((vendor, model, min_memory_mib)):
        return None
    return GpuRequest(
        count=count, devices=devices, vendor=vendor, model=model, min_memory_mib=min_memory_mib
    )
