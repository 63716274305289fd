"""The wheel carries the domain template and the image recipes, which live at the top of the
repository, inside the package (vmsandbox/_data/, mapped by setup.py)."""

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
        for top in ("templates", "images")
        for path in (REPO / top).rglob("*")
        if path.is_file()
    }
    assert "vmsandbox/_data/templates/domain.xml" in shipped
    assert "vmsandbox/_data/images/minimal/recipe.toml" in shipped
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
