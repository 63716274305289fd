"""A gateway is an identity, not a label: the driver served in this process behind its real
socket gate, with a second gateway let in (``openshell_allowed_uids``) and a fleet agent's uid
trusted to speak for gateways (``openshell_delegate_uids``), each driven by a client running as
that uid (tests/framework/peer_client.py). Every RPC sees and acts on its caller's sandboxes
only, and CreateSandbox is idempotent per (gateway, id). On the fake hypervisor."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from framework.fake_hypervisor import FakeHypervisor, unit_config
from framework.openshell_client import in_process
from framework.peer_client import as_uid

from vmsandbox.config import Config

ROOT = os.geteuid()  # the server's own uid: the first gateway
OTHER = 65534  # a second gateway, let in by the operator
AGENT = 65533  # a fleet agent, trusted to speak for the gateways it names
TOKEN = "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJndy1hIn0.c2lnbmF0dXJlLW9mLWdhdGV3YXktYQ"

pytestmark = pytest.mark.skipif(ROOT != 0, reason="runs clients as other uids: needs root")


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return replace(
        unit_config(tmp_path), openshell_allowed_uids=(OTHER,), openshell_delegate_uids=(AGENT,)
    )


@pytest.fixture
def socket_path(config: Config, hv: FakeHypervisor) -> Iterator[Path]:
    with in_process(config, hv) as path:
        yield path


def sandbox(sandbox_id: str, name: str, **spec: Any) -> dict[str, Any]:
    spec = {"template": {"image": "tiny", "resources": {"memory_limit": "256Mi"}}, **spec}
    return {"id": sandbox_id, "name": name, "spec": spec}


def create(sandbox_id: str, name: str, **spec: Any) -> list[Any]:
    return ["CreateSandbox", {"sandbox": sandbox(sandbox_id, name, **spec)}]


def ids(answer: dict[str, Any]) -> set[str]:
    return {s["id"] for s in answer.get("sandboxes", [])}


def test_a_second_gateway_never_sees_or_reaches_the_firsts_sandboxes(
    socket_path: Path, hv: FakeHypervisor
) -> None:
    """The first gateway (the server's uid) makes ``a-1``; the second (another uid, let in
    the documented way) lists, gets, authenticates with, stops, starts and deletes by that id:
    it finds nothing, and ``a-1`` is untouched."""
    (made,) = as_uid(ROOT, socket_path, [create("a-1", "web-a", sandbox_token=TOKEN)])
    assert made["code"] == "OK"
    answers = as_uid(
        OTHER,
        socket_path,
        [
            ["ListSandboxes", {}],
            ["GetSandbox", {"sandbox_id": "a-1"}],
            ["GetSandbox", {"name": "web-a"}],
            ["AuthenticateSandbox", {"credential": TOKEN}],
            ["StopSandbox", {"sandbox_id": "a-1"}],
            ["StartSandbox", {"sandbox_id": "a-1"}],
            ["DeleteSandbox", {"sandbox_id": "a-1"}],
            ["DeleteSandbox", {"name": "web-a"}],
        ],
    )
    codes = [answer["code"] for answer in answers]
    assert codes == ["OK", "NOT_FOUND", "NOT_FOUND", "UNAUTHENTICATED"] + ["NOT_FOUND"] * 2 + [
        "OK",
        "OK",
    ]
    assert ids(answers[0]) == set()
    assert not answers[6].get("deleted") and not answers[7].get("deleted")
    assert hv.domains["vmsbx-web-a"].running
    (listed,) = as_uid(ROOT, socket_path, [["ListSandboxes", {}]])
    assert ids(listed) == {"a-1"}


def test_each_gateway_has_its_own_ids(socket_path: Path, hv: FakeHypervisor) -> None:
    """Two gateways may use the same sandbox id: two sandboxes, each its gateway's."""
    (first,) = as_uid(ROOT, socket_path, [create("same-id", "")])
    (second,) = as_uid(OTHER, socket_path, [create("same-id", "")])
    assert first["code"] == second["code"] == "OK"
    assert first["runtime_identity"] != second["runtime_identity"]
    assert len(hv.domains) == 2
    for uid in (ROOT, OTHER):
        (listed,) = as_uid(uid, socket_path, [["ListSandboxes", {}]])
        assert ids(listed) == {"same-id"}
    (deleted,) = as_uid(OTHER, socket_path, [["DeleteSandbox", {"sandbox_id": "same-id"}]])
    assert deleted["deleted"] and len(hv.domains) == 1
    (listed,) = as_uid(ROOT, socket_path, [["ListSandboxes", {}]])
    assert ids(listed) == {"same-id"}


