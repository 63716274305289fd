"""The driver's gRPC contracts, as .proto files and the stubs generated from them (``<name>_pb2``
and ``<name>_pb2_grpc``, made by setup/gen_proto.py and never committed): compute_driver.proto,
OpenShell v0.1.2's ``openshell.compute.v1.ComputeDriver`` (``compute_driver_pb2``,
``compute_driver_pb2_grpc``), with the messages it imports from extension.proto (the extension
handshake) and sandbox.proto (the sandbox policy a driver receives), and host_info.proto,
vmsandbox's own ``vmsandbox.host.v1.HostInfo`` beside it on the same socket."""
