"""vmsandbox as an OpenShell compute driver: the ``openshell.compute.v1.ComputeDriver`` gRPC
service on a Unix socket (``vmsandbox serve --openshell-socket PATH``), mapped onto
SandboxManager.

The contract is OpenShell v0.1.2's (the protos in ``proto``). Modules: ``negotiation``
(GetCapabilities: the answer, the same for the fleet's driver, and the extension handshake),
``admission`` (the operator's resource admission policy), ``identity`` (runtime identity and
fence evidence), ``quantity`` (Kubernetes CPU/memory quantities), ``request`` (a DriverSandbox
into a SandboxSpec and what the guest receives), ``launch`` (the workload's launch in a ready
guest: identity, launch credentials, units; and per sandbox the credentials its launch waits
for and its last failure), ``readiness`` (the background waits for a sandbox to become ready,
and reconciles), ``status`` (a sandbox into its DriverSandbox snapshot, and when each condition
last changed), ``snapshots`` (reading them: each guest's state, its launch failure),
``events`` (libvirt lifecycle events fanned out to watchers), ``watch`` (one watch stream, by
domain UUID), ``caller`` (who calls: each gateway an identity its RPCs are scoped to),
``service`` (the RPCs), ``supervisor`` (the optional openshell-sandbox in every guest),
``tunnel`` (its SSH way back to the gateway), ``socket`` (the socket, its modes and the peer
check), ``dial`` (a client's way to the socket, only to a server of a trusted uid),
``splice`` (the two-way copy the relays go through), ``hostinfo`` (the HostInfo service
beside the driver, for the fleet agent), ``metrics`` (the host's Prometheus metrics),
``server`` (serving until SIGTERM).

Imports: ``compat``, ``sandbox`` and the packages below it, and the shared core; never ``cli``
or ``fleet``.
"""
