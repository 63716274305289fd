"""The project images' first-boot unit (guest/programs/firstboot*.py), on the host: it reads the
seed vmsandbox writes (a real ISO, through isoinfo), refuses every key it does not apply by name,
and applies a seed into a root folder of the test's own. Its run in a real guest is covered by
the e2e lifecycle, pool, guest setup and OpenShell tests, which boot the minimal image."""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from framework.seeds import read_iso
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vmsandbox.guest.keys import generate
from vmsandbox.guest.programs import firstboot, firstboot_iso, firstboot_seed
from vmsandbox.guest.programs.firstboot_seed import SeedError
from vmsandbox.guest.seed import meta_data, network_config, user_data, write_seed
from vmsandbox.guest.setup import ENVIRONMENT_FILE, MAIN_UNIT, GuestFile, GuestSetup
from vmsandbox.image.recipe import RECIPE_DIR, load_recipe, recipe_names

MAC = "52:54:00:ab:cd:ef"
SETUP = GuestSetup(
    environment={"GREETING": "hi"},
    files=(GuestFile("/etc/openshell/token", "s3cret", mode="0600"),),
    main=("sleep", "1"),
)


def _seed_files(tmp_path: Path, guest: GuestSetup | None = SETUP) -> tuple[Path, tuple[str, ...]]:
    iso = tmp_path / "seed.iso"
    write_seed(
        iso,
        instance_id="iid-7",
        hostname="box",
        user="sandbox",
        client=generate("c"),
        host=generate("h"),
        network=network_config(MAC, user_net=True),
        workdir=tmp_path,
        guest=guest,
    )
    return iso, tuple(read_iso(iso, name) for name in ("user-data", "meta-data", "network-config"))


def _texts(config: dict[str, Any], meta: dict[str, Any] | None = None, net: Any = None) -> tuple:
    network = net if net is not None else network_config(MAC, user_net=True)
    return (
        "#cloud-config\n" + json.dumps(config),
        json.dumps(meta or meta_data("iid", "box")),
        json.dumps(network),
    )


def _base() -> dict[str, Any]:
    return user_data("box", "sandbox", generate("c"), generate("h"))


def test_the_seed_vmsandbox_writes_is_read_whole(tmp_path: Path):
    iso, texts = _seed_files(tmp_path)
    assert firstboot_iso._volume_label(iso) == firstboot_iso.LABEL  # how the unit finds the seed
    seed = firstboot_seed.parse(*texts)
    assert (seed.instance_id, seed.hostname, seed.manage_etc_hosts) == ("iid-7", "box", True)
    (user,) = seed.users
    assert (user.name, user.shell, user.sudo) == ("sandbox", "/bin/bash", "ALL=(ALL) NOPASSWD:ALL")
    assert len(user.keys) == 1 and user.keys[0].startswith("ssh-ed25519 ")
    assert sorted(seed.host_keys) == ["ssh_host_ed25519_key", "ssh_host_ed25519_key.pub"]
    assert "PRIVATE KEY" in seed.host_keys["ssh_host_ed25519_key"]
    assert seed.delete_host_keys
    files = {item.path: item for item in seed.files}
    token = files["/etc/openshell/token"]
    assert (token.data, token.mode, token.owner, token.group) == (b"s3cret", 0o600, "root", "root")
    assert files["/etc/environment"].append
    assert files[ENVIRONMENT_FILE].data == b'GREETING="hi"\n'
    assert f"/etc/systemd/system/{MAIN_UNIT}" in files
    assert seed.runcmd[-1] == ["systemctl", "start", "--no-block", MAIN_UNIT]
    (nic,) = seed.nics
    assert (nic.mac, nic.name, nic.addresses, nic.gateway) == (
        MAC,
        "eth0",
        ("10.0.2.15/24",),
        "10.0.2.2",
    )
    assert (nic.nameservers, nic.dhcp) == (("10.0.2.3",), False)


