"""Adapters from other sandbox platforms' GPU requests to ``GpuRequest``.

One module per platform, each with ``gpu_request(...) -> GpuRequest | None`` (None: no GPU):
``openshell`` (sandbox spec JSON), ``opensandbox`` (``resourceLimits``), ``flowmesh``
(``resources.hardware.gpu``), ``tako`` (a job type's ``gpu``, and ``job_type_gpu_request`` for a
whole job type); ``cliflags`` does the same for the CLI's ``--gpu*`` flags. Input is taken as it
arrives on the wire (decoded JSON), and checked by the helpers the adapters share
(``_wire``).

Each adapter reads a request as the platform's own released code does (each module names the
package, files and commits it follows; tests/unit/compat/test_compat_platforms.py feeds the same
specs to those packages): what the platform accepts is accepted and means what it means there, and
what it refuses is refused with ``InvalidArgument``, naming the field, the value and what is
allowed. The few deliberate differences are listed in each module's docstring and in ``fields`` (the
facts docs/compatibility.md is generated from). No other exception escapes.

Imports: ``gpu`` (the request it produces) and the shared core only.
"""
