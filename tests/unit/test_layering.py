"""Tests of the layer checker (tests/framework/layering.py) and the real tree against it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from framework.layering import LINE_LIMIT, problems, read_layers
from framework.paths import REPO

# -- the real tree ---------------------------------------------------------------------------------


def test_vmsandbox_keeps_its_layers() -> None:
    layers = read_layers(REPO / "vmsandbox" / "__init__.py")
    assert layers.order[0] == "cli" and "sandbox" in layers.order and layers.core
    found = problems(REPO, "vmsandbox", layers)
    assert not found, "\n".join(found)


def test_importing_vmsandbox_loads_nothing_else() -> None:
    """The public names are lazy: ``import vmsandbox`` loads no other module of the package;
    ``__all__`` names every one of them."""
    code = (
        "import sys, vmsandbox; "
        "print(sorted(m for m in sys.modules if m.startswith('vmsandbox.'))); "
        "print(sorted(vmsandbox.__all__) == sorted(['__version__', *vmsandbox._EXPORTS])); "
        "from vmsandbox import SandboxManager, GpuRequest, VmSandboxError; "
        "print(SandboxManager.__module__, GpuRequest.__module__, VmSandboxError.__module__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert done.stdout.splitlines() == [
        "[]",
        "True",
        "vmsandbox.sandbox.manager vmsandbox.gpu.request vmsandbox.errors",
    ]


# -- the checker finds what it is for --------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of vmsandbox/ to break."""
    shutil.copytree(
        REPO / "vmsandbox", tmp_path / "vmsandbox", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path


def test_an_upward_import_is_reported(tree: Path) -> None:
    bdf = tree / "vmsandbox" / "host" / "bdf.py"
    bdf.write_text(
        bdf.read_text() + "\n\ndef _late() -> None:\n    from ..sandbox import manager\n"
    )
    layers = read_layers(tree / "vmsandbox" / "__init__.py")
    found = problems(tree, "vmsandbox", layers)
    lines = len(bdf.read_text().splitlines())
    assert found[0] == (
        f"vmsandbox.host.bdf imports vmsandbox.sandbox.manager (vmsandbox/host/bdf.py:{lines}): "
        "host may not import sandbox, which is above it (layers, top first: cli, fleet, openshell, "
        "compat, sandbox, image, guest, gpu, vm, host, core)"
    )
    assert any(f.startswith("import cycle between modules: ") for f in found)
    assert any(f.startswith("import cycle between packages: ") for f in found)


def test_an_import_through_the_public_names_counts(tree: Path) -> None:
    numa = tree / "vmsandbox" / "host" / "numa.py"
    numa.write_text(numa.read_text() + "\n\nif TYPE_CHECKING:\n    from vmsandbox import Sandbox\n")
    found = problems(tree, "vmsandbox", read_layers(tree / "vmsandbox" / "__init__.py"))
    assert found[0].startswith("vmsandbox.host.numa imports vmsandbox.sandbox.handle ")


def _toy(root: Path, files: Mapping[str, str]) -> Path:
    """A package ``toy`` under ``root`` with two layers, ``top`` above ``low``, and a core
    module ``base``, plus ``files`` (path under toy/ -> text)."""
    layout = {
        "__init__.py": '"""Toy.\n\nLayers, top first:\n\n    top\n    low\n    core  base\n"""\n',
        "base.py": "",
        "top/__init__.py": "",
        "low/__init__.py": "",
        **files,
    }
    for name, text in layout.items():
        path = root / "toy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cycle_is_reported_whatever_hides_it(tmp_path: Path) -> None:
    root = _toy(
        tmp_path,
        {
            "low/a.py": "from toy.low import b\n",
            "low/b.py": "def later():\n    from . import c\n",
            "low/c.py": "import typing\nif typing.TYPE_CHECKING:\n    from .a import x\n",
        },
    )
    found = problems(root, "toy", read_layers(root / "toy" / "__init__.py"))
    assert found == [
        "import cycle between modules: toy.low.a -> toy.low.b -> toy.low.c -> toy.low.a"
    ]


def test_packages_in_a_cycle_are_reported(tmp_path: Path) -> None:
    root = _toy(tmp_path, {"low/a.py": "import toy.top.b\n", "top/b.py": "from ..low import a\n"})
    found = problems(root, "toy", read_layers(root / "toy" / "__init__.py"))
    assert found == [
        "toy.low.a imports toy.top.b (toy/low/a.py:1): low may not import top, which is above it "
        "(layers, top first: top, low, core)",
        "import cycle between modules: toy.low.a -> toy.top.b -> toy.low.a",
        "import cycle between packages: low -> top -> low",
    ]


def test_long_modules_a_crowded_top_level_and_unknown_packages_are_reported(
    tmp_path: Path,
) -> None:
    files = {f"extra{i}.py": "" for i in range(8)}
    files["low/long.py"] = "x = 1\n" * (LINE_LIMIT + 1)
    files["side/__init__.py"] = ""
    root = _toy(tmp_path, files)
    found = problems(root, "toy", read_layers(root / "toy" / "__init__.py"))
    assert f"toy/low/long.py has {LINE_LIMIT + 1} lines, more than {LINE_LIMIT}" in found
    assert "package toy.side is not in the layer table of toy/__init__.py" in found
    assert "top-level module toy.extra0 is not in the core line of the layer table" in found
    assert (
        "the top level of toy holds 9 modules, more than 8: toy.base, toy.extra0, toy.extra1, "
        "toy.extra2, toy.extra3, toy.extra4, toy.extra5, toy.extra6, toy.extra7"
    ) in found


def test_an_exempt_module_is_held_to_its_own_limit_and_its_reason_is_named(
    tmp_path: Path,
) -> None:
    files = {
        "low/table.py": "x = 1\n" * (LINE_LIMIT + 20),  # one concept, past the cap: exempt
        "low/wide.py": "x = 1\n" * (LINE_LIMIT + 41),  # exempt, and past its own limit too
        "top/hub.py": "x = 1\n" * 11,  # held below the cap, and past that limit
    }
    exemptions = {
        "toy.low.table": (LINE_LIMIT + 40, "one table of facts, read as a whole"),
        "toy.low.wide": (LINE_LIMIT + 40, "one table of facts, read as a whole"),
        "toy.top.hub": (10, "the hub stays small: its work belongs below it"),
        "toy.low.gone": (LINE_LIMIT + 40, "a module that is not there"),
        "toy.base": (LINE_LIMIT + 40, " "),
    }
    root = _toy(tmp_path, files)
    found = problems(root, "toy", read_layers(root / "toy" / "__init__.py"), exemptions)
    assert found == [
        f"toy/low/wide.py has {LINE_LIMIT + 41} lines, more than {LINE_LIMIT + 40} "
        "(its own limit: one table of facts, read as a whole)",
        "toy/top/hub.py has 11 lines, more than 10 "
        "(its own limit: the hub stays small: its work belongs below it)",
        "the line-limit exemption of toy.base gives no reason",
        "the line-limit exemption of toy.low.gone names no module of toy",
    ]