@pytest.mark.parametrize("guest", [SETUP, None])
def test_the_unit_reads_the_seed_without_mounting_it(tmp_path: Path, guest: GuestSetup | None):
    iso, texts = _seed_files(tmp_path, guest)
    assert firstboot_iso.read_seed(iso) == texts  # the same bytes isoinfo finds


def _iso(tmp_path: Path, files: dict[str, bytes], *options: str) -> Path:
    """An ISO 9660 volume labelled cidata holding ``files``, made by genisoimage."""
    folder = tmp_path / "files"
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    iso = tmp_path / "volume.iso"
    argv = ["genisoimage", "-quiet", "-output", str(iso), "-volid", "cidata", *options]
    subprocess.run([*argv, *(str(folder / name) for name in files)], check=True)
    return iso


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    user_data=st.text(max_size=5000),
    meta=st.text(min_size=1, max_size=300),
    network=st.one_of(st.none(), st.text(max_size=3000)),
)
def test_any_seed_text_is_read_back_as_written(
    tmp_path: Path, user_data: str, meta: str, network: str | None
):
    files = {"user-data": user_data.encode(), "meta-data": meta.encode()}
    if network is not None:
        files["network-config"] = network.encode()
    for old in tmp_path.glob("files/*"):
        old.unlink()
    iso = _iso(tmp_path, files, "-joliet", "-rock")
    assert firstboot_iso.read_seed(iso) == (user_data, meta, network or "")


def test_a_seed_without_meta_data_or_joliet_names_what_is_missing(tmp_path: Path):
    iso = _iso(tmp_path, {"user-data": b"#cloud-config\n{}"}, "-joliet", "-rock")
    with pytest.raises(SeedError, match=f"the seed on {iso} has no meta-data"):
        firstboot_iso.read_seed(iso)
    iso = _iso(tmp_path, {"meta-data": b"{}"}, "-rock")
    with pytest.raises(SeedError, match="has no Joliet directory"):
        firstboot_iso.read_seed(iso)
    (tmp_path / "zeros").write_bytes(bytes(64 * 1024))
    with pytest.raises(SeedError, match="has no Joliet directory"):
        firstboot_iso.read_seed(tmp_path / "zeros")


def test_a_seed_without_guest_setup_has_no_commands(tmp_path: Path):
    _iso, texts = _seed_files(tmp_path, guest=None)
    assert firstboot_seed.parse(*texts).runcmd == ()


def test_a_libvirt_network_nic_uses_dhcp(tmp_path: Path):
    seed = firstboot_seed.parse(*_texts(_base(), net=network_config(MAC, user_net=False)))
    (nic,) = seed.nics
    assert nic.dhcp and nic.addresses == ()
    (tmp_path / "net/eth0").mkdir(parents=True)
    (tmp_path / "net/eth0/address").write_text(MAC)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/resolv.conf").write_text("nameserver 192.0.2.1\n")  # the image build's
    ran: list[list[str]] = []
    firstboot.apply_network(seed, tmp_path, tmp_path / "net", run=ran.append)
    network = (tmp_path / "etc/systemd/network/50-vmsandbox-eth0.network").read_text()
    assert network == f"[Match]\nMACAddress={MAC}\n\n[Network]\nDHCP=ipv4\n"
    # The lease's name servers reach resolv.conf through systemd-resolved, started now.
    resolv = tmp_path / "etc/resolv.conf"
    assert os.readlink(resolv) == "../run/systemd/resolve/stub-resolv.conf"
    assert ran == [["systemctl", "enable", "--now", "--no-block", "systemd-resolved.service"]]


