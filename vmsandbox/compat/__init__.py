"""Adapters from other sandbox platforms' GPU requests to ``GpuRequest``.

One module per platform, each with ``gpu_request(...) -> GpuRequest | None`` (None: no GPU):
``openshell`` (sandbox spec JSON), ``opensandbox`` (``resourceLimits``), ``flowmesh``
(``resources.hardware.gpu``), ``tako`` (a job type's ``gpu``, and ``job_type_gpu_request`` for a
whole job type); ``cliflags`` does the same for the CLI's ``--gpu*`` flags. Input is taken as it
arrives on the wire (decoded JSON).

Each adapter gives the platform's own verdict, checked against the platform's code and tests
(each module names the files and the commit it follows): what the platform accepts is
accepted and means what it means there. ``InvalidArgument``, naming the field, the value and
what is allowed, is raised where the platform rejects a value too, and where it would silently
do something wrong (drop the value, misread it, or pick a GPU other than the one asked for);
each module's docstring lists those cases. No other exception escapes.
"""
