"""GPU sandboxes on fake hosts (umockdev) against the real libvirtd: the start failure path, the
host without GPUs, and exclusive allocation across processes."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from framework.fake_hosts import umockdev_run
from framework.paths import REPO
from framework.sandboxes import cli, cli_env, leftovers

from vmsandbox.config import Config
from vmsandbox.image.build import LATE_NIC_ARG


def _with_testbed(config: Config, umockdev_env: dict[str, str]) -> dict[str, str]:
    """The CLI environment of ``config`` plus umockdev's testbed folder."""
    testbed = {k: v for k, v in umockdev_env.items() if k == "TMPDIR"}
    return cli_env(config, **testbed)


def _under(
    host: str, config: Config, *command: str, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    with umockdev_run(host) as (prefix, env):
        return subprocess.run(
            [*prefix, *command],
            capture_output=True,
            text=True,
            timeout=300,
            env={**_with_testbed(config, env), **env_extra},
            check=False,
        )


def _vmsandbox(*args: str) -> list[str]:
    return [sys.executable, "-m", "vmsandbox.cli", *args]


def test_real_start_is_refused_with_libvirts_words_and_leaves_nothing(config: Config):
    done = _under("hgx_h100", config, *_vmsandbox("create", "t-gpu-start", "--gpu"))
    assert done.returncode == 5, done.stderr
    assert "error: FAILED_PRECONDITION: starting sandbox 't-gpu-start': libvirt refused" in (
        done.stderr
    )
    assert "passthrough" in done.stderr
    assert leftovers(config, "t-gpu-start") == []
    inventory = json.loads(_under("hgx_h100", config, *_vmsandbox("gpus", "--json")).stdout)
    assert [g["in_use_by"] for g in inventory["gpus"]] == [None] * 8


def test_dry_run_prints_valid_xml_and_defines_nothing(config: Config, tmp_path: Path):
    # the fake HGX host has no Fabric Manager config: full passthrough, so the whole board
    done = _under(
        "hgx_h100", config, *_vmsandbox("create", "t-dry", "--gpu-count", "8", "--dry-run")
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("gpu: 0000:") == 8
    xml = tmp_path / "dry.xml"
    xml.write_text(done.stdout)
    subprocess.run(["virt-xml-validate", str(xml), "domain"], check=True, capture_output=True)
    assert done.stdout.count("<hostdev ") == 12  # and the four NVSwitches
    # the lean initramfs leaves the NIC's driver to udev in a guest booting with GPUs
    assert f" {LATE_NIC_ARG}</cmdline>" in done.stdout
    plain = _under("hgx_h100", config, *_vmsandbox("create", "t-dry", "--dry-run"))
    assert plain.returncode == 0 and LATE_NIC_ARG not in plain.stdout
    assert leftovers(config, "t-dry") == []


def test_gpu_firmware_uefi_for_large_bars_and_as_the_operator_says(config: Config):
    dry = ("create", "t-fw", "--gpu", "--dry-run")
    auto = _under("hgx_h100", config, *_vmsandbox(*dry))
    assert auto.returncode == 0, auto.stderr
    assert "<loader" in auto.stdout and "X-PciMmio64Mb" in auto.stdout  # 128 GiB BAR1: OVMF
    bios = _under("hgx_h100", config, *_vmsandbox(*dry), VMSANDBOX_GPU_FIRMWARE="bios")
    assert bios.returncode == 0, bios.stderr
    assert "<loader" not in bios.stdout and "<nvram" not in bios.stdout
    assert "X-PciMmio64Mb" not in bios.stdout and '<rom bar="off"/>' in bios.stdout
    assert leftovers(config, "t-fw") == []


def test_this_machine_without_gpus_says_why(config: Config):
    done = cli("create", "t-nogpu", "--gpu", config=config)
    assert done.returncode == 5
    assert "error: FAILED_PRECONDITION: this host can never give 1 GPU" in done.stderr
    assert leftovers(config, "t-nogpu") == []


WORKER = textwrap.dedent(
    """
    import json, sys, time
    from vmsandbox.config import Config
    from vmsandbox.errors import ResourceExhausted
    from vmsandbox.sandbox.manager import SandboxManager
    from vmsandbox.gpu.request import GpuRequest
    from vmsandbox.sandbox.spec import SandboxSpec

    worker, rounds = int(sys.argv[1]), int(sys.argv[2])
    manager = SandboxManager(Config.load(), reconcile=False)
    for n in range(rounds):
        name = f"t-alloc-{worker}-{n}"
        while True:
            try:
                box = manager.create(SandboxSpec(name=name, gpu=GpuRequest(count=1)), start=False)
                break
            except ResourceExhausted:
                time.sleep(0.01)
        start = time.time()
        time.sleep(0.05)
        end = time.time()
        print(json.dumps({"bdfs": [g["bdf"] for g in box.gpus], "start": start, "end": end}))
        manager.destroy(name)
    """
)


def test_concurrent_creates_never_share_a_gpu(config: Config):
    """4 processes x 6 rounds of 1 GPU on the 8-GPU host (full passthrough without Fabric
    Manager allows 1 or all 8): holds of one GPU never overlap.

    Each worker logs the span in which it surely holds its GPUs (from create's return to the
    call of destroy); two such spans of one GPU overlapping would be a double allocation.
    """
    workers, rounds = 4, 6
    with umockdev_run("hgx_h100") as (prefix, env):
        procs = [
            subprocess.Popen(
                [*prefix, sys.executable, "-c", WORKER, str(w), str(rounds)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_with_testbed(config, env),
                cwd=REPO,
            )
            for w in range(workers)
        ]
        outputs = [proc.communicate(timeout=600) for proc in procs]
    holds = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        holds += [json.loads(line) for line in out.splitlines()]
    assert len(holds) == workers * rounds
    by_gpu: dict[str, list[tuple[float, float]]] = {}
    for hold in holds:
        assert len(set(hold["bdfs"])) == 1
        for bdf in hold["bdfs"]:
            by_gpu.setdefault(bdf, []).append((hold["start"], hold["end"]))
    for bdf, spans in by_gpu.items():
        spans.sort()
        for (_s1, e1), (s2, _e2) in itertools.pairwise(spans):
            assert e1 <= s2, f"{bdf} was held twice at once"
    for w in range(workers):
        for n in range(rounds):
            assert leftovers(config, f"t-alloc-{w}-{n}") == []
