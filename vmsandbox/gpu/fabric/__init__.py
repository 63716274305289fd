"""GPUs on NVSwitch boards (HGX H100/H200/B200): what vmsandbox does with the NVLink fabric.

One module per concept:

- ``partitions``: Fabric Manager's partition table as dataclasses (parsed from ``fmpm -l``);
- ``fmpm``: the client that runs NVIDIA's ``fmpm`` to list, activate and deactivate partitions;
- ``mode``: which fabric model the host runs (no fabric, full passthrough, shared NVSwitch);
- ``state``: the host's fabric as configured (model, FM's table, who holds active partitions);
- ``policy``: the pure choice of a partition, or the full-passthrough shapes, for a request, and
  ``allocate``, the entry point of every allocation (``select`` of ``gpu.allocator`` without a
  fabric);
- ``version``: the rule that the guest's NVIDIA driver matches the host's Fabric Manager;
- ``render``: the fabric part of ``vmsandbox gpus``;
- ``lease``: activation and release of a sandbox's partition, with a ledger that survives crashes.

The in-guest NVLink checks run with the other checks of a booted guest
(``vmsandbox.guest.verify.nvlink``).

Imports: the rest of ``gpu``, ``host`` and the shared core only.
"""
