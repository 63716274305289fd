"""The first boot without an interpreter (guest/programs/firstboot_lean.sh), on the host: busybox
runs it, as the minimal image's initramfs does, on the seed vmsandbox writes (read back from a
real ISO), into a root folder of the test's own, in namespaces of its own (its hostname and a
veth NIC of the seed's MAC, brought up for real). What it writes is what the Python unit
(firstboot.py) writes, and the user it makes is the one useradd makes. Its run in a real guest is
covered by the e2e tests that boot the minimal image."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from framework.seeds import read_iso

from vmsandbox.guest.keys import KeyPair, generate
from vmsandbox.guest.programs import firstboot, firstboot_seed
from vmsandbox.guest.seed import LEAN_FILE, network_config, write_seed
from vmsandbox.guest.setup import GuestSetup

SCRIPT = Path(firstboot.__file__).with_name("firstboot_lean.sh")
MAC = "52:54:00:ab:cd:ef"
SEED_FILES = ("user-data", "meta-data", "network-config", LEAN_FILE)
SYSTEM_USERS = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\nsshd:x:101:65534::/run/sshd:/usr/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": "root:x:0:\nsudo:x:27:\nnogroup:x:65534:\n",
    "shadow": "root:*:19000:0:99999:7:::\nsshd:!:19000::::::\nnobody:*:19000:0:99999:7:::\n",
    "gshadow": "root:*::\nsudo:*::\nnogroup:*::\n",
    "subuid": "",
    "subgid": "",
}


@pytest.fixture(scope="module")
def busybox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of busybox's applets, the only programs the initramfs has."""
    found = shutil.which("busybox")
    assert found, "busybox is missing: apt-get install busybox-static (setup/setup.sh does)"
    folder = tmp_path_factory.mktemp("busybox")
    applets = subprocess.run([found, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        (folder / applet).symlink_to(found)
    return folder


def make_seed(
    folder: Path, guest: GuestSetup | None = None, host: KeyPair | None = None
) -> tuple[Path, KeyPair, KeyPair]:
    """The seed of instance iid-7 (hostname box, user sandbox), its files read back from the
    ISO into ``folder``, as /init mounts it; with the client and host key pairs."""
    client, host = generate("c"), host or generate("h")
    iso = folder / "seed.iso"
    write_seed(
        iso,
        instance_id="iid-7",
        hostname="box",
        user="sandbox",
        client=client,
        host=host,
        network=network_config(MAC, user_net=True),
        workdir=folder,
        guest=guest,
    )
    seed = folder / "seed"
    seed.mkdir()
    listing = subprocess.run(
        ["isoinfo", "-R", "-f", "-i", str(iso)], capture_output=True, text=True
    )
    for name in SEED_FILES:
        if f"/{name}" in listing.stdout.split():
            (seed / name).write_text(read_iso(iso, name))
    return seed, client, host


def make_root(folder: Path) -> Path:
    """A root with Debian's account files, login.defs and skel, and a stale host key."""
    root = folder / "root"
    (root / "etc/ssh").mkdir(parents=True)
    (root / "home").mkdir()
    for name, text in SYSTEM_USERS.items():
        (root / "etc" / name).write_text(text)
    shutil.copy("/etc/login.defs", root / "etc/login.defs")
    shutil.copytree("/etc/skel", root / "etc/skel")
    (root / "etc/ssh/ssh_host_rsa_key").write_text("stale")
    (root / "etc/resolv.conf").symlink_to("/run/elsewhere")
    return root


def boot(busybox: Path, seed: Path, root: Path, *, nic: str | None = "eth9") -> tuple[int, str]:
    """Run the script as /init does, in new UTS, network and mount namespaces with sysfs of
    the new network namespace and (``nic``) a veth NIC of the seed's MAC under that name;
    its exit status and output, then the namespace's hostname and eth0's addresses."""
    setup = "mount -t sysfs sysfs /sys"
    if nic:
        setup += (
            f" && ip link add {nic} type veth peer name peer9 && ip link set {nic} address {MAC}"
        )
    command = (
        f"{setup} && PATH={busybox} busybox sh {SCRIPT} {seed} {root} /dev/vdb; status=$?; "
        "echo status=$status; echo hostname=$(hostname); ip -4 -o address show dev eth0; "
        "ip route show default"
    )
    done = subprocess.run(
        ["unshare", "--uts", "--net", "--mount", "sh", "-c", command],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    lines = done.stdout.splitlines()
    status = next(int(line[7:]) for line in lines if line.startswith("status="))
    return status, done.stdout + done.stderr


def test_the_seed_is_applied_as_the_python_unit_and_useradd_would(
    busybox: Path, tmp_path: Path
) -> None:
    seed, client, host = make_seed(tmp_path)
    root = make_root(tmp_path)
    status, out = boot(busybox, seed, root)
    assert status == 0, out
    assert out.splitlines()[:3] == [
        "vmsandbox-firstboot: reading the NoCloud seed on /dev/vdb",
        "vmsandbox-firstboot: eth0 is up at 10.0.2.15/24",
        "vmsandbox-firstboot: box is set up (instance iid-7)",
    ]
    assert "hostname=box" in out
    assert "inet 10.0.2.15/24" in out and "default via 10.0.2.2 dev eth0" in out

    def mode(path: str) -> int:
        return (root / path).stat().st_mode & 0o7777

    # the host key pair, alone, as the seed has it
    assert sorted(p.name for p in (root / "etc/ssh").iterdir()) == [
        "ssh_host_ed25519_key",
        "ssh_host_ed25519_key.pub",
    ]
    assert (root / "etc/ssh/ssh_host_ed25519_key").read_text() == host.private_openssh
    assert (root / "etc/ssh/ssh_host_ed25519_key.pub").read_text() == host.public_openssh + "\n"
    assert (mode("etc/ssh/ssh_host_ed25519_key"), mode("etc/ssh/ssh_host_ed25519_key.pub")) == (
        0o600,
        0o644,
    )
    # the user, as useradd --create-home --user-group makes it on the same files
    other = make_root(tmp_path / "useradd")
    useradd = ["useradd", "--root", str(other), "--create-home", "--user-group"]
    subprocess.run([*useradd, "--shell", "/bin/bash", "sandbox"], capture_output=True, check=True)
    for name in ("passwd", "group", "shadow", "gshadow"):
        assert (root / "etc" / name).read_text() == (other / "etc" / name).read_text(), name
    assert "sandbox:x:1000:1000::/home/sandbox:/bin/bash\n" in (root / "etc/passwd").read_text()
    for name in ("subuid", "subgid"):  # as the guest's useradd adds them (not under --root)
        assert (root / "etc" / name).read_text() == "sandbox:100000:65536\n"
    home = root / "home/sandbox"
    assert sorted(p.name for p in home.iterdir()) == sorted(
        [*(p.name for p in (other / "home/sandbox").iterdir()), ".ssh"]
    )
    assert all((p.stat().st_uid, p.stat().st_gid) == (1000, 1000) for p in [home, *home.rglob("*")])
    assert mode("home/sandbox") == 0o755
    assert (home / ".ssh/authorized_keys").read_text() == client.public_openssh + "\n"
    assert (mode("home/sandbox/.ssh"), mode("home/sandbox/.ssh/authorized_keys")) == (0o700, 0o600)
    sudoers = root / "etc/sudoers.d/90-vmsandbox-users"
    assert sudoers.read_text() == "sandbox ALL=(ALL) NOPASSWD:ALL\n" and mode(str(sudoers)) == 0o440
    # hostname, hosts, networkd and resolv.conf: what the Python unit writes for the same seed
    parsed = firstboot_seed.parse(*((seed / name).read_text() for name in SEED_FILES[:3]))
    python = tmp_path / "python"
    firstboot.apply_hostname(parsed, python, kernel=tmp_path / "kernel-hostname")
    firstboot.apply_network(parsed, python, tmp_path / "no-net", run=lambda argv: None)
    written = sorted(p.relative_to(python) for p in python.rglob("*") if p.is_file())
    assert written
    for path in written:
        assert (root / path).read_text() == (python / path).read_text(), path
        assert mode(str(path)) == 0o644, path
    assert not (root / "etc/resolv.conf").is_symlink()
    assert (root / "var/lib/vmsandbox/instance-id").read_text() == "iid-7\n"
    assert mode("var/lib/vmsandbox") == 0o700


def test_a_later_boot_of_the_instance_only_brings_the_nic_up(busybox: Path, tmp_path: Path) -> None:
    """Once per instance-id, as the Python unit: the NIC (named eth0 by then) at every boot."""
    seed, _client, _host = make_seed(tmp_path)
    root = make_root(tmp_path)
    assert boot(busybox, seed, root)[0] == 0
    accounts = {name: (root / "etc" / name).read_text() for name in SYSTEM_USERS}
    (root / "etc/hostname").write_text("renamed\n")  # a claim renamed it since
    status, out = boot(busybox, seed, root, nic="eth0")
    assert status == 0, out
    assert out.splitlines()[:3] == [
        "vmsandbox-firstboot: reading the NoCloud seed on /dev/vdb",
        "vmsandbox-firstboot: instance iid-7 is set up already",
        "vmsandbox-firstboot: eth0 is up at 10.0.2.15/24",
    ]
    assert {name: (root / "etc" / name).read_text() for name in SYSTEM_USERS} == accounts
    assert (root / "etc/hostname").read_text() == "renamed\n"


def test_a_user_the_image_has_is_kept_and_a_new_one_gets_the_next_ids(
    busybox: Path, tmp_path: Path
) -> None:
    seed, client, _host = make_seed(tmp_path)
    root = make_root(tmp_path)
    with (root / "etc/passwd").open("a") as passwd:
        passwd.write("alice:x:1000:1000::/home/alice:/bin/sh\n")
    with (root / "etc/group").open("a") as group:
        group.write("alice:x:1000:\nbobs:x:1001:\n")
    with (root / "etc/subuid").open("a") as subuid:
        subuid.write("alice:100000:65536\n")
    assert boot(busybox, seed, root)[0] == 0
    assert "sandbox:x:1001:1002::/home/sandbox:/bin/bash\n" in (root / "etc/passwd").read_text()
    assert (root / "etc/subuid").read_text().endswith("sandbox:165536:65536\n")
    # a user already there keeps its account; only its key and sudo rule are written
    again = make_root(tmp_path / "again")
    with (again / "etc/passwd").open("a") as passwd:
        passwd.write("sandbox:x:1500:1500::/srv/sandbox:/bin/sh\n")
    before = (again / "etc/passwd").read_text()
    (again / "srv/sandbox").mkdir(parents=True)
    assert boot(busybox, seed, again)[0] == 0
    assert (again / "etc/passwd").read_text() == before
    assert (again / "srv/sandbox/.ssh/authorized_keys").read_text() == client.public_openssh + "\n"


def test_a_nic_whose_driver_is_not_loaded_is_left_to_networkd(
    busybox: Path, tmp_path: Path
) -> None:
    """vmsandbox.nic=late: no NIC yet; its networkd files are written, nothing is brought up."""
    seed, _client, _host = make_seed(tmp_path)
    root = make_root(tmp_path)
    status, out = boot(busybox, seed, root, nic=None)
    assert status == 0, out
    assert "is up at" not in out and "box is set up (instance iid-7)" in out
    assert (root / "etc/systemd/network/50-vmsandbox-eth0.network").exists()


def test_a_seed_with_guest_setup_is_left_to_the_python_unit(busybox: Path, tmp_path: Path) -> None:
    seed, _client, _host = make_seed(tmp_path, guest=GuestSetup(main=("sleep", "1")))
    assert not (seed / LEAN_FILE).exists()
    root = make_root(tmp_path)
    status, out = boot(busybox, seed, root)
    assert (status, "vmsandbox-firstboot" in out) == (3, False)
    assert not (root / "var/lib/vmsandbox").exists()


def test_a_file_of_another_format_is_left_to_the_python_unit(busybox: Path, tmp_path: Path) -> None:
    seed, _client, _host = make_seed(tmp_path)
    lean = seed / LEAN_FILE
    lean.write_text(lean.read_text().replace("format 1\n", "format 2\n"))
    root = make_root(tmp_path)
    status, out = boot(busybox, seed, root)
    assert status == 3
    assert "note: seed format '2' is not 1: left to the first-boot unit" in out
    assert not (root / "var/lib/vmsandbox").exists()


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("hostname", "box;reboot", "hostname 'box;reboot' is not a host name"),
        ("user", "x$(id) /bin/bash", "user 'x$(id)' is not a user name"),
        ("user", "sandbox bash", "user shell 'bash' is not an absolute path"),
        ("host-key", "../../etc/passwd AAAA", "host-key '../../etc/passwd' is not an SSH host"),
        ("nic", "52:54:00:ab:cd:ef eth0 10.0.2.15/24", "nic '52:54:00:ab:cd:ef eth0 10.0.2.15/24'"),
        ("nic", "52:54:00:ab:cd:ef eth0 10.0.2.15 10.0.2.2", "has no prefix length"),
        ("nic", "52:54:00:ab:cd:ef eth0 10.0.2.15/24 10.0.2.2 dns.example", "not an IPv4"),
        ("nic", "52:54:00:AB:cd:ef eth0 10.0.2.15/24 10.0.2.2", "not a lowercase MAC"),
        ("reboot", "now", "line 10: 'reboot' is not understood"),
    ],
)
def test_a_bad_value_stops_it_by_name_before_anything_changes(
    busybox: Path, tmp_path: Path, key: str, value: str, says: str
) -> None:
    """Its error line is one vmsandbox's boot watcher fails the create on at once."""
    seed, _client, _host = make_seed(tmp_path)
    lean = seed / LEAN_FILE
    lines = lean.read_text().splitlines()
    kept = [line for line in lines if not line.startswith(f"{key} ")] if key != "reboot" else lines
    if key == "host-key":
        kept.append(lines[[line.split()[0] for line in lines].index("host-key")])
    lean.write_text("\n".join([*kept, f"{key} {value}"]) + "\n")
    root = make_root(tmp_path)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    status, out = boot(busybox, seed, root)
    assert status == 1, out
    errors = [line for line in out.splitlines() if line.startswith("vmsandbox-firstboot: error: ")]
    assert len(errors) == 1 and says in errors[0], out
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert "hostname=box" not in out


def test_the_seed_file_is_written_only_for_what_the_script_applies(tmp_path: Path) -> None:
    """No guest setup and one static NIC; a value that would not fit on its line leaves the
    seed to the Python unit, which refuses it by name."""
    seed, client, host = make_seed(tmp_path)
    assert (seed / LEAN_FILE).read_text().splitlines()[:6] == [
        "format 1",
        "instance-id iid-7",
        "hostname box",
        "user sandbox /bin/bash",
        "sudo ALL=(ALL) NOPASSWD:ALL",
        f"authorized-key {client.public_openssh}",
    ]
    dhcp = tmp_path / "dhcp.iso"
    write_seed(
        dhcp,
        instance_id="iid-8",
        hostname="box",
        user="sandbox",
        client=client,
        host=host,
        network=network_config(MAC, user_net=False),
        workdir=tmp_path,
    )
    listing = subprocess.run(
        ["isoinfo", "-R", "-f", "-i", str(dhcp)], capture_output=True, text=True
    )
    assert f"/{LEAN_FILE}" not in listing.stdout.split()
    hostile = tmp_path / "hostile.iso"
    write_seed(
        hostile,
        instance_id="iid-9",
        hostname="x\nuser root /bin/sh",
        user="sandbox",
        client=client,
        host=host,
        network=network_config(MAC, user_net=True),
        workdir=tmp_path,
    )
    listing = subprocess.run(
        ["isoinfo", "-R", "-f", "-i", str(hostile)], capture_output=True, text=True
    )
    assert f"/{LEAN_FILE}" not in listing.stdout.split()
    assert os.stat(hostile).st_mode & 0o777 == 0o600
