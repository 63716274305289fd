"""The fleet: many vmsandbox hosts behind one OpenShell gateway, placed by Ray.

Parts and where they run (docs/fleet.md has the whole picture):

- on each GPU host, ``vmsandbox serve`` as for one host, and ``vmsandbox fleet join ADDRESS``
  (``join``): the host's Ray node, its capacity as resources and labels (``model``), and its
  agent actor (``agent``), which talks to the host's driver socket and keeps the host's pinned
  claim;
- on the gateway's machine, ``vmsandbox fleet serve`` (``server``, ``service``): one compute
  driver for the whole fleet, over ``Fleet`` (``core``), which places creates (``create``,
  ``placement``) as Ray claims (``claims``) under each sandbox's placement record, kept in
  Ray's control store with the hosts' name bindings (``records``), and watches the hosts
  (``hosts``), forwards stops and starts to the sandbox's host, a suspended sandbox's claim
  given back and taken again on resume (``power``), with Prometheus metrics (``metrics``) and
  the ``vmsandbox fleet`` commands (``cli``).

Ray is needed only by the modules that talk to the cluster (``pip install
'vmsandbox[fleet]'``); importing this package, ``model`` or ``cli`` does not load it. Token
authentication is required (``auth``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Fleet"]

if TYPE_CHECKING:
    from vmsandbox.fleet.core import Fleet


def __getattr__(name: str) -> Any:
    """``Fleet``, loaded (with Ray) on first use."""
    if name == "Fleet":
        from vmsandbox.fleet.core import Fleet

        return Fleet
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
