"""Hostile input: only valid names, image names, sizes and CLI arguments pass; nothing reaches
a shell, an XML document or a file path unescaped; every bad input ends in one clear error.

Property-based (hypothesis) where the input space is large; against the real libvirtd where
XML goes through it, and against the shared booted guest for ``exec``'s quoting.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import libvirt
import pytest
from framework.sandboxes import leftovers
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from vmsandbox.cli import commands
from vmsandbox.cli.sizes import parse_size_mib
from vmsandbox.config import Config
from vmsandbox.errors import ALL_CODES, InvalidArgument, NotFound
from vmsandbox.image.recipe import recipe_names
from vmsandbox.sandbox.handle import Sandbox
from vmsandbox.sandbox.manager import SandboxManager
from vmsandbox.sandbox.record import LIBVIRT_QEMU_LOG_DIR, SandboxFiles
from vmsandbox.sandbox.spec import SandboxSpec, generate_name
from vmsandbox.validate import validate_image_name, validate_name
from vmsandbox.vm import domain as domain_xml

FUZZ = settings(max_examples=300, deadline=None)
SLOW_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?")
IMAGE_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
HOSTILE = [
    "a'/><devices>",
    "../../etc",
    "..",
    "/etc/passwd",
    "a b",
    "a\nb",
    "ok\n",
    "ok\r",
    "ok\x00",
    "$(reboot)",
    "`id`",
    "a;b",
    "a|b",
    "a&b",
    "-rf",
    "--json",
    "ok ",
    " ok",
    "OK",
    "\u0430bc",  # Cyrillic a
    "ok\u200b",
    "a" * 49,
    "",
]
names = st.one_of(
    st.sampled_from(HOSTILE),
    st.from_regex(NAME_RE, fullmatch=True),
    st.text(alphabet="az09-_.\n\r\t /'\"<>&;$`\\\x00", max_size=52),
    st.text(max_size=60),
)


def dummy_config() -> Config:
    return Config(state_dir=Path("/var/lib/vmsandbox-test-nowhere"))


# -- names, image names, sizes, labels ---------------------------------------------------------


@FUZZ
@given(names)
@example("ok\n")
def test_only_valid_sandbox_names_pass(name: str) -> None:
    """Names are 1-48 of [a-z0-9-], no dash at either end; a valid name only ever makes paths
    inside the state directory and the domain name ``vmsbx-<name>``."""
    valid = len(name) <= 48 and NAME_RE.fullmatch(name) is not None
    if not valid:
        with pytest.raises(InvalidArgument) as caught:
            SandboxSpec(name=name)
        assert caught.value.details["field"] == "name"
        with pytest.raises(InvalidArgument):
            validate_name(name)
        return
    assert SandboxSpec(name=name).name == name
    cfg = dummy_config()
    files = SandboxFiles.of(cfg, name)
    for path in files.files():
        if path == files.qemu_log:  # libvirt's own log of the domain
            assert path == LIBVIRT_QEMU_LOG_DIR / f"vmsbx-{name}.log"
            continue
        assert path.parent in (cfg.disks, cfg.sandboxes)
        assert path.name.startswith(name)


@FUZZ
@given(st.one_of(st.sampled_from([*HOSTILE, "minimal\n", ".hidden", "a" * 65]), names))
@example("minimal\n")
def test_only_valid_image_names_pass(image: str) -> None:
    valid = len(image) <= 64 and IMAGE_RE.fullmatch(image) is not None
    if not valid:
        with pytest.raises(InvalidArgument):
            validate_image_name(image)
        with pytest.raises(InvalidArgument):
            SandboxSpec(image=image)
        return
    assert SandboxSpec(image=image).image == image


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
)


hashable = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))


@FUZZ
@given(cpus=anything, memory=anything, disk=anything)
def test_only_positive_whole_sizes_pass(cpus: Any, memory: Any, disk: Any) -> None:
    def ok(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if ok(cpus) and ok(memory) and ok(disk):
        spec = SandboxSpec(cpus=cpus, memory_mib=memory, disk_gib=disk)
        assert (spec.cpus, spec.memory_mib, spec.disk_gib) == (cpus, memory, disk)
    else:
        with pytest.raises(InvalidArgument):
            SandboxSpec(cpus=cpus, memory_mib=memory, disk_gib=disk)


@FUZZ
@given(labels=st.one_of(anything, st.dictionaries(hashable, anything, max_size=3)))
@example(labels="x")
@example(labels=None)
@example(labels=["a"])
def test_labels_are_a_mapping_of_strings_or_invalid_argument(labels: Any) -> None:
    valid = isinstance(labels, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    )
    if valid:
        assert SandboxSpec(labels=labels).labels == labels
    else:
        with pytest.raises(InvalidArgument):
            SandboxSpec(labels=labels)


@FUZZ
@given(st.one_of(st.text(max_size=20), st.from_regex(r"\s*[0-9]{1,14}\s*[kKmMgGtT]?i?[bB]?\s*")))
def test_sizes_parse_to_whole_mib_or_invalid_argument(text: str) -> None:
    for unit in ("MiB", "GiB"):
        try:
            mib = parse_size_mib(text, field="--memory", default_unit=unit)
        except InvalidArgument as exc:
            assert exc.details["field"] == "--memory"
            continue
        assert isinstance(mib, int)
        assert mib >= 1


hostile_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "]]><hostdev/>",
            "</sandbox></metadata><devices><hostdev mode='subsystem'/>",
            "\"'&<>",
            "\x00\x01\x1b[31m",
            "\ud800",
            "&lt;&#x0;",
            '"} , "name": "evil',
        ]
    ),
)


@SLOW_FUZZ
@given(labels=st.dictionaries(hostile_text, hostile_text, max_size=4))
def test_hostile_labels_round_trip_through_the_domain_xml(
    manager: SandboxManager, labels: dict[str, str]
) -> None:
    """Labels of any text land in our metadata as data: the XML parses, holds one <name> and
    our one metadata element, and gives the labels back unchanged."""
    name = generate_name("t")
    xml, _gpus = manager.dry_run(SandboxSpec(name=name, labels=labels))
    record, state = domain_xml.read_metadata(xml) or ({}, "")
    assert record["labels"] == labels
    assert record["name"] == name
    assert state == "creating"
    from lxml import etree

    root = etree.fromstring(xml.encode())
    assert [el.text for el in root.iter("name")] == [f"vmsbx-{name}"]
    assert len(root.find("metadata")) == 1
    assert root.find("devices/hostdev") is None


def test_hostile_labels_survive_libvirt(manager: SandboxManager, config: Config) -> None:
    """The same through libvirtd itself, which re-serialises the XML: define, start, read."""
    labels = {
        "]]><hostdev/>": "</sandbox></metadata><devices><hostdev/>",
        "quote\"'&<>": "\x00\x01\x1b[31m\ud800",
        "": "\n\r\t ",
    }
    name = generate_name("t")
    try:
        manager.create(SandboxSpec(name=name, memory_mib=256, labels=labels), wait=False)
        assert manager.get(name).labels == labels
        conn = libvirt.open(config.uri)
        try:
            xml = conn.lookupByName(f"vmsbx-{name}").XMLDesc(0)
        finally:
            conn.close()
        assert "<hostdev" not in xml
    finally:
        with contextlib.suppress(NotFound):
            manager.destroy(name)
    assert leftovers(config, name) == []


# -- exec quoting, against the booted guest ----------------------------------------------------

ARGV_ALPHABET = "ab \t\n\r'\"`$(){}[]*?~!#&|;<>\\%=-_./:é€😀\x7f\x1b"


def test_exec_hands_hostile_argv_to_the_guest_verbatim(
    manager: SandboxManager, booted: Sandbox
) -> None:
    """Each word reaches the guest program as one argv element, byte for byte: nothing is
    expanded, split, globbed or run by the guest's shell."""
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    words = [
        *(w for w in HOSTILE if "\x00" not in w),
        "$(touch /tmp/pwned)",
        "; touch /tmp/pwned",
        "'; touch /tmp/pwned; '",
        '"; touch /tmp/pwned; "',
        "*",
        "~",
        "-n",
        "--",
        "\\",
        "%s%n",
        *("".join(rng.choice(ARGV_ALPHABET) for _ in range(rng.randrange(12))) for _ in range(30)),
    ]
    script = "import json, sys; print(json.dumps(sys.argv[1:]))"
    result = manager.exec(booted.name, ["python3", "-c", script, *words])
    assert result.exit_status == 0, (seed, result.stderr)
    assert json.loads(result.stdout) == words, f"seed {seed}"
    check = manager.exec(booted.name, ["test", "!", "-e", "/tmp/pwned"])
    assert check.exit_status == 0


