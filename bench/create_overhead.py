"""Time to a running domain: ``vmsandbox create --no-wait`` against ``virt-install --import``.

A: ``vmsandbox create NAME --no-wait`` (overlay, keys, seed, domain XML, define, start) as a
whole process, until it returns with the domain running.

B: what a user does by hand for the same guest, as one shell script timed whole: a qcow2 overlay
of the same base image (``qemu-img create``), a client key (``ssh-keygen``), a NoCloud seed with
user-data, meta-data and network-config (``genisoimage``: cloud-localds is not in Debian 12's
default install, and virt-install's ``--cloud-init`` attaches the seed as a SATA CD-ROM that the
cloud kernel cannot read), then ``virt-install --import --noautoconsole`` booting the image's
kernel directly (``--boot kernel=,initrd=,kernel_args=``) under ``--virt-type qemu`` with the
same CPU, memory, disks and SSH port forward, until it returns with the domain running.

Both sizes: 1 vCPU, 1024 MiB, 4 GiB disk. Each domain is destroyed after its round (untimed).
virt-install makes a storage pool for the folder of its disks on first use; it is kept across
rounds (the warm-up pays for it) and removed at the end. Target: A at most half of B (median
ratio <= 0.5).

For scale, each round also times the floor both sides stand on: ``virsh create`` of the domain
XML vmsandbox would write, for files made beforehand (untimed): libvirt and QEMU starting the
guest. The report adds the ratio of the medians above that floor, (A - floor) / (B - floor).

Usage: .venv/bin/python bench/create_overhead.py [--rounds 5] [--warmup 1] [--out DIR]
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import common

TARGET_RATIO = 0.5
CPUS, MEMORY_MIB = 1, 1024


def baseline_script(folder: Path, name: str, port: int) -> str:
    """The shell script of side B: overlay, key, seed, virt-install."""
    from vmsandbox.image.store import ImageStore

    image = ImageStore(common.IMAGES).get(common.IMAGE)
    q = shlex.quote
    overlay, key, seed = folder / f"{name}.qcow2", folder / f"{name}-key", folder / f"{name}-seed"
    netdev = f"user,id=net0,hostfwd=tcp:127.0.0.1:{port}-:22,restrict=on"
    boot = f"kernel={image.kernel},initrd={image.initrd},kernel_args={image.cmdline}"
    commandline = f"-netdev {netdev} -device virtio-net-pci,netdev=net0,bus=pcie.0,addr=0x10"
    return f"""set -euo pipefail
qemu-img create -q -f qcow2 -F qcow2 -b {q(str(image.disk))} {q(str(overlay))} {common.DISK_GIB}G
ssh-keygen -q -t ed25519 -N '' -C {name} -f {q(str(key))}
mkdir {q(str(seed))}
cat > {q(str(seed))}/meta-data <<EOF
instance-id: {name}
local-hostname: {name}
EOF
cat > {q(str(seed))}/user-data <<EOF
#cloud-config
users:
  - name: sandbox
    shell: /bin/bash
    sudo: ALL=(ALL) NOPASSWD:ALL
    ssh_authorized_keys:
      - $(cat {q(str(key))}.pub)
EOF
cat > {q(str(seed))}/network-config <<EOF
version: 2
ethernets:
  eth0: {{addresses: [10.0.2.15/24], gateway4: 10.0.2.2, nameservers: {{addresses: [10.0.2.3]}}}}
EOF
genisoimage -quiet -output {q(str(seed))}.iso -volid cidata -joliet -rock \\
  {q(str(seed))}/user-data {q(str(seed))}/meta-data {q(str(seed))}/network-config
virt-install --import --noautoconsole --name {name} --virt-type qemu --machine q35 \\
  --vcpus {CPUS} --memory {MEMORY_MIB} --osinfo detect=on,require=off \\
  --boot {q(boot)} \\
  --disk path={q(str(overlay))},format=qcow2,bus=virtio \\
  --disk path={q(str(seed))}.iso,format=raw,bus=virtio,readonly=on \\
  --graphics none --network none --qemu-commandline={q(commandline)}
"""


def remove_pools(folder: Path) -> None:
    """Remove the storage pools virt-install made for ``folder`` (they outlive the domains)."""
    virsh = ["virsh", "-q", "-c", "qemu:///system"]
    names = subprocess.run(
        [*virsh, "pool-list", "--all", "--name"], capture_output=True, text=True, check=False
    )
    for pool in names.stdout.split():
        path = subprocess.run(
            [*virsh, "pool-dumpxml", pool, "--xpath", "/pool/target/path/text()"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if path == str(folder):
            subprocess.run([*virsh, "pool-destroy", pool], capture_output=True, check=False)
            subprocess.run([*virsh, "pool-undefine", pool], capture_output=True, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parse_args(common.arguments(__doc__), argv)
    common.require("virt-install", "virsh", "genisoimage", "ssh-keygen", "qemu-img")
    report = common.Report("create_overhead", args.rounds, args.warmup)
    with (
        common.state_dir("co") as state,
        common.state_dir("co-virt-install") as folder,
        common.Cleanup() as cleanup,
    ):
        env = common.vmsandbox_env(state)
        cleanup.add("pools", lambda: remove_pools(folder))

        def vmsandbox(tag: str) -> float:
            name = common.name("co", tag)
            cleanup.add(tag, lambda: common.destroy_sandbox(name, env))
            return common.timed([common.VMSANDBOX, "create", name, "--no-wait"], env=env)

        def virt_install(tag: str) -> float:
            name = common.name("co", tag)
            script = folder / f"{name}.sh"
            script.write_text(baseline_script(folder, name, common.free_port()))
            cleanup.add(tag, lambda: remove_baseline(folder, name))
            return common.timed(["bash", str(script)])

        def floor(tag: str) -> float:
            made = common.hand_made(folder, common.name("co", tag))
            cleanup.add(tag, lambda: common.remove_hand_made(made))
            return common.timed(["virsh", "-q", "-c", "qemu:///system", "create", str(made.xml)])

        print("vmsandbox create --no-wait against overlay + seed + virt-install", flush=True)
        comparison = common.alternate(
            "create until the domain runs",
            ("vmsandbox create --no-wait", vmsandbox),
            ("qemu-img + ssh-keygen + genisoimage + virt-install", virt_install),
            ("floor: virsh create of a ready XML", floor),
            rounds=args.rounds,
            warmup=args.warmup,
            after=cleanup.now,
        )
    report.extra["virt_install"] = common.run(["virt-install", "--version"]).stdout.strip()
    report.comparisons.append(comparison)
    floor_s = comparison.refs[0].median
    above = (comparison.a.median - floor_s) / (comparison.b.median - floor_s)
    report.checks += [
        common.at_most(
            "vmsandbox / virt-install, median ratio", comparison.median_ratio, TARGET_RATIO, "x"
        ),
        common.Check("the same, medians above the floor only", above, "x", "-", None),
    ]
    report.write(args.out)
    return 0


def remove_baseline(folder: Path, name: str) -> None:
    """Side B's domain and files."""
    common.remove_domain(name)
    for path in folder.glob(f"{name}*"):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


if __name__ == "__main__":
    sys.exit(common.entry(main))
