"""The agent's ``act`` without Ray or a host: its driver and host document replaced. A stop or
start answers the sandbox's state after it and its GPU count before, which the fleet reads to
give a suspended sandbox's claim back (power.py)."""

from __future__ import annotations

import threading
from typing import Any

from vmsandbox.fleet.agent import GATEWAY_LABEL, HostAgent
from vmsandbox.openshell.proto import compute_driver_pb2 as pb
from vmsandbox.openshell.request import ID_LABEL


class Driver:
    def __init__(self, agent: Any) -> None:
        self.agent = agent

    def StopSandbox(self, message: Any, **_kwargs: Any) -> Any:
        self.agent.state = "suspended"
        return pb.StopSandboxResponse()


def agent() -> Any:
    made: Any = HostAgent.__new__(HostAgent)  # no Ray actor, no host socket
    made.state = "ready"
    made._lock = threading.Lock()
    made._deleting = {}
    made._driver = Driver(made)

    def read_info() -> dict[str, Any]:
        gpus = ["0000:18:00.0", "0000:2a:00.0"] if made.state == "ready" else []
        labels = {GATEWAY_LABEL: "gw", ID_LABEL: "x"}
        return {"sandboxes": [{"name": "box", "state": made.state, "labels": labels, "gpus": gpus}]}

    made._read_info = read_info
    return made


def test_a_stop_answers_the_state_after_and_the_gpus_before() -> None:
    request = pb.StopSandboxRequest().SerializeToString()
    answer = agent().act("gw", "x", "StopSandbox", request)
    assert answer["state"] == "suspended" and answer["gpus_before"] == 2


def test_another_gateways_sandbox_is_not_found() -> None:
    answer = agent().act("other", "x", "StopSandbox", pb.StopSandboxRequest().SerializeToString())
    assert answer == {"found": False, "deleted": False}
