"""NVSwitch fabric (vmsandbox.gpu.fabric): fmpm client against the fake fmpm, fabric mode, the
partition policy on the umockdev HGX host, the version rule, and the NVLink parsers on real
output text (tests/fixtures/guest/fabric)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from framework.fabric import FAKE_FMPM, fmpm, held, shared
from framework.inventories import HGX
from framework.paths import FIXTURES

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from vmsandbox.gpu.fabric import render, state
from vmsandbox.gpu.fabric.fmpm import Fmpm
from vmsandbox.gpu.fabric.lease import STRAY, FabricLease, Lease
from vmsandbox.gpu.fabric.mode import FULL_PASSTHROUGH, NONE, SHARED, VGPU, FabricMode, detect
from vmsandbox.gpu.fabric.partitions import parse_partition_list
from vmsandbox.gpu.fabric.policy import allocate
from vmsandbox.gpu.fabric.state import Fabric
from vmsandbox.gpu.fabric.version import (
    check_driver_matches,
    fm_version,
    image_driver_version,
    parse_fm_version,
    upstream_version,
)
from vmsandbox.gpu.request import GpuRequest
from vmsandbox.guest.ssh import ExecResult
from vmsandbox.guest.verify import nvlink
from vmsandbox.host.model import Inventory

FAKE_FM = FIXTURES / "fmpm" / "nv-fabricmanager"
GUEST = FIXTURES / "guest" / "fabric"
# FM physical id order of the fake's H100 table: 1-4 are node 0 (41, 42, 18, 19)
DRIVER = "535.216.01"
NODE0 = ["0000:18:00.0", "0000:19:00.0", "0000:41:00.0", "0000:42:00.0"]


# -- fmpm client ---------------------------------------------------------------------------


def test_list_parses_the_fake_table_by_pci_address(fm: Path) -> None:
    table = fmpm().list()
    assert [p.id for p in table.partitions] == list(range(15))
    assert table.sizes() == [1, 2, 4, 8]
    assert table.max_partitions == 64
    zero = table.by_id(0)
    assert zero is not None and zero.size == 8 and not zero.active
    # physical ids do not follow PCI order; BDFs are canonical
    assert [(g.physical_id, g.bdf) for g in table.by_id(3).gpus] == [
        (1, "0000:41:00.0"),
        (2, "0000:42:00.0"),
    ]
    assert table.by_id(7).gpus[0].nvlinks_available == 0


def test_activate_deactivate_and_refusals(fm: Path) -> None:
    client = fmpm()
    client.activate(1)
    assert [p.id for p in client.list().active()] == [1]
    with pytest.raises(FailedPrecondition) as refused:
        client.activate(3)  # overlaps partition 1
    assert "Failed to activate partition. fmReturn: -7" in refused.value.message
    assert refused.value.details["fm_return"] == -7
    client.deactivate(1)
    with pytest.raises(FailedPrecondition, match="Failed to deactivate partition"):
        client.deactivate(1)
    assert (fm / "calls.log").read_text().split("\n")[:2] == ["-a 1", "-l"]


def test_unreachable_fm_is_unavailable(fm: Path) -> None:
    (fm / "unreachable").touch()
    with pytest.raises(Unavailable) as err:
        fmpm().list()
    assert "Failed to connect to Fabric Manager instance" in err.value.message
    assert "127.0.0.1" in err.value.message
    with pytest.raises(Unavailable):
        fmpm().activate(0)


def test_connection_options_reach_the_configured_instance(fm: Path) -> None:
    (fm / "listen").write_text("--unix-domain-socket /run/fm.sock")
    with pytest.raises(
        Unavailable, match=re.escape("Fabric Manager at 127.0.0.1 cannot be reached")
    ):
        fmpm().list()
    assert Fmpm(str(FAKE_FMPM), unix_socket="/run/fm.sock").list().sizes() == [1, 2, 4, 8]
    (fm / "listen").write_text("--hostname fm.example")
    assert len(Fmpm(str(FAKE_FMPM), hostname="fm.example").list().partitions) == 15


def test_missing_fmpm_is_failed_precondition(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition, match="'fmpm-absent' is not on PATH"):
        Fmpm("fmpm-absent").list()
    with pytest.raises(FailedPrecondition, match="is not an executable file") as err:
        Fmpm(str(tmp_path / "fmpm")).list()
    assert err.value.details["field"] == "fmpm"


def test_bad_partition_list_names_what_was_printed() -> None:
    with pytest.raises(FailedPrecondition, match="did not print a partition list"):
        parse_partition_list("Failed to get partition list. fmReturn: -5\n")
    broken = json.dumps({"version": 1, "numPartitions": 2, "maxNumPartitions": 64,
                         "partitionInfo": []})  # fmt: skip
    with pytest.raises(FailedPrecondition, match="numPartitions 2 but lists 0"):
        parse_partition_list(broken)


def test_the_fmpm_client_comes_from_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMSANDBOX_FMPM", "/opt/fm/fmpm")
    monkeypatch.setenv("VMSANDBOX_FM_UNIX_SOCKET", "/run/fm.sock")
    config = Config.load("/nonexistent")
    assert state.client(config) == Fmpm("/opt/fm/fmpm", unix_socket="/run/fm.sock")
    file = tmp_path / "config.toml"
    file.write_text('fm_hostname = "10.0.0.1"\nfabric_manager_config = "/etc/fm.cfg"\n')
    monkeypatch.delenv("VMSANDBOX_FM_UNIX_SOCKET")
    loaded = Config.load(file)
    assert loaded.fabric_manager_config == Path("/etc/fm.cfg")
    assert state.client(loaded).hostname == "10.0.0.1"
    monkeypatch.setenv("VMSANDBOX_FM_UNIX_SOCKET", "/run/fm.sock")
    with pytest.raises(
        InvalidArgument, match=re.escape("both fm_unix_socket '/run/fm.sock' and fm_host")
    ):
        Config.load(file)


# -- fabric mode ---------------------------------------------------------------------------


def test_fabric_mode_from_inventory_and_fm_config(hgx: Inventory, tmp_path: Path) -> None:
    cfg = tmp_path / "fabricmanager.cfg"
    missing = detect(hgx, cfg)
    assert missing.kind == FULL_PASSTHROUGH and len(missing.switches) == 4
    cfg.write_text("LOG_LEVEL=4\n# FABRIC_MODE=1\nFABRIC_MODE=1\nFM_CMD_PORT_NUMBER=6666\n")
    assert detect(hgx, cfg).kind == SHARED
    assert detect(hgx, cfg).fabric_mode == 1
    cfg.write_text("FABRIC_MODE=0\n")
    assert detect(hgx, cfg).kind == FULL_PASSTHROUGH
    cfg.write_text("LOG_LEVEL=4\n")  # FM's default is 0
    assert detect(hgx, cfg).kind == FULL_PASSTHROUGH
    cfg.write_text("FABRIC_MODE=2\n")
    assert detect(hgx, cfg).kind == VGPU
    cfg.write_text("FABRIC_MODE=shared\n")
    with pytest.raises(FailedPrecondition, match="FABRIC_MODE='shared' is not 0, 1 or 2"):
        detect(hgx, cfg)
    assert detect(replace(hgx, fabric=()), cfg).kind == NONE


# -- shared NVSwitch mode ------------------------------------------------------------------


@pytest.mark.parametrize(("board", "whole"), [("h100", 0), ("b200", 1)])
def test_shared_takes_one_whole_partition_of_exactly_n(
    board: str, whole: int, fm: Path, hgx: Inventory
) -> None:
    (fm / "board").write_text(board)
    fabric = shared(fmpm(), hgx)

    def take(**request: object) -> tuple[int | None, list[str]]:
        got = allocate(GpuRequest(**request), hgx, fabric=fabric)
        return got.partition.id if got.partition else None, [g.bdf for g in got.gpus]

    assert take(count=8) == (whole, HGX)
    four = take(count=4)
    assert four[1] == NODE0  # the lowest BDFs among equally placed fours
    pair = take(count=2)
    assert pair[1] == ["0000:18:00.0", "0000:19:00.0"]  # one PCIe switch
    assert take(count=1)[1] == ["0000:18:00.0"]
    assert take(all=True) == (whole, HGX)


def test_shared_best_fit_keeps_larger_partitions_free(fm: Path, hgx: Inventory) -> None:
    # 0000:41 is held: its pair (41, 42) is blocked, so a single GPU comes from that pair
    busy = held(hgx, b41="vmsbx-other")
    got = allocate(GpuRequest(count=1), busy, fabric=shared(fmpm(), busy))
    assert [g.bdf for g in got.gpus] == ["0000:42:00.0"]
    assert got.partition is not None and got.partition.id == 8  # single of physical id 2


def test_sizes_on_offer_are_named(fm: Path, hgx: Inventory) -> None:
    with pytest.raises(FailedPrecondition) as err:
        allocate(GpuRequest(count=3), hgx, fabric=shared(fmpm(), hgx))
    assert "this host can never give 3 GPUs" in err.value.message
    assert "partitions that fit the request have 1, 2, 4 or 8 GPUs" in err.value.message
    assert err.value.details["sizes"] == [1, 2, 4, 8]
    with pytest.raises(FailedPrecondition, match="a sandbox takes at most 4"):
        allocate(GpuRequest(count=8), hgx, fabric=shared(fmpm(), hgx), max_gpus=4)
    with pytest.raises(FailedPrecondition, match="none whose GPUs are all bindable and match"):
        allocate(GpuRequest(count=1, model="B200"), hgx, fabric=shared(fmpm(), hgx))


def test_active_and_overlapping_partitions_are_not_free(fm: Path, hgx: Inventory) -> None:
    client = fmpm()
    client.activate(1)  # all of node 0, activated outside vmsandbox: no domain holds it
    fabric = shared(client, hgx)
    got = allocate(GpuRequest(count=4), hgx, fabric=fabric)
    assert got.partition is not None and got.partition.id == 2
    with pytest.raises(ResourceExhausted) as err:
        allocate(GpuRequest(count=8), hgx, fabric=fabric)
    assert "partition 0: overlaps active partition 1" in err.value.message
    busy = held(hgx, b9a="vmsbx-a", bc1="vmsbx-b")
    client.activate(5)  # the pair c1, c2
    fabric = shared(client, busy)
    assert fabric.owners == {5: "vmsbx-b"}
    with pytest.raises(ResourceExhausted) as err:
        allocate(GpuRequest(count=2), busy, fabric=fabric)
    message = err.value.message
    assert "partition 3: overlaps active partition 1" in message
    assert "partition 5: active, held by domain 'vmsbx-b'" in message
    assert "partition 6: 0000:9a:00.0 held by domain 'vmsbx-a'" in message
    assert "retry" in message


def test_named_devices_must_be_exactly_one_partition(fm: Path, hgx: Inventory) -> None:
    fabric = shared(fmpm(), hgx)
    got = allocate(GpuRequest(devices=["0000:c2:00.0", "c1:00.0"]), hgx, fabric=fabric)
    assert got.partition is not None and got.partition.id == 5
    assert [g.bdf for g in got.gpus] == ["0000:c1:00.0", "0000:c2:00.0"]
    with pytest.raises(InvalidArgument) as err:
        allocate(GpuRequest(devices=["0000:41:00.0", "0000:18:00.0"]), hgx, fabric=fabric)
    assert "must be exactly one Fabric Manager partition" in err.value.message
    assert "partition 4: 0000:18:00.0, 0000:19:00.0" in err.value.message
    assert err.value.details["field"] == "devices"
    with pytest.raises(InvalidArgument, match=re.escape("no GPU '0000:77:00.0'")):
        allocate(GpuRequest(devices=["0000:77:00.0"]), hgx, fabric=fabric)
    with pytest.raises(ResourceExhausted, match=re.escape("0000:41:00.0 by domain 'vmsbx-x'")):
        busy = held(hgx, b41="vmsbx-x")
        allocate(GpuRequest(devices=["0000:41:00.0"]), busy, fabric=shared(fmpm(), busy))
    fmpm().activate(7)
    with pytest.raises(ResourceExhausted, match="partition 7 of the GPUs named is not free"):
        allocate(GpuRequest(devices=["0000:41:00.0"]), hgx, fabric=shared(fmpm(), hgx))


# -- full passthrough and vGPU -------------------------------------------------------------


def test_full_passthrough_shapes(hgx: Inventory) -> None:
    fabric = Fabric(FabricMode(FULL_PASSTHROUGH, ("x",)))
    whole = allocate(GpuRequest(count=8), hgx, fabric=fabric)
    assert [g.bdf for g in whole.gpus] == HGX
    assert whole.switches == hgx.fabric and len(whole.switches) == 4
    assert allocate(GpuRequest(all=True), hgx, fabric=fabric).switches == hgx.fabric
    one = allocate(GpuRequest(), hgx, fabric=fabric)
    assert len(one.gpus) == 1 and one.switches == () and one.partition is None
    for count in range(2, 8):
        with pytest.raises(FailedPrecondition) as err:
            allocate(GpuRequest(count=count), hgx, fabric=fabric)
        assert "shared NVSwitch mode (FABRIC_MODE=1" in err.value.message
        assert err.value.details["allowed"] == [1, 8]
    with pytest.raises(FailedPrecondition, match="can never give 9 GPUs"):
        allocate(GpuRequest(count=9), hgx, fabric=fabric)
    with pytest.raises(InvalidArgument, match=re.escape("no GPU '0000:77:00.0'")):
        allocate(GpuRequest(devices=["0000:77:00.0", HGX[0]]), hgx, fabric=fabric)
    named = allocate(GpuRequest(devices=list(reversed(HGX))), hgx, fabric=fabric)
    assert len(named.switches) == 4
    switch = hgx.fabric[0].bdf
    taken = replace(hgx, fabric=(replace(hgx.fabric[0], in_use_by="vmsbx-old"), *hgx.fabric[1:]))
    with pytest.raises(ResourceExhausted, match=f"{switch} by domain 'vmsbx-old'"):
        allocate(GpuRequest(count=8), taken, fabric=fabric)


def test_vgpu_mode_and_hosts_without_fabric(hgx: Inventory) -> None:
    with pytest.raises(FailedPrecondition, match="vGPU mode"):
        allocate(GpuRequest(), hgx, fabric=Fabric(FabricMode(VGPU, ("x",))))
    plain = allocate(GpuRequest(count=3), replace(hgx, fabric=()), fabric=None)
    assert len(plain.gpus) == 3 and plain.partition is None


# -- version rule --------------------------------------------------------------------------


def test_fm_version_is_read_from_nv_fabricmanager(fm: Path) -> None:
    assert parse_fm_version("Fabric Manager version is : 450.102.04\n") == "450.102.04"
    assert parse_fm_version("usage: ...") is None
    (fm / "version").write_text("550.54.15")
    assert fm_version(str(FAKE_FM)) == "550.54.15"
    with pytest.raises(FailedPrecondition, match=re.escape("set fm_version in config.toml")):
        fm_version("nv-fabricmanager-absent")


def test_driver_must_match_fm() -> None:
    check_driver_matches("nvidia", "535.216.01", "535.216.01")
    with pytest.raises(FailedPrecondition) as err:
        check_driver_matches("nvidia", "535.216.01", "550.54.15")
    assert "driver 535.216.01, but this host's Fabric Manager is 550.54.15" in err.value.message
    assert err.value.details == {
        "image": "nvidia",
        "image_driver": "535.216.01",
        "fabric_manager": "550.54.15",
    }
    with pytest.raises(FailedPrecondition, match="records no NVIDIA driver version"):
        check_driver_matches("minimal", None, "550.54.15")


def test_image_driver_version_from_dpkg_status(tmp_path: Path) -> None:
    status = tmp_path / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text(
        "Package: nvidia-kernel-dkms\nStatus: install ok installed\n"
        "Version: 535.216.01-1~deb12u1\nDescription: NVIDIA binary kernel module\n"
        " continued line: ignored\n\n"
        "Package: nvidia-driver\nStatus: deinstall ok config-files\nVersion: 1:470.1-1\n"
    )
    assert image_driver_version(tmp_path) == "535.216.01"
    assert image_driver_version(tmp_path / "absent") is None
    assert upstream_version("1:550.54.15-2") == "550.54.15"
    assert upstream_version("535.216.01") == "535.216.01"


# -- in-guest NVLink checks on real outputs ------------------------------------------------


def test_topology_parser_on_real_outputs() -> None:
    h100 = nvlink.parse_topology((GUEST / "h100x8_topo.out").read_text())
    assert len(h100) == 64 and h100[(0, 7)] == "NV18" and h100[(3, 3)] == "X"
    b200 = nvlink.parse_topology((GUEST / "b200x8_nics_topo.out").read_text())
    assert len(b200) == 64 and b200[(6, 1)] == "NV18"
    four = nvlink.parse_topology((GUEST / "h100x4_nv6_topo.out").read_text())
    assert sorted({cell for cell in four.values()}) == ["NV6", "X"]
    pcie = nvlink.parse_topology((GUEST / "rtx4090x8_sys_topo.out").read_text())
    assert pcie[(0, 1)] == "SYS" and len(pcie) == 64


def test_nvlink_status_parser_on_real_outputs() -> None:
    a100 = nvlink.parse_nvlink_status((GUEST / "a100x2_nvlink_status.out").read_text())
    assert [(g.index, g.name, len(g.active)) for g in a100] == [
        (0, "NVIDIA A100-SXM4-80GB", 12),
        (1, "NVIDIA A100-SXM4-80GB", 12),
    ]
    assert a100[1].uuid == "GPU-0c512562-871f-8257-6187-b5ae1b986d5e"
    v100 = nvlink.parse_nvlink_status((GUEST / "v100_inactive_nvlink_status.out").read_text())
    assert v100[0].index == 3 and v100[0].inactive == [3, 5] and v100[0].links[0] == 25.781


def test_cuda_802_is_recognised_in_real_outputs() -> None:
    for name in ("cuda802_bandwidthtest.out", "cuda802_pytorch_h200.out"):
        assert nvlink.cuda_error_802((GUEST / name).read_text())
    assert not nvlink.cuda_error_802("cuInit 0\n")


def guest(outputs: dict[str, tuple[int, str]]) -> nvlink.Runner:
    """A fake guest that answers each command from ``outputs`` (command -> status, stdout)."""

    def run(command: str, *, stdin: bytes | None = None, timeout: float | None = None):
        status, stdout = outputs[command]
        return ExecResult(status, stdout, "")

    return run


def test_check_passes_a_healthy_pair_and_reports_802_with_the_fix() -> None:
    pair = (GUEST / "a100x2_nvlink_status.out").read_text()
    topo = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV12\t0-7\nGPU1\tNV12\t X \t0-7\n"
    healthy = guest(
        {
            nvlink.CUDA_INIT: (0, "cuInit 0\n"),
            nvlink.NVLINK_STATUS: (0, pair),
            nvlink.TOPOLOGY: (0, topo),
        }
    )
    findings = nvlink.check(healthy, 2)
    assert [(f.check, f.ok) for f in findings] == [
        ("cuda-init", True),
        ("nvlink", True),
        ("topology", True),
    ]
    assert findings[1].message == "2 GPUs, 12 active links each"
    broken = guest(
        {
            nvlink.CUDA_INIT: (0, "cuInit 802\n"),
            nvlink.NVLINK_STATUS: (0, (GUEST / "v100_inactive_nvlink_status.out").read_text()),
            nvlink.TOPOLOGY: (0, (GUEST / "rtx4090x8_sys_topo.out").read_text()),
        }
    )
    cuda, links, topology = nvlink.check(broken, 8)
    assert not cuda.ok and cuda.message.startswith("fabric not initialised")
    assert "FABRIC_MODE=1" in cuda.message
    assert links.message == "it lists 1 GPUs, 8 expected; GPU 3 links 3, 5 are inactive"
    assert "pairs not connected by NVLink: GPU0-GPU1 SYS" in topology.message
    single = nvlink.check(guest({nvlink.CUDA_INIT: (0, "cuInit 0\n")}), 1)
    assert [f.check for f in single] == ["cuda-init"]


# -- vmsandbox gpus ------------------------------------------------------------------------


def test_gpus_report_shows_mode_and_partitions(fm: Path, hgx: Inventory, tmp_path: Path) -> None:
    cfg = tmp_path / "fabricmanager.cfg"
    cfg.write_text("FABRIC_MODE=1\n")
    config = Config.load("/nonexistent", fmpm=str(FAKE_FMPM), fabric_manager_config=str(cfg))
    fmpm().activate(5)
    busy = held(hgx, bc1="vmsbx-train")
    text, data = render.report(config, busy)
    lines = text.splitlines()
    assert lines[1] == f"fabric: shared-nvswitch (FABRIC_MODE=1 in {cfg})"
    assert lines[3].split() == ["PARTITION", "SIZE", "ACTIVE", "STATE", "GPUS"]
    assert lines[4].split()[:4] == ["0", "8", "no", "blocked:"]
    row5 = next(line for line in lines if line.startswith("5 "))
    assert row5.split() == ["5", "2", "yes", "held", "by", "vmsbx-train", HGX[6] + "," + HGX[7]]
    assert next(line for line in lines if line.startswith("7 ")).split()[3] == "free"
    assert data["mode"] == "shared-nvswitch"
    assert data["partitions"][5]["state"] == "held by vmsbx-train"
    assert data["partitions"][0]["gpus"][0]["bdf"] == "0000:41:00.0"
    (fm / "unreachable").touch()
    text, data = render.report(config, busy)
    assert "partitions: unavailable: UNAVAILABLE" in text
    assert data["error"]["code"] == "UNAVAILABLE"
    no_fm = Config.load("/nonexistent", fabric_manager_config=str(tmp_path / "absent.cfg"))
    text, data = render.report(no_fm, busy)
    assert text.splitlines()[1].startswith("fabric: full-passthrough (")
    assert data["partitions"] is None
    assert render.report(no_fm, replace(busy, fabric=())) == (
        "",
        {"mode": "none", "nvswitches": [], "source": "no NVSwitch on this host",
         "fabric_mode": None, "partitions": None},
    )  # fmt: skip


def test_fake_fmpm_rejects_unknown_options(fm: Path) -> None:
    done = subprocess.run([FAKE_FMPM, "--bogus"], capture_output=True, text=True, check=False)
    assert done.returncode == 255 and "Invalid argument." in done.stderr
    assert os.access(FAKE_FM, os.X_OK)


def test_lease_ledger_follows_activation(fm: Path, tmp_path: Path) -> None:
    config = Config.load(
        "/nonexistent", state_dir=str(tmp_path / "state"), fmpm=str(FAKE_FMPM), fm_version=DRIVER
    )
    lease = FabricLease(config)
    lease.release("uuid-nobody")  # no lease: FM is not asked
    assert not (fm / "calls.log").exists()
    lease.activate(1, "uuid-train", "train", image="nvidia", image_driver=DRIVER)
    with pytest.raises(FailedPrecondition, match="Failed to activate partition"):
        lease.activate(3, "uuid-other", "other", image="nvidia", image_driver=DRIVER)
    train = [Lease(1, "uuid-train", "train")]
    assert lease.leases() == train  # the refused one (it overlaps 1) left nothing
    with pytest.raises(FailedPrecondition, match=re.escape("NVIDIA driver 470.1, but")):
        lease.activate(2, "uuid-old", "old", image="old", image_driver="470.1")
    assert lease.leases() == train and "-a 2" not in (fm / "calls.log").read_text()
    assert lease.orphans({"uuid-train"}) == [] and lease.leases() == train
    lease.release("uuid-train")
    assert lease.leases() == [] and fmpm().list().active() == ()


def test_a_timed_out_activation_keeps_its_lease_until_released(fm: Path, tmp_path: Path) -> None:
    """fmpm -a that times out may have activated the partition: the lease stays, so the
    create's cleanup (or reconcile) deactivates it; before, it was dropped and the partition
    stayed active with no owner."""
    config = Config.load(
        "/nonexistent",
        state_dir=str(tmp_path / "state"),
        fmpm=str(FAKE_FMPM),
        fm_version=DRIVER,
        fmpm_timeout=1.0,
    )
    lease = FabricLease(config)
    (fm / "hang_after_activate").touch()
    with pytest.raises(Unavailable, match="did not finish within 1 s") as caught:
        lease.activate(4, "uuid-slow", "slow", image="nvidia", image_driver=DRIVER)
    assert "the lease of partition 4 is kept" in caught.value.__notes__[0]
    assert json.loads((fm / "active.json").read_text()) == [4]  # FM did activate it
    assert lease.leases() == [Lease(4, "uuid-slow", "slow")]
    (fm / "hang_after_activate").unlink()
    lease.release("uuid-slow")
    assert lease.leases() == [] and fmpm().list().active() == ()


def test_leases_written_before_uuids_are_matched_by_name(fm: Path, tmp_path: Path) -> None:
    config = Config.load(
        "/nonexistent", state_dir=str(tmp_path / "state"), fmpm=str(FAKE_FMPM), fm_version=DRIVER
    )
    lease = FabricLease(config)
    lease.activate(1, "uuid-train", "train", image="nvidia", image_driver=DRIVER)
    (config.state_dir / "fabric" / "1.json").write_text(json.dumps({"sandbox": "train"}))
    assert lease.leases() == [Lease(1, "", "train")]
    assert lease.orphans(set(), {"train"}) == [] and len(lease.leases()) == 1
    assert lease.orphans(set(), set()) == [1]
    assert lease.release_orphans([1]) == [] and lease.leases() == []


def test_a_lease_its_settled_reservation_does_not_name_is_an_orphan(
    fm: Path, tmp_path: Path
) -> None:
    """A suspended sandbox names no partition: a lease left for it (FM was down at its
    suspend) is an orphan, while the lease of the partition a reservation names is not."""
    config = Config.load(
        "/nonexistent", state_dir=str(tmp_path / "state"), fmpm=str(FAKE_FMPM), fm_version=DRIVER
    )
    lease = FabricLease(config)
    lease.activate(4, "uuid-box", "box", image="nvidia", image_driver=DRIVER)
    lease.activate(3, "uuid-train", "train", image="nvidia", image_driver=DRIVER)
    live = {"uuid-box", "uuid-train"}
    assert lease.orphans(live, (), {"uuid-box": 4, "uuid-train": 3}) == []
    assert lease.orphans(live, (), {"uuid-train": 3}) == []  # box at work: not judged
    assert lease.orphans(live, (), {"uuid-box": None, "uuid-train": 3}) == [4]
    assert lease.orphans(live, (), {"uuid-box": 5, "uuid-train": 3}) == [4]


def test_strays_are_leased_unless_named_or_their_gpus_are_held(fm: Path, tmp_path: Path) -> None:
    """FM has 1, 4 and 7 active and nothing leased: 1 is named (a reservation), a domain holds
    a GPU of 4; only 7 is a stray, leased as one until it is deactivated."""
    config = Config.load("/nonexistent", state_dir=str(tmp_path / "state"), fmpm=str(FAKE_FMPM))
    (fm / "active.json").write_text("[1, 4, 7]")
    table = fmpm().list()
    four, seven = table.by_id(4), table.by_id(7)
    assert four is not None and seven is not None
    held_gpu = sorted(four.bdfs)[0]
    lease = FabricLease(config)
    assert lease.claim_strays(table.active(), {1}, {held_gpu: "vmsbx-other"}) == [7]
    assert lease.leases() == [Lease(7, STRAY, "(active with no lease)")]
    assert lease.orphans({"uuid-any"}) == [7]  # a stray's lease is never a live sandbox's
    assert lease.release_orphans([7]) == [] and lease.leases() == []
    assert json.loads((fm / "active.json").read_text()) == [1, 4]
