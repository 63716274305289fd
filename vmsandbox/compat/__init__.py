"""Adapters from other sandbox platforms' GPU requests to ``GpuRequest``.

One module per platform, each with ``gpu_request(...) -> GpuRequest | None`` (None: no GPU):
``openshell`` (sandbox spec JSON), ``opensandbox`` (``resourceLimits``), ``flowmesh``
(``resources.hardware.gpu``), ``tako`` (a job type's ``gpu``); ``cliflags`` does the same for the
CLI's ``--gpu*`` flags. Input is taken as it arrives on the wire (decoded JSON); every value the
platform would drop or misread is rejected with ``InvalidArgument`` naming the field, the value
and what is allowed, and no other exception escapes.
"""