def test_create_is_idempotent_per_gateway_and_id(socket_path: Path, hv: FakeHypervisor) -> None:
    """The same request again answers with the same sandbox (a gateway retrying after a lost
    answer); a different request under an existing id is ALREADY_EXISTS."""
    answers = as_uid(
        OTHER,
        socket_path,
        [
            create("b-1", "web-b", sandbox_token=TOKEN),
            create("b-1", "web-b", sandbox_token=TOKEN),
            create("b-1", "web-b", command=["sleep", "1"], sandbox_token=TOKEN),
            create("b-1", "web-b"),
            create("b-1", "other-name", sandbox_token=TOKEN),
        ],
    )
    assert [a["code"] for a in answers] == ["OK", "OK"] + ["ALREADY_EXISTS"] * 3
    assert answers[0]["runtime_identity"] == answers[1]["runtime_identity"]
    assert list(hv.domains) == ["vmsbx-web-b"]


def test_a_delegate_speaks_for_each_gateway_it_names_apart(
    socket_path: Path, hv: FakeHypervisor
) -> None:
    """A fleet agent's uid names a gateway per call: each named gateway is an owner of its
    own, apart from each other and from the delegate's uid itself."""
    (a,) = as_uid(AGENT, socket_path, [create("x", "fleet-a")], gateway="gw-a")
    (b,) = as_uid(AGENT, socket_path, [create("x", "fleet-b")], gateway="gw-b")
    assert a["code"] == b["code"] == "OK"
    for gateway, name in (("gw-a", "fleet-a"), ("gw-b", "fleet-b")):
        listed, got = as_uid(
            AGENT, socket_path, [["ListSandboxes", {}], ["GetSandbox", {"sandbox_id": "x"}]],
            gateway=gateway,
        )  # fmt: skip
        assert ids(listed) == {"x"} and got["sandbox"]["name"] == name
    (own,) = as_uid(AGENT, socket_path, [["ListSandboxes", {}]])
    assert ids(own) == set()
    (deleted,) = as_uid(AGENT, socket_path, [["DeleteSandbox", {"sandbox_id": "x"}]], "gw-b")
    assert deleted["deleted"] and list(hv.domains) == ["vmsbx-fleet-a"]


def test_only_a_delegate_may_name_a_gateway(socket_path: Path) -> None:
    """The delegates of the config, and the server's own uid (which holds every sandbox
    anyway: a fleet agent running as root beside a root driver)."""
    answers = as_uid(OTHER, socket_path, [["ListSandboxes", {}]], gateway="gw-a")
    assert answers[0]["code"] == "PERMISSION_DENIED"
    bad = as_uid(AGENT, socket_path, [["ListSandboxes", {}]], gateway="no spaces")
    assert bad[0]["code"] == "INVALID_ARGUMENT"
    (made,) = as_uid(ROOT, socket_path, [create("z", "fleet-z")], gateway="gw-z")
    assert made["code"] == "OK"
    (own,) = as_uid(ROOT, socket_path, [["ListSandboxes", {}]])
    (named,) = as_uid(ROOT, socket_path, [["ListSandboxes", {}]], gateway="gw-z")
    assert ids(own) == set() and ids(named) == {"z"}


def test_hostinfo_names_only_the_callers_sandboxes(socket_path: Path) -> None:
    """HostInfo keeps what the host holds (a fleet counts every sandbox) but names to each
    caller its own sandboxes only; a delegate naming no gateway sees every gateway it speaks
    for (a fleet agent reconciling its host)."""
    as_uid(ROOT, socket_path, [create("a-1", "web-a")])
    as_uid(AGENT, socket_path, [create("x", "fleet-a")], gateway="gw-a")
    shown: dict[str, Any] = {}
    for who, uid, gateway in (("other", OTHER, None), ("root", ROOT, None), ("agent", AGENT, None)):
        (info,) = as_uid(uid, socket_path, [["GetHostInfo", {}]], gateway)
        document = json.loads(info["json"])
        shown[who] = sorted(s["name"] for s in document["sandboxes"])
    assert shown == {"other": ["", ""], "root": ["", "web-a"], "agent": ["", "fleet-a"]}