def _with(path: str, value: Any) -> tuple:
    """Texts of a valid seed with one value set at ``path`` (file/key/key...)."""
    config, meta = _base(), meta_data("iid", "box")
    net = network_config(MAC, user_net=True)
    where, *keys = path.split("/")
    target: Any = {"user": config, "meta": meta, "net": net}[where]
    for key in keys[:-1]:
        target = target[int(key)] if isinstance(target, list) else target[key]
    target[keys[-1]] = value
    return _texts(config, meta, net)


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        ("user/bootcmd", ["reboot"], "user-data key 'bootcmd' is not understood"),
        ("user/users/0/groups", "adm", "user-data users[0] key 'groups' is not understood"),
        ("user/ssh_keys/dsa_private", "x", "user-data ssh_keys key 'dsa_private'"),
        ("user/write_files", [{"path": "/x", "defer": True}], "write_files[0] key 'defer'"),
        ("user/write_files", [{"path": "/x", "encoding": "gzip"}], "encoding 'gzip'"),
        ("user/write_files", [{"path": "x"}], "path must be absolute"),
        ("user/write_files", [{"path": "/x", "permissions": "rw"}], "permissions must be octal"),
        ("user/ssh_genkeytypes", ["rsa"], "ssh_genkeytypes must be []"),
        ("user/disable_root", False, "disable_root must be true"),
        ("user/users/0/lock_passwd", False, "lock_passwd must be true"),
        ("user/runcmd", [["ok"], 3], "runcmd[1] must be a shell line or a list of words"),
        ("meta/public-keys", ["k"], "meta-data key 'public-keys' is not understood"),
        ("net/ethernets/eth0/dhcp6", True, "ethernets.eth0 key 'dhcp6' is not understood"),
        ("net/version", 1, "network-config version must be 2"),
    ],
)
def test_what_the_unit_does_not_apply_is_refused_by_name(path: str, value: Any, says: str):
    with pytest.raises(SeedError) as caught:
        firstboot_seed.parse(*_with(path, value))
    assert says in str(caught.value)


def test_a_seed_that_is_not_vmsandboxs_json_is_refused():
    with pytest.raises(SeedError, match="not the JSON that vmsandbox writes"):
        firstboot_seed.parse("#cloud-config\nusers:\n - default\n", '{"instance-id": "i"}', "")
    with pytest.raises(SeedError, match="must start with '#cloud-config'"):
        firstboot_seed.parse("#!/bin/sh\necho hi\n", '{"instance-id": "i"}', "")


def _ids(user: str, group: str) -> tuple[int, int]:
    if {user, group} - {"root", "sandbox"}:
        raise KeyError(user)
    return os.getuid(), os.getgid()


