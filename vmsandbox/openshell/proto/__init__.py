"""The OpenShell compute-driver contract: compute_driver.proto and its generated stubs
(``compute_driver_pb2``, ``compute_driver_pb2_grpc``; made by setup/gen_proto.py)."""