@pytest.mark.parametrize("command", [["echo", "a\x00b"], ["sh", "-c", "true\x00; reboot"]])
def test_exec_refuses_words_a_command_line_cannot_carry(
    manager: SandboxManager, booted: Sandbox, command: list[str]
) -> None:
    """A NUL byte cannot be part of an argv word: it would silently cut the command line in
    the guest, so exec rejects it instead of running something else."""
    with pytest.raises(InvalidArgument):
        manager.exec(booted.name, command)


# -- the CLI, in-process, with any arguments ---------------------------------------------------

COMMANDS = [
    ["create"],
    ["create", "--dry-run"],
    ["list"],
    ["show"],
    ["exec"],
    ["ssh"],
    ["destroy"],
    ["reconcile"],
    ["gpus"],
    ["images"],
    ["images", "list"],
    ["images", "import"],
    ["images", "build"],
]
FLAGS = [
    "--json",
    "--image",
    "--cpus",
    "--memory",
    "--disk",
    "--virt-type",
    "--timeout",
    "--no-wait",
    "--gpu",
    "--gpu-count",
    "--gpu-device",
    "--gpu-all",
    "--gpu-vendor",
    "--gpu-model",
    "--gpu-memory",
    "--force",
    "--",
    "-",
]
VALUES = [
    "1",
    "0",
    "-1",
    "2G",
    "1.5G",
    "99999999999999G",
    "nan",
    "inf",
    "qemu",
    "kvm",
    "nvidia",
    "H100",
    "80Gi",
    "41:00.0",
    "minimal",
    "t-nx-0001",
    "t-nx-0002",
]
tokens = st.one_of(
    st.sampled_from(FLAGS),
    st.sampled_from(VALUES),
    st.sampled_from(HOSTILE),
    st.text(max_size=12),
    st.text(alphabet=st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), max_size=3),
)
argvs = st.builds(
    lambda head, tail, json_first: (["--json"] if json_first else []) + head + tail,
    st.sampled_from(COMMANDS),
    st.lists(tokens, max_size=7),
    st.booleans(),
)


