"""The fleet's pure parts, without a cluster: a host's capacity per GPU count from the allocator
(on the umockdev HGX board, shared and full passthrough), Ray resources, labels and pinned
amounts from a host document, the wish's checks, the placement loop's retries and refusals, and
that the CLI and ``import vmsandbox`` never load Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from framework.fabric import FAKE_FMPM, held, hgx, shared  # noqa: F401 (hgx is a fixture)
from framework.paths import REPO

from vmsandbox.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from vmsandbox.fleet import model, placement
from vmsandbox.fleet.auth import check_token_auth
from vmsandbox.fleet.model import HostView, Wish
from vmsandbox.gpu import capacity
from vmsandbox.gpu.fabric.fmpm import Fmpm
from vmsandbox.gpu.fabric.mode import FULL_PASSTHROUGH, FabricMode
from vmsandbox.gpu.fabric.state import Fabric
from vmsandbox.host.model import Inventory


@pytest.fixture
def fm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "fm"
    folder.mkdir()
    monkeypatch.setenv("FAKE_FMPM_STATE", str(folder))
    return folder


def test_a_shared_board_offers_its_partitions_and_a_pair_blocks_the_larger_ones(
    hgx: Inventory,  # noqa: F811
    fm: Path,
) -> None:
    fabric = shared(Fmpm(binary=str(FAKE_FMPM)), hgx)
    empty = capacity.measure(hgx, fabric, max_gpus=16)
    assert empty.total == empty.free == {1: 8, 2: 4, 3: 0, 4: 2, 5: 0, 6: 0, 7: 0, 8: 1}
    assert empty.single_numa_total == {1: 8, 2: 4, 3: 0, 4: 2, 5: 0, 6: 0, 7: 0, 8: 0}
    one_pair = capacity.fits(2, hgx, fabric, 16)
    assert one_pair == 4
    allocation = placement_of(2, hgx, fabric)
    after_inventory, after_fabric = capacity.take(allocation, hgx, fabric)
    after = capacity.measure(after_inventory, after_fabric, max_gpus=16)
    assert after.free == {1: 6, 2: 3, 3: 0, 4: 1, 5: 0, 6: 0, 7: 0, 8: 0}
    assert after.total == empty.total  # the empty board is the same board
    assert after.models_free == {"GH100 [H100 SXM5 80GB]": 6}


def placement_of(count: int, inventory: Inventory, fabric: Fabric) -> Any:
    from vmsandbox.gpu.fabric.policy import allocate
    from vmsandbox.gpu.request import GpuRequest

    return allocate(GpuRequest(count=count), inventory, max_gpus=16, fabric=fabric)


def test_full_passthrough_offers_one_gpu_or_all(hgx: Inventory) -> None:  # noqa: F811
    fabric = Fabric(FabricMode(FULL_PASSTHROUGH, ("x",)))
    measured = capacity.measure(hgx, fabric, max_gpus=16)
    assert {n: c for n, c in measured.total.items() if c} == {1: 8, 8: 1}
    one_held = held(hgx, b41="other")
    assert {n: c for n, c in capacity.measure(one_held, fabric, 16).free.items() if c} == {1: 7}


def document(**changes: Any) -> dict[str, Any]:
    """A host document as HostInfo answers it: two GPUs of one model, one held outside the
    fleet, a pool of two with one ready."""
    doc: dict[str, Any] = {
        "gpus": [
            {"bdf": "0000:01:00.0", "model": "NVIDIA L4", "numa_node": 0, "bindable": True,
             "holder": None, "memory_mib": 23034},
            {"bdf": "0000:02:00.0", "model": "NVIDIA L4", "numa_node": 0, "bindable": True,
             "holder": "vmsbx-local", "memory_mib": 23034},
        ],
        "capacity": {
            "total": {"1": 2, "2": 1},
            "free": {"1": 1, "2": 0},
            "single_numa_total": {"1": 2, "2": 1},
            "single_numa_free": {"1": 1, "2": 0},
            "models_total": {"NVIDIA L4": 2},
            "models_free": {"NVIDIA L4": 1},
        },
        "fabric": {"mode": "none", "partitions": []},
        "pool": [{"key": "small", "image": "minimal", "cpus": 1, "memory_mib": 1024,
                  "disk_gib": 4, "gpus": 1, "count": 2, "ready": 1}],
        "sandboxes": [{"name": "local", "labels": {}, "gpus": ["0000:02:00.0"]}],
    }  # fmt: skip
    doc.update(changes)
    return doc


def test_a_host_document_as_ray_resources_labels_and_a_pinned_claim() -> None:
    doc = document()
    totals = model.host_totals("l4-box", doc)
    pool = model.POOL + "minimal-1c-1024m-4g-1gpu"
    assert totals == {
        model.HOST + "l4-box": model.HOST_UNITS,
        model.SANDBOX: model.SANDBOX_UNITS,
        model.GPU: 2.0,
        model.GPUS + "1": 2.0,
        model.GPUS + "2": 1.0,
        model.NUMA_GPUS + "1": 2.0,
        model.NUMA_GPUS + "2": 1.0,
        model.MODEL + "nvidia-l4": 2.0,
        pool: 2 + model.POOL_HEADROOM,
    }
    assert model.host_labels("l4-box", doc) == {
        model.LABEL_HOST: "l4-box",
        model.LABEL_FABRIC: "none",
        model.LABEL_MODEL: "nvidia-l4",
    }
    free = model.host_free("l4-box", doc)
    # the local sandbox's GPU, the pair it breaks, the pool guest not ready: all pinned
    pinned = model.pinned(totals, free, held={})
    assert pinned == {
        model.SANDBOX: 1.0,
        model.GPU: 1.0,
        model.GPUS + "1": 1.0,
        model.GPUS + "2": 1.0,
        model.NUMA_GPUS + "1": 1.0,
        model.NUMA_GPUS + "2": 1.0,
        model.MODEL + "nvidia-l4": 1.0,
        pool: model.POOL_HEADROOM + 1,
    }
    # a fleet claim that holds the local GPU's amounts instead leaves nothing of them pinned
    claim = Wish(gpus=1, model="L4").bundle(["NVIDIA L4"])
    less = model.pinned(totals, free, held=claim)
    assert model.GPU not in less and less[model.GPUS + "2"] == 1.0


def test_wishes_name_the_field_they_get_wrong() -> None:
    with pytest.raises(InvalidArgument) as caught:
        Wish(gpus=-1)
    assert caught.value.details["field"] == "gpus"
    with pytest.raises(InvalidArgument) as caught:
        Wish(gpus=2, numa="near")
    assert caught.value.details == {
        "field": "numa",
        "value": "'near'",
        "allowed": ("any", "single"),
    }
    with pytest.raises(InvalidArgument, match="numa 'single' needs GPUs"):
        Wish(numa="single")
    with pytest.raises(InvalidArgument, match="host name 'Bad_Host'"):
        model.check_host_name("Bad_Host")


def view(name: str, **free: float) -> HostView:
    return HostView(name, "ready", info=document(), ray_free={**free}, totals={})


def test_a_plain_wish_tries_the_pool_hosts_first() -> None:
    wish = Wish(gpus=1, image="minimal", plain=True)
    pool = model.POOL + "minimal-1c-1024m-4g-1gpu"
    ready = [
        view("a", **{pool: 1.0, model.SANDBOX: 9.0, model.GPU: 1.0, model.GPUS + "1": 1.0}),
        view("b", **{pool: 0.0}),
    ]
    steps = placement.plan(wish, ready, timeout=3.0)
    assert [(s.hosts, s.pooled) for s in steps] == [(("a",), True), (("a", "b"), False)]
    assert steps[0].bundle[pool] == 1.0
    with pytest.raises(FailedPrecondition, match="no host of the fleet has a GPU of model 'H100'"):
        placement.plan(Wish(gpus=1, model="H100"), ready, timeout=3.0)


def test_a_refusing_host_is_left_out_and_the_last_error_names_every_refusal() -> None:
    steps = [placement.Step({model.GPU: 1.0}, ("a", "b", "c"), 1.0)]
    tried: list[tuple[str, ...]] = []
    released: list[str] = []
    hosts = iter(["a", "b", None])

    def place(name: str, bundle: dict, wait: float, selector: dict) -> str | None:
        tried.append(tuple(selector[model.LABEL_HOST][3:-1].split(",")))
        return next(hosts)

    def create(host: str) -> dict[str, Any]:
        full = {"code": "RESOURCE_EXHAUSTED", "message": f"{host} is full", "answered": True}
        return {"error": full}

    def release(host: str, _why: str, _made: bool) -> bool:
        released.append(host)
        return True

    with pytest.raises(ResourceExhausted) as caught:
        placement.run(steps, Wish(gpus=1), "claim:gw:x", place, create, release)
    assert tried == [("a", "b", "c"), ("b", "c"), ("c",)]
    assert released == ["a", "b"]
    assert "host a: RESOURCE_EXHAUSTED: a is full; host b: RESOURCE_EXHAUSTED: b is full" in str(
        caught.value
    )


def test_a_request_error_is_not_retried_and_gpus_outside_the_wish_are_given_back() -> None:
    steps = [placement.Step({model.GPU: 1.0}, ("a", "b"), 1.0)]
    released: list[tuple[str, str, bool]] = []
    answers = iter(
        [
            {"gpus": [{"model": "NVIDIA A10", "numa_node": 0}]},
            {"gpus": [{"model": "NVIDIA A100", "numa_node": 0}], "runtime_identity": "r"},
        ]
    )
    placed = placement.run(
        steps,
        Wish(gpus=1, model="A100"),
        "claim:gw:x",
        lambda _n, _b, _w, selector: selector[model.LABEL_HOST][3:-1].split(",")[0],
        lambda _host: next(answers),
        lambda host, why, made: released.append((host, why, made)) is None,
    )
    assert (placed.host, placed.runtime_identity) == ("b", "r")
    assert released == [("a", "gave GPUs of another model than 'A100'", True)]
    bad = {
        "error": {
            "code": "INVALID_ARGUMENT",
            "message": "template.image 'x' is not here",
            "answered": True,
        }
    }
    with pytest.raises(InvalidArgument, match=r"template\.image 'x'"):
        placement.run(steps, Wish(), "c", lambda *_a: "a", lambda _h: bad, lambda *_a: True)


def test_the_fleet_refuses_to_run_without_ray_token_authentication(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(FailedPrecondition, match="Ray token authentication is off"):
        check_token_auth()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "none"))
    with pytest.raises(FailedPrecondition, match="no token"):
        check_token_auth()


def test_the_cli_and_the_package_never_load_ray() -> None:
    probe = (
        "import sys, vmsandbox; from vmsandbox.cli.args import build_parser; "
        "build_parser().parse_args(['fleet', 'hosts']); import vmsandbox.fleet; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    assert done.stdout.strip() == "[]"


def test_a_gpu_that_is_out_of_custody_is_no_capacity() -> None:
    doc = document()
    doc["gpus"][0]["custody"] = "quarantined"
    assert model.host_totals("l4-box", doc)[model.GPU] == 1.0
    assert model.host_free("l4-box", doc)[model.GPU] == 0.0
    doc["gpus"][0]["custody"] = "sanitizing"  # coming back: capacity, not free yet
    assert model.host_totals("l4-box", doc)[model.GPU] == 2.0
    assert model.host_free("l4-box", doc)[model.GPU] == 0.0
