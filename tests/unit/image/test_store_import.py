"""``images import`` refuses, at once and with INVALID_ARGUMENT naming what it found, a file no
sandbox could boot, and leaves nothing in the store when it does; a bootable disk goes in."""

from __future__ import annotations

import gzip
import struct
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from framework.disks import raw_disk
from framework.sandboxes import cli

from vmsandbox.config import Config
from vmsandbox.errors import AlreadyExists, InvalidArgument
from vmsandbox.image.store import ImageStore


def qcow2(path: Path, size: str = "64M", *options: str) -> Path:
    """A qcow2 with its first MiB written, so that it has data clusters and an L2 table."""
    command = ["qemu-img", "create", "-q", "-f", "qcow2", *options, str(path), size]
    subprocess.run(command, check=True)
    subprocess.run(
        ["qemu-io", "-c", "write -P 0x55 0 1M", str(path)], check=True, capture_output=True
    )
    return path


def text_file(path: Path) -> Path:
    path.write_text("root:x:0:0:root:/root:/bin/bash\n" * 40)
    return path


def zeros(path: Path) -> Path:
    path.write_bytes(bytes(8 << 20))  # the 8 MiB file of zeros from the issue
    return path


def bare_ext4(path: Path) -> Path:
    subprocess.run(["mkfs.ext4", "-q", "-F", str(path), "8M"], check=True, capture_output=True)
    return path


def gzipped_disk(path: Path) -> Path:
    path.write_bytes(gzip.compress(raw_disk(path.with_suffix(".raw")).read_bytes()))
    return path


def corrupt_qcow2(path: Path) -> Path:
    """The first L1 entry points far beyond the end of the file."""
    qcow2(path)
    with path.open("r+b") as handle:
        l1_offset = struct.unpack(">Q", handle.read(48)[40:48])[0]
        handle.seek(l1_offset)
        handle.write(struct.pack(">Q", (1 << 63) | (1 << 40)))
    return path


def truncated_qcow2(path: Path) -> Path:
    qcow2(path)
    with path.open("r+b") as handle:
        handle.truncate(100_000)
    return path


def header_only_qcow2(path: Path) -> Path:
    qcow2(path)
    with path.open("r+b") as handle:
        handle.truncate(50)
    return path


def overlay_qcow2(path: Path) -> Path:
    base = qcow2(path.with_name("base.qcow2"))
    return qcow2(path, "64M", "-F", "qcow2", "-b", str(base))


def data_file_qcow2(path: Path) -> Path:
    return qcow2(path, "16M", "-o", f"data_file={path.with_name('data.raw')}")


def over_cap_qcow2(path: Path) -> Path:
    return qcow2(path, "2G")  # the store below allows 1 GiB


REFUSED: dict[str, tuple[Callable[[Path], Path], str]] = {
    "text file": (text_file, "cannot boot: it is a text file"),
    "zeros": (zeros, "cannot boot: it is all zeros"),
    "bare ext4": (bare_ext4, "an ext2/3/4 filesystem, with no partition table or boot sector"),
    "gzip": (gzipped_disk, "gzip-compressed data (decompress it first)"),
    "corrupt qcow2": (corrupt_qcow2, "is a damaged qcow2 (truncated or corrupt): qemu-img check"),
    "truncated qcow2": (truncated_qcow2, "is a damaged qcow2 (truncated or corrupt)"),
    "header-only qcow2": (header_only_qcow2, "is not a readable disk image"),
    "backing file": (overlay_qcow2, "is a qcow2 overlay of"),
    "data file": (data_file_qcow2, "keeps its data in another file"),
    "over the cap": (over_cap_qcow2, "2.0 GiB disk, over this host's cap of 1 GiB per sandbox"),
}


def files_under(root: Path) -> list[Path]:
    return sorted(root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("case", REFUSED)
def test_an_unbootable_file_is_refused_and_leaves_nothing(tmp_path: Path, case: str) -> None:
    make, message = REFUSED[case]
    source = make(tmp_path / "source")
    store = ImageStore(tmp_path / "images")
    with pytest.raises(InvalidArgument) as caught:
        store.import_image(source, "mistake", max_disk_gib=1)
    assert message in caught.value.message
    assert caught.value.details["value"] == str(source)
    assert files_under(store.root) == []


def test_the_cli_refuses_etc_passwd_in_one_line(config: Config, tmp_path: Path) -> None:
    """The issue's first try: exit 2, one error line naming the file and what it is."""
    images = tmp_path / "own-images"  # apart from the config's image store
    done = cli("images", "import", "/etc/passwd", "evil", config=replace(config, image_dir=images))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "error: INVALID_ARGUMENT: image file '/etc/passwd' cannot boot: it is a text file; "
        "import a qcow2 image or a raw disk image with an MBR or GPT partition table"
    ]
    assert files_under(images) == []