@pytest.fixture(scope="module")
def cli_env(config: Config) -> Iterator[dict[str, str]]:
    """An empty state and image directory: no image exists, so no create can boot anything."""
    with tempfile.TemporaryDirectory(prefix="vmsbx-cli-fuzz-", dir="/var/tmp") as root:
        os.chmod(root, 0o711)
        (Path(root) / "images").mkdir()
        yield {
            "VMSANDBOX_CONFIG": "/nonexistent",
            "VMSANDBOX_URI": config.uri,
            "VMSANDBOX_STATE_DIR": f"{root}/state",
            "VMSANDBOX_IMAGE_DIR": f"{root}/images",
            "VMSANDBOX_VIRT_TYPE": "qemu",
        }


@pytest.fixture(scope="module")
def existing_domains(config: Config) -> set[str]:
    conn = libvirt.open(config.uri)
    try:
        return {dom.name() for dom in conn.listAllDomains(0)}
    finally:
        conn.close()


def run_main(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """``commands.main(argv)`` in this process with its own stdout/stderr; SystemExit is caught."""
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace")
    env = {**{k: v for k, v in os.environ.items() if k != "VMSANDBOX_DEBUG"}, **env}
    with (
        mock.patch.dict(os.environ, env, clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code: Any = commands.main(argv)
        except SystemExit as exc:  # argparse's --help
            code = exc.code
    for stream in (out, err):
        stream.flush()
    return code, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=argvs)
@example(argv=["list", "--json"])
@example(argv=["create", "t-nx-0001", "--memory", "lots"])
@example(argv=["show", "x\nerror: OK: forged"])
@example(argv=["list", "--x\nerror:OK:forged"])
@example(argv=["images", "list", "\x1b]0;title\x07"])
def test_cli_gives_an_exit_code_and_at_most_one_error_line_for_any_argv(
    argv: list[str], cli_env: dict[str, str], existing_domains: set[str]
) -> None:
    """Whatever the arguments: an int exit status, no traceback, and on failure exactly one
    line ``error: CODE: message`` (or a JSON error with ``--json``) whose code gives the
    status. Nothing in the arguments can add a line of its own to that output."""
    # Never act on something real: no image build, no name of an existing domain.
    if "build" in argv:
        assume(not set(argv) & set(recipe_names()))
    assume(not any(f"vmsbx-{word}" in existing_domains for word in argv))
    code, out, err = run_main(argv, cli_env)
    assert isinstance(code, int) and not isinstance(code, bool)
    assert "Traceback" not in out + err
    if code == 0:
        return
    wanted_json = "--json" in argv
    if wanted_json:
        error = json.loads(out)["error"]
        assert error["code"] in ALL_CODES
        assert code == commands.EXIT_CODES[error["code"]]
        return
    lines = [line for line in err.splitlines() if not line.startswith("[")]  # progress lines
    assert len(lines) == 1, err
    assert lines[0].isprintable(), lines[0]  # no terminal escapes from the arguments
    match = re.match(r"error: ([A-Z_]+): ", lines[0])
    assert match, lines[0]
    assert match.group(1) in ALL_CODES
    assert code == commands.EXIT_CODES[match.group(1)], lines[0]
    assert match.group(1) != "INTERNAL", lines[0]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0", "1e999"])
@pytest.mark.parametrize("command", [["create", "t-nx-0003", "--image", "none"], ["exec"]])
def test_cli_timeouts_must_be_finite_and_positive(
    command: list[str], value: str, cli_env: dict[str, str]
) -> None:
    """``--timeout nan`` would never expire (every comparison with NaN is false)."""
    if command[0] == "create":
        argv = [*command, "--timeout", value]
    else:
        argv = [*command, "--timeout", value, "t-nx-0003", "--", "true"]
    code, _out, err = run_main(argv, cli_env)
    assert code == 2, err
    assert err.startswith("error: INVALID_ARGUMENT: ") and "--timeout" in err


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 0.0])
def test_api_timeouts_must_be_finite_and_positive(manager: SandboxManager, timeout: float) -> None:
    spec = SandboxSpec(name=generate_name("t"), image="no-such-image")
    with pytest.raises(InvalidArgument) as caught:
        manager.create(spec, timeout=timeout)
    assert caught.value.details.get("field") == "timeout"