def test_a_seed_is_applied_into_a_root(tmp_path: Path):
    _iso, texts = _seed_files(tmp_path)
    seed = firstboot_seed.parse(*texts)
    root, sys_net = tmp_path / "root", tmp_path / "net"
    (root / "etc/ssh").mkdir(parents=True)
    (root / "etc/ssh/ssh_host_rsa_key").write_text("stale")
    (root / "etc/environment").write_text("PATH=/bin\n")
    (root / "etc/resolv.conf").symlink_to("/run/elsewhere")
    (sys_net / "eth0").mkdir(parents=True)
    (sys_net / "eth0/address").write_text(f"{MAC.upper()}\n")

    firstboot.apply_hostname(seed, root, kernel=tmp_path / "kernel-hostname")
    firstboot.apply_host_keys(seed, root)
    firstboot.apply_users(seed, root, lambda _name: (os.getuid(), os.getgid(), "/home/sandbox"))
    firstboot.apply_files(seed, root, _ids)
    batches: list[str] = []
    firstboot.apply_network(seed, root, sys_net, run=lambda argv: batches.append(_batch(argv)))
    assert batches == []  # the files only
    firstboot.bring_up(seed, root, sys_net, run=lambda argv: batches.append(_batch(argv)))

    def mode(path: str) -> int:
        return (root / path).stat().st_mode & 0o7777

    assert (tmp_path / "kernel-hostname").read_text() == "box"
    assert (root / "etc/hostname").read_text() == "box\n"
    assert "127.0.1.1 box\n" in (root / "etc/hosts").read_text()
    assert sorted(p.name for p in (root / "etc/ssh").iterdir()) == [
        "ssh_host_ed25519_key",
        "ssh_host_ed25519_key.pub",
    ]
    assert mode("etc/ssh/ssh_host_ed25519_key") == 0o600
    assert (root / "home/sandbox/.ssh/authorized_keys").read_text() == seed.users[0].keys[0] + "\n"
    assert (mode("home/sandbox/.ssh"), mode("home/sandbox/.ssh/authorized_keys")) == (0o700, 0o600)
    sudoers = root / "etc/sudoers.d/90-vmsandbox-users"
    assert sudoers.read_text() == "sandbox ALL=(ALL) NOPASSWD:ALL\n" and mode(str(sudoers)) == 0o440
    assert (root / "etc/openshell/token").read_text() == "s3cret"
    assert mode("etc/openshell/token") == 0o600
    assert (root / "etc/environment").read_text() == "PATH=/bin\nGREETING=hi\n"
    network = root / "etc/systemd/network"
    assert (network / "50-vmsandbox-eth0.network").read_text() == (
        f"[Match]\nMACAddress={MAC}\n\n[Network]\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n"
        "KeepConfiguration=static\nAddress=10.0.2.15/24\nGateway=10.0.2.2\nDNS=10.0.2.3\n"
    )
    # The NIC is there: it gets its addresses now, before networkd (which keeps them) and sshd.
    assert batches == [
        "link set dev eth0 up\naddress replace 10.0.2.15/24 dev eth0\n"
        "route replace default via 10.0.2.2 dev eth0\n"
    ]
    assert not (root / "run/vmsandbox-firstboot.ip").exists()
    assert (network / "50-vmsandbox-eth0.link").read_text() == (
        f"[Match]\nMACAddress={MAC}\n\n[Link]\nName=eth0\n"
    )
    resolv = root / "etc/resolv.conf"
    assert not resolv.is_symlink() and resolv.read_text() == "nameserver 10.0.2.3\n"


def _batch(argv: list[str]) -> str:
    """What ``ip -batch FILE`` would run (never run here: the test host's network is real)."""
    assert argv[:2] == ["ip", "-batch"]
    return Path(argv[2]).read_text()


