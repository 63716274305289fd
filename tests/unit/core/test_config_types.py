"""Typed settings: every source (TOML file, environment, Python caller) gives each key a value
of its type and range, or INVALID_ARGUMENT naming the key, the value, where it was set and what
is allowed; nothing is read as a default it did not say (issue 42, point 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vmsandbox.config import ENV_BOOLEANS, Config
from vmsandbox.errors import InvalidArgument


@pytest.fixture(autouse=True)
def _no_config_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMSANDBOX_CONFIG", "/nonexistent")


def load_toml(tmp_path: Path, text: str) -> Config:
    file = tmp_path / "config.toml"
    file.write_text(text)
    return Config.load(file)


def refused(call: object) -> InvalidArgument:
    assert callable(call)
    with pytest.raises(InvalidArgument) as caught:
        call()
    return caught.value


@pytest.mark.parametrize(
    ("text", "key", "allowed"),
    [
        ('require_gpu_reset = "ture"\n', "require_gpu_reset", "true or false"),
        ('guest_outbound = "on"\n', "guest_outbound", "true or false"),
        ('max_cpus = "4"\n', "max_cpus", "a whole number of at least 1"),
        ("max_cpus = 0\n", "max_cpus", "a whole number of at least 1"),
        ("max_cpus = true\n", "max_cpus", "a whole number of at least 1"),
        ("max_gpus = -1\n", "max_gpus", "a whole number of at least 0"),
        ("boot_timeout = -5\n", "boot_timeout", "a number of seconds above 0"),
        ('lock_timeout = "60"\n', "lock_timeout", "a number of seconds above 0"),
        ("uri = 7\n", "uri", "a string"),
        ('openshell_allowed_uids = ["7"]\n', "openshell_allowed_uids", "a list of uids"),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_refused_naming_key_value_and_allowed(
    tmp_path: Path, text: str, key: str, allowed: str
) -> None:
    error = refused(lambda: load_toml(tmp_path, text))
    assert error.details["field"] == key
    assert str(error.details["allowed"]).startswith(allowed)
    assert f"config key {key!r}" in error.message and "allowed: " in error.message
    assert str(tmp_path / "config.toml") in error.message  # where it was set


@pytest.mark.parametrize(
    ("variable", "value", "key"),
    [
        ("VMSANDBOX_REQUIRE_GPU_RESET", "maybe", "require_gpu_reset"),
        ("VMSANDBOX_REQUIRE_GPU_RESET", "ture", "require_gpu_reset"),
        ("VMSANDBOX_GUEST_OUTBOUND", "", "guest_outbound"),
        ("VMSANDBOX_LOCK_TIMEOUT", "-1", "lock_timeout"),
        ("VMSANDBOX_LOCK_TIMEOUT", "nan", "lock_timeout"),
        ("VMSANDBOX_BOOT_TIMEOUT", "inf", "boot_timeout"),
        ("VMSANDBOX_BOOT_TIMEOUT", "soon", "boot_timeout"),
        ("VMSANDBOX_OPENSHELL_ALLOWED_UIDS", "7,x", "openshell_allowed_uids"),
        ("VMSANDBOX_VIRT_TYPE", "xen", "virt_type"),
    ],
)
def test_a_bad_environment_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, key: str
) -> None:
    monkeypatch.setenv(variable, value)
    error = refused(Config.load)
    assert error.details["field"] == key
    assert error.details["value"] == repr(value)
    assert f"${variable}" in error.message


@pytest.mark.parametrize(("word", "meaning"), sorted(ENV_BOOLEANS.items()))
def test_the_environment_takes_the_documented_words_for_on_and_off(
    monkeypatch: pytest.MonkeyPatch, word: str, meaning: bool
) -> None:
    monkeypatch.setenv("VMSANDBOX_GUEST_OUTBOUND", word.upper())
    monkeypatch.setenv("VMSANDBOX_REQUIRE_GPU_RESET", word)
    config = Config.load()
    assert (config.guest_outbound, config.require_gpu_reset) == (meaning, meaning)


@given(st.text(max_size=12))
def test_an_on_off_variable_is_one_of_the_words_or_refused(word: str) -> None:
    """Property: no text reads as off unless it is one of the words for off."""
    import os

    os.environ["VMSANDBOX_REQUIRE_GPU_RESET"] = word.replace("\0", "")
    try:
        config = Config.load("/nonexistent")
    except InvalidArgument as exc:
        assert exc.details["field"] == "require_gpu_reset"
        assert word.replace("\0", "").strip().lower() not in ENV_BOOLEANS
    else:
        assert config.require_gpu_reset is ENV_BOOLEANS[word.replace("\0", "").strip().lower()]
    finally:
        del os.environ["VMSANDBOX_REQUIRE_GPU_RESET"]


@given(st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=8), st.booleans()))
def test_a_timeout_is_a_finite_number_above_zero_from_any_caller(value: object) -> None:
    """Property: a Python caller's lock_timeout is kept only when it is a number above 0."""
    try:
        config = Config.load("/nonexistent", lock_timeout=value)
    except InvalidArgument as exc:
        assert exc.details["field"] == "lock_timeout"
        good = isinstance(value, int | float) and not isinstance(value, bool)
        assert not good or not (float(value) > 0 and float(value) != float("inf"))
    else:
        assert isinstance(value, int | float) and not isinstance(value, bool)
        assert config.lock_timeout == float(value) > 0


@given(st.text(min_size=1, max_size=8))
def test_a_cap_from_the_environment_is_digits_or_refused(text: str) -> None:
    """Property: the caps have no variable; max_gpus from a caller is a whole number >= 0."""
    if text.isascii() and text.isdecimal():
        return
    with pytest.raises(InvalidArgument):
        Config.load("/nonexistent", max_gpus=text)


def test_an_unknown_key_is_refused_naming_it_and_the_known_keys(tmp_path: Path) -> None:
    error = refused(lambda: load_toml(tmp_path, "requre_gpu_reset = true\n"))
    assert error.details["field"] == "requre_gpu_reset"
    assert "require_gpu_reset" in error.message


def test_a_pool_shape_of_no_known_image_is_refused_at_load(tmp_path: Path) -> None:
    images = tmp_path / "images"
    (images / "mine").mkdir(parents=True)
    head = f'image_dir = "{images}"\n[pool]\n'
    error = refused(lambda: load_toml(tmp_path, head + "mnimal_typo = 1\n"))
    assert error.details["field"] == "pool.mnimal_typo"
    assert "'minimal'" not in error.message and "minimal" in error.message  # the recipes named
    error = refused(lambda: load_toml(tmp_path, head + '[pool.big]\nimage = "nope"\n'))
    assert error.details["field"] == "pool.big.image"
    config = load_toml(tmp_path, head + 'minimal = 1\n[pool.own]\nimage = "mine"\n')
    assert [shape.image for shape in config.pool] == ["minimal", "mine"]
