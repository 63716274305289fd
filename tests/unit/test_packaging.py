"""The wheel carries the domain template, the image recipes and the systemd units, which live at
the top of the repository, inside the package (vmsandbox/_data/, mapped by setup.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from framework.paths import REPO

from vmsandbox import resources
from vmsandbox.image.recipe import load_recipe, recipe_names


def test_the_wheel_ships_templates_and_recipes(tmp_path: Path) -> None:
    # Built from a copy: setuptools leaves build/ and *.egg-info in the tree it builds.
    source = tmp_path / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            ".venv-docs",
            "site",
            "build",
            "*.egg-info",
            "__pycache__",
            ".*_cache",
            ".hypothesis",
            "*_pb2*",  # generated in the checkout: the wheel build must make its own
        ),
    )
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"),
            *("--no-build-isolation", "--wheel-dir", str(tmp_path), str(source)),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("vmsandbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {
        f"vmsandbox/_data/{path.relative_to(REPO)}"
        for top in ("templates", "images", "systemd")
        for path in (REPO / top).rglob("*")
        if path.is_file()
    }
    assert "vmsandbox/_data/templates/domain.xml" in shipped
    assert "vmsandbox/_data/images/minimal/recipe.toml" in shipped
    assert "vmsandbox/_data/systemd/vmsandbox-reap.timer" in shipped
    assert shipped <= names, sorted(shipped - names)
    assert {"vmsandbox/py.typed", "vmsandbox/guest/programs/cuda_smoke.py"} <= names
    tools = {  # the guest programs recipes install, Python or not (firstboot_lean.sh)
        f"vmsandbox/guest/programs/{tool.name}"
        for name in recipe_names()
        for tool in load_recipe(name).tools
    }
    assert "vmsandbox/guest/programs/firstboot_lean.sh" in tools
    assert tools <= names, sorted(tools - names)
    stubs = {f"vmsandbox/openshell/proto/compute_driver_pb2{end}" for end in (".py", "_grpc.py")}
    assert stubs <= names, "the build did not generate the gRPC stubs"


def test_a_checkout_finds_its_top_level_folders() -> None:
    assert resources.TEMPLATES == REPO / "templates"
    assert resources.RECIPES == REPO / "images"
    assert resources.SYSTEMD == REPO / "systemd"


def test_the_reap_timer_starts_the_reap_service() -> None:
    """The units parse as systemd reads them (sections, keys), and the timer starts a
    service that runs ``vmsandbox reap``."""
    import configparser

    units = {}
    for name in ("vmsandbox-reap.service", "vmsandbox-reap.timer"):
        unit = configparser.ConfigParser(strict=True, interpolation=None)
        unit.optionxform = str  # type: ignore[assignment,method-assign]
        unit.read(resources.SYSTEMD / name)
        units[name] = unit
    service, timer = units["vmsandbox-reap.service"], units["vmsandbox-reap.timer"]
    assert service["Service"]["ExecStart"].split()[-2:] == ["vmsandbox", "reap"]
    assert service["Service"]["Type"] == "oneshot"
    assert timer["Timer"]["OnUnitActiveSec"] and timer["Install"]["WantedBy"] == "timers.target"