def test_a_nic_that_cannot_be_brought_up_is_left_to_networkd(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    seed = firstboot_seed.parse(*_texts(_base()))
    (tmp_path / "net/eth0").mkdir(parents=True)
    (tmp_path / "net/eth0/address").write_text(MAC)

    def refuse(argv: list[str]) -> None:
        raise SeedError("ip -batch failed (exit 1): RTNETLINK answers: File exists")

    firstboot.bring_up(seed, tmp_path, tmp_path / "net", run=refuse)
    out = capsys.readouterr().out
    assert "eth0 is left to systemd-networkd" in out and "error" not in out


@pytest.mark.parametrize(
    ("path", "value", "says"),
    [
        (
            "net/ethernets/eth0/addresses",
            ["10.0.2.15/24\nDNS=1.1.1.1"],
            "addresses must be one line",
        ),
        ("net/ethernets/eth0/addresses", ["10.0.2.999/24"], "addresses must be an address"),
        ("net/ethernets/eth0/gateway4", "10.0.2.2 dev lo", "gateway4 must be an IP"),
        ("net/ethernets/eth0/nameservers", {"addresses": ["dns.example"]}, "nameservers must be"),
    ],
)
def test_network_values_must_be_addresses(path: str, value: Any, says: str):
    """They go into networkd files and ip commands: no line or word can be slipped in."""
    with pytest.raises(SeedError, match=says):
        firstboot_seed.parse(*_with(path, value))


def test_a_file_for_a_missing_owner_names_it(tmp_path: Path):
    config = _base()
    config["write_files"] = [{"path": "/etc/x", "content": "", "owner": "nobody9:nobody9"}]
    seed = firstboot_seed.parse(*_texts(config))
    with pytest.raises(SeedError, match="write_files /etc/x: no user or group 'nobody9'"):
        firstboot.apply_files(seed, tmp_path, _ids)


def test_a_nic_the_kernel_named_otherwise_is_renamed_and_one_not_there_yet_is_not(
    tmp_path: Path,
):
    seed = firstboot_seed.parse(*_texts(_base()))
    ran: list[list[str]] = []
    firstboot.apply_network(seed, tmp_path, tmp_path / "net", run=ran.append)
    assert ran == []  # no NIC yet: the .link file names it when udev adds it
    (tmp_path / "net/ens3").mkdir(parents=True)
    (tmp_path / "net/ens3/address").write_text(MAC)
    firstboot.apply_network(seed, tmp_path, tmp_path / "net", run=ran.append)
    assert ran == [["ip", "link", "set", "dev", "ens3", "name", "eth0"]]
    firstboot.bring_up(seed, tmp_path, tmp_path / "net", run=ran.append)
    assert len(ran) == 1  # sysfs still says ens3 here: nothing is brought up under another name


def test_runcmd_runs_each_command_once_and_reports_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    out = tmp_path / "out"
    commands = [["sh", "-c", f"echo one >> {out}"], ["false"], ["sh", "-c", "exit 3"]]
    (tmp_path / firstboot.RUNCMD_FILE).write_text(json.dumps(commands))
    assert firstboot.run_commands(tmp_path) == 1
    assert out.read_text() == "one\n"
    assert not (tmp_path / firstboot.RUNCMD_FILE).exists()  # never run twice
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        f"{firstboot.PREFIX}: error: runcmd ['false'] exited 1",
        f"{firstboot.PREFIX}: error: runcmd ['sh', '-c', 'exit 3'] exited 3",
    ]


def test_a_bad_argument_prints_the_error_line_the_boot_watcher_fails_on(
    capsys: pytest.CaptureFixture[str],
):
    assert firstboot.main(["--bogus"]) == 1
    assert capsys.readouterr().err.startswith(f"{firstboot.PREFIX}: error: usage: ")


def test_every_recipe_with_the_unit_installs_its_modules() -> None:
    """The unit imports its modules from its own folder: a recipe installing firstboot.py
    installs them beside it (and compiles them, images/common/firstboot.sh)."""
    modules = sorted(path.name for path in Path(firstboot.__file__).parent.glob("firstboot_*.py"))
    assert modules == ["firstboot_iso.py", "firstboot_seed.py"]
    recipes = [load_recipe(name) for name in recipe_names()]
    with_unit = [
        recipe for recipe in recipes if "firstboot.py" in recipe.data.get("guest_tools", [])
    ]
    assert {recipe.name for recipe in with_unit} >= {"minimal", "nvidia"}
    for recipe in with_unit:
        assert set(modules) <= set(recipe.data["guest_tools"]), recipe.name
    compile_step = (Path(RECIPE_DIR) / "common" / "firstboot.sh").read_text()
    assert all(f"/usr/lib/vmsandbox/{module}" in compile_step for module in modules)


def test_the_unit_runs_as_the_image_runs_it(tmp_path: Path) -> None:
    """As in the guest: the compiled unit in a folder of its own, beside its modules, under
    ``python3 -I -S`` (which leaves that folder off sys.path): it finds them and answers."""
    folder = Path(firstboot.__file__).parent
    for module in ("firstboot.py", "firstboot_seed.py", "firstboot_iso.py"):
        (tmp_path / module).write_bytes((folder / module).read_bytes())
    py_compile.compile(str(tmp_path / "firstboot.py"), cfile=str(tmp_path / "firstboot.pyc"))
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(tmp_path / "firstboot.pyc"), "--bogus"],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )
    assert (done.returncode, done.stdout) == (1, "")
    assert (
        done.stderr
        == f"{firstboot.PREFIX}: error: usage: firstboot.py [--runcmd], got ['--bogus']\n"
    )