def test_cli_options_after_the_exec_name_are_options_not_the_command(
    cli_env: dict[str, str],
) -> None:
    """``exec NAME --timeout T -- CMD`` reads ``--timeout`` as its own option (an invalid T is
    refused before anything else); after ``--`` every word is the guest's."""
    code, _out, err = run_main(["exec", "t-nx-0001", "--timeout", "nan", "--", "true"], cli_env)
    assert (code, err.split(":")[:2]) == (2, ["error", " INVALID_ARGUMENT"]), err
    code, _out, err = run_main(["exec", "t-nx-0001", "--", "ls", "--timeout", "nan"], cli_env)
    assert code == 3, err  # NOT_FOUND: the sandbox, after taking "--timeout nan" as the command's


@pytest.mark.parametrize("args", [["images", "list"], ["reconcile"]])
def test_cli_json_works_before_and_after_the_command(
    args: list[str], cli_env: dict[str, str]
) -> None:
    """docs/usage.md: every command takes --json; ``vmsandbox --json CMD`` is the same request."""
    before = run_main(["--json", *args], cli_env)
    after = run_main([*args, "--json"], cli_env)
    assert before[0] == after[0] == 0
    assert json.loads(before[1]) == json.loads(after[1])


def test_hostile_names_never_reach_a_path_from_the_cli(cli_env: dict[str, str]) -> None:
    """Names that look like paths or markup are rejected before any file or domain is made."""
    for name in ("../../etc", "a'/><devices>", "..", "/tmp/x", "x/../../y", "ok\n"):
        for argv in (["create", name], ["destroy", name], ["show", name], ["exec", name, "true"]):
            code, _out, err = run_main(argv, cli_env)
            assert code == 2, (argv, err)
            assert err.startswith("error: INVALID_ARGUMENT: "), err
    state = Path(cli_env["VMSANDBOX_STATE_DIR"])
    made = [
        p.name
        for d in ("disks", "sandboxes")
        if (state / d).is_dir()
        for p in (state / d).iterdir()
    ]
    assert made == []