@pytest.mark.parametrize("make", [raw_disk, qcow2], ids=["raw with MBR", "qcow2"])
def test_a_bootable_disk_is_imported(tmp_path: Path, make: Callable[[Path], Path]) -> None:
    source = make(tmp_path / "source")
    image = ImageStore(tmp_path / "images").import_image(source, "good", max_disk_gib=1)
    assert image.disk.is_file()
    assert image.meta["kind"] == "import"
    assert image.virtual_size > 0


def blank_qcow2(path: Path) -> Path:
    """``qemu-img create`` and nothing more: no sector written."""
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(path), "64M"], check=True)
    return path


def test_a_blank_qcow2_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    with pytest.raises(InvalidArgument, match="it is a blank qcow2") as caught:
        store.import_image(blank_qcow2(tmp_path / "blank.qcow2"), "blank", max_disk_gib=1)
    assert caught.value.details["found"] == "blank qcow2"
    assert files_under(store.root) == []


def recipe_build(store: ImageStore, name: str = "minimal") -> str:
    """A build of recipe ``name`` in ``store`` (as ``images build`` leaves one), current."""
    build = store.root / name / "0123456789abcdef"
    build.mkdir(parents=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(build / "disk.qcow2"), "8M"])
    (build / "meta.json").write_text(f'{{"kind": "recipe", "name": "{name}"}}')
    (build.parent / "current").symlink_to(build.name)
    return build.name


def test_an_import_never_replaces_a_recipes_image_unasked(tmp_path: Path) -> None:
    """Issue 42, point 1: ``images import PATH minimal`` used to move ``current`` off the
    recipe's build without a word; now ALREADY_EXISTS, and ``replace`` says what it replaced."""
    store = ImageStore(tmp_path / "images")
    recipe = recipe_build(store)
    source = raw_disk(tmp_path / "disk.raw")
    with pytest.raises(AlreadyExists, match="built from recipe 'minimal'") as caught:
        store.import_image(source, "minimal", max_disk_gib=1)
    assert "--replace" in caught.value.message
    assert store.get("minimal").id == recipe
    image = store.import_image(source, "minimal", max_disk_gib=1, replace=True)
    assert store.get("minimal").id == image.id != recipe
    assert image.replaced is not None and image.replaced.id == recipe
    assert image.to_dict()["replaced"]["kind"] == "recipe"
    assert (store.root / "minimal" / recipe).is_dir()  # kept for the sandboxes made from it


def test_an_import_never_replaces_another_import_or_shadows_a_recipe(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    first = store.import_image(raw_disk(tmp_path / "a.raw"), "mine", max_disk_gib=1)
    other = raw_disk(tmp_path / "b.raw", size=8 << 20)
    with pytest.raises(AlreadyExists, match=f"{first.id} is imported from .*a.raw"):
        store.import_image(other, "mine", max_disk_gib=1)
    assert store.import_image(tmp_path / "a.raw", "mine", max_disk_gib=1).id == first.id
    with pytest.raises(AlreadyExists, match="the name of recipe 'nvidia'"):
        store.import_image(other, "nvidia", max_disk_gib=1)


def test_the_cli_import_says_what_it_replaced(config: Config, tmp_path: Path) -> None:
    images = tmp_path / "images"
    recipe = recipe_build(ImageStore(images))
    source = str(raw_disk(tmp_path / "disk.raw"))
    own = replace(config, image_dir=images)
    done = cli("images", "import", source, "minimal", config=own)
    assert done.returncode == 4, done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: ALREADY_EXISTS: image 'minimal' exists")
    done = cli("images", "import", source, "minimal", "--replace", config=own)
    assert done.returncode == 0, done.stderr
    assert f"replaced minimal {recipe} (built from recipe 'minimal')" in done.stdout
