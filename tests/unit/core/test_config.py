"""Configuration layering, host apt sources and the virt-type choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vmsandbox.config import Config
from vmsandbox.errors import FailedPrecondition, InvalidArgument
from vmsandbox.image.apt_sources import AptSource, host_sources, mirror_lines
from vmsandbox.vm import virt


def test_file_then_environment_then_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    file = tmp_path / "config.toml"
    file.write_text('uri = "qemu:///session"\nmax_cpus = 4\nstate_dir = "/srv/vmsbx"\n')
    monkeypatch.setenv("VMSANDBOX_STATE_DIR", "/var/lib/other")
    config = Config.load(file, max_cpus=2)
    assert config.uri == "qemu:///session"
    assert config.state_dir == Path("/var/lib/other")
    assert config.images == Path("/var/lib/other/images")
    assert config.max_cpus == 2


def test_unknown_keys_and_bad_values_name_the_key(tmp_path: Path):
    file = tmp_path / "config.toml"
    file.write_text("max_cpu = 4\n")
    with pytest.raises(InvalidArgument, match="unknown config key 'max_cpu'"):
        Config.load(file)
    file.write_text('max_cpus = "many"\n')
    with pytest.raises(InvalidArgument, match=r"'max_cpus' .* has the value 'many'"):
        Config.load(file)
    with pytest.raises(InvalidArgument, match=r"'virt_type' .* 'xen'; allowed: one of auto, kvm"):
        Config.load("/nonexistent", virt_type="xen")
    with pytest.raises(InvalidArgument, match="'efi'; allowed: one of auto, uefi, bios"):
        Config.load("/nonexistent", gpu_firmware="efi")


def test_apt_sources_in_both_formats(tmp_path: Path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main\n"
        "deb-src http://m.example/debian bookworm main\n"
    )
    (tmp_path / "sources.list.d" / "x.sources").write_text(
        "Types: deb\nURIs: http://s.example/debian-security\nSuites: bookworm-security\n"
        "Components: main\n\nTypes: deb\nEnabled: no\nURIs: http://off.example\nSuites: bookworm\n"
    )
    assert [s.uri for s in host_sources(tmp_path)] == [
        "http://m.example/debian",
        "http://s.example/debian-security",
    ]
    assert mirror_lines("bookworm", ["main", "non-free"], tmp_path) == [
        "deb [signed-by=/k.gpg] http://m.example/debian bookworm main non-free",
        "deb http://s.example/debian-security bookworm-security main non-free",
    ]
    with pytest.raises(FailedPrecondition, match="no mirror for 'trixie'"):
        mirror_lines("trixie", ["main"], tmp_path)


@pytest.mark.parametrize(
    "line",
    [
        "deb [signed-by=/k.gpg] http://m.example/debian bookworm main",  # one option (defect 8c)
        "deb [ signed-by=/k.gpg ] http://m.example/debian bookworm main",
        "deb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main",
        "deb\t[signed-by=/k.gpg]  http://m.example/debian bookworm main # trailing comment",
    ],
)
def test_apt_source_options_keep_signed_by(tmp_path: Path, line: str):
    (tmp_path / "sources.list").write_text(line + "\n")
    assert host_sources(tmp_path) == [
        AptSource(uri="http://m.example/debian", suite="bookworm", signed_by="/k.gpg")
    ]


def test_apt_source_lines_without_a_suite_or_closing_bracket_are_skipped(tmp_path: Path):
    (tmp_path / "sources.list").write_text(
        "deb http://m.example/debian\ndeb [signed-by=/k.gpg http://m.example/debian bookworm\n"
    )
    assert host_sources(tmp_path) == []


def test_virt_type_auto_uses_the_cached_probe(tmp_path: Path):
    cache = tmp_path / "probe.json"
    assert virt.resolve("qemu", cache=cache, kernel=None) == "qemu"
    cache.write_text(json.dumps({"host": virt.host_key(), "kvm": False}))
    assert virt.cached(cache=cache) == "qemu"
    assert virt.resolve("auto", cache=cache, kernel=None) == "qemu"
    cache.write_text(json.dumps({"host": "another host", "kvm": True}))
    assert virt.cached(cache=cache) is None
    with pytest.raises(InvalidArgument):
        virt.resolve("hvf", cache=cache, kernel=None)


def test_openshell_allowed_uids_from_toml_list_or_comma_separated_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    file = tmp_path / "config.toml"
    file.write_text("openshell_allowed_uids = [1001, 1002]\n")
    assert Config.load(file).openshell_allowed_uids == (1001, 1002)
    monkeypatch.setenv("VMSANDBOX_OPENSHELL_ALLOWED_UIDS", "7,8")
    assert Config.load(file).openshell_allowed_uids == (7, 8)
    monkeypatch.setenv("VMSANDBOX_OPENSHELL_ALLOWED_UIDS", "-1")
    with pytest.raises(InvalidArgument, match="openshell_allowed_uids"):
        Config.load(file)
