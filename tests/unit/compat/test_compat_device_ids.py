"""AMD device ids (ROCm UUIDs, DRM card names): their spellings, and resolution on a fake host.

ROCm names a GPU "GPU-" plus the 16 hex digits of amdgpu's sysfs ``unique_id`` (rocminfo's
"Uuid", ROCR_VISIBLE_DEVICES); Tako's ``device_ids`` with vendor "amd" and the CLI's
``--gpu-device`` pass such ids, and DRM card names (``card1``) as AMD tools print them.
The MI300X fake host (tests/fixtures/hosts/make_hosts.py) has unique_id 3f5a9c0e71b2d486 and
the DRM card node card1.
"""

from __future__ import annotations

import pytest
from framework.fake_hosts import inventory_from_dict, probe

from vmsandbox.compat import tako
from vmsandbox.errors import InvalidArgument
from vmsandbox.gpu.allocator import select
from vmsandbox.gpu.request import GpuRequest, normalise_device_id
from vmsandbox.host.model import Inventory

ROCM_UUID = "GPU-3f5a9c0e71b2d486"
MI300X = "0000:03:00.0"


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        (ROCM_UUID, ROCM_UUID),
        ("gpu-3F5A9C0E71B2D486", ROCM_UUID),
        (f" {ROCM_UUID} ", ROCM_UUID),
        ("card1", "card1"),
        ("CARD1", "card1"),
        ("card01", "card1"),
        ("card0", "card0"),
        ("card12", "card12"),
    ],
)
def test_amd_spellings(raw: str, canonical: str) -> None:
    assert normalise_device_id(raw) == canonical
    assert normalise_device_id(canonical) == canonical


@pytest.mark.parametrize(
    "raw",
    [
        "GPU-3f5a9c0e71b2d48",  # 15 digits
        "GPU-3f5a9c0e71b2d4867",  # 17 digits
        "GPU-3f5a9c0e-71b2d486",
        "3f5a9c0e71b2d486",  # the bare unique_id: say which kind of id it is
        "0x3f5a9c0e71b2d486",  # rocm-smi --showuniqueid prints it so
        "card",
        "card-1",
        "cardA",
        "card12345",
        "renderD128",  # a render node is not a card
        "/dev/dri/card1",
    ],
)
def test_amd_spellings_rejected(raw: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        normalise_device_id(raw, "gpu.device_ids")
    message = caught.value.message
    assert repr(raw) in message and "ROCm UUID" in message and "DRM card name" in message


@pytest.fixture(scope="module")
def mi300x() -> Inventory:
    [result] = probe("mi300x", [{}])
    return inventory_from_dict(result["inventory"])


def test_discovery_reads_rocm_uuid_and_drm_card(mi300x: Inventory) -> None:
    [gpu] = mi300x.gpus
    assert (gpu.bdf, gpu.uuid, gpu.drm_cards) == (MI300X, ROCM_UUID, ("card1",))
    assert gpu.device_ids() == (MI300X, "0", ROCM_UUID, "card1")


@pytest.mark.parametrize("device_id", [ROCM_UUID, ROCM_UUID.upper(), "card1", "0", "03:00.0"])
def test_each_id_resolves_to_the_gpu(mi300x: Inventory, device_id: str) -> None:
    [gpu] = select(GpuRequest(devices=(device_id,), vendor="amd"), mi300x)
    assert gpu.bdf == MI300X


def test_tako_amd_device_ids_resolve(mi300x: Inventory) -> None:
    request = tako.gpu_request({"enabled": True, "vendor": "amd", "device_ids": ["card1"]})
    assert [gpu.bdf for gpu in select(request, mi300x)] == [MI300X]


@pytest.mark.parametrize("device_id", ["card0", "GPU-0000000000000000"])
def test_unknown_amd_id_lists_the_valid_ones(mi300x: Inventory, device_id: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        select(GpuRequest(devices=(device_id,)), mi300x)
    err = caught.value
    assert err.details["valid_ids"] == [MI300X, "0", ROCM_UUID, "card1"]
    assert repr(device_id) in err.message and "card1" in err.message


def test_two_ids_of_one_gpu_are_rejected(mi300x: Inventory) -> None:
    with pytest.raises(InvalidArgument) as caught:
        select(GpuRequest(devices=(ROCM_UUID, "card1")), mi300x)
    assert "both name GPU 0000:03:00.0" in caught.value.message
