"""An image recipe: a folder under ``images/`` with its ``recipe.toml``, the customize scripts it
names and the programs of ``vmsandbox.guest.programs`` it installs; its hash names its builds.

The image store (store.py) builds a recipe when no build of its hash is current; build.py
turns one into the files of a build.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmsandbox.errors import FailedPrecondition, NotFound
from vmsandbox.guest import programs
from vmsandbox.resources import RECIPES
from vmsandbox.validate import validate_image_name

# Bump when the build steps (build.py) change what a recipe produces (it is part of the
# recipe hash).
BUILDER_VERSION = "1"
RECIPE_DIR = RECIPES
GUEST_TOOLS = Path(programs.__file__).resolve().parent


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    data: dict[str, Any]
    scripts: tuple[Path, ...]
    # Programs of vmsandbox.guest.programs installed as /usr/lib/vmsandbox/<name> (recipe key
    # ``guest_tools``), before the scripts run; part of the hash like the scripts.
    tools: tuple[Path, ...] = ()

    @property
    def kernel_args(self) -> tuple[str, ...]:
        """Words added to the kernel command line of the image's guests (recipe key
        ``kernel_args``), after vmsandbox's own (build.KERNEL_CMDLINE)."""
        return tuple(self.data.get("kernel_args", ()))

    @property
    def hash(self) -> str:
        digest = hashlib.sha256(f"vmsandbox-image-builder {BUILDER_VERSION}\n".encode())
        for part in (self.path / "recipe.toml", *self.scripts, *self.tools):
            digest.update(part.name.encode() + b"\0" + part.read_bytes() + b"\0")
        return digest.hexdigest()


def recipe_names(recipe_dir: Path = RECIPE_DIR) -> list[str]:
    return sorted(p.parent.name for p in recipe_dir.glob("*/recipe.toml"))


def load_recipe(name: str, recipe_dir: Path = RECIPE_DIR) -> Recipe:
    validate_image_name(name)
    path = recipe_dir / name
    if not (path / "recipe.toml").is_file():
        raise NotFound(
            f"no image recipe {name!r}; recipes: {', '.join(recipe_names(recipe_dir)) or 'none'}"
        )
    data = tomllib.loads((path / "recipe.toml").read_text())
    scripts = tuple((recipe_dir / script).resolve() for script in data.get("customize", []))
    for script in scripts:
        if recipe_dir.resolve() not in script.parents or not script.is_file():
            raise FailedPrecondition(f"recipe {name!r} names a missing script {script}")
    tools = tuple(GUEST_TOOLS / tool for tool in data.get("guest_tools", []))
    for tool in tools:
        if tool.parent != GUEST_TOOLS or not tool.is_file():
            raise FailedPrecondition(
                f"recipe {name!r} names a missing guest tool {tool.name!r} "
                f"(one of the files of vmsandbox/guest/programs)"
            )
    args = data.get("kernel_args", [])
    if not isinstance(args, list) or not all(
        isinstance(arg, str) and arg and arg.split() == [arg] for arg in args
    ):
        raise FailedPrecondition(
            f"recipe {name!r}: kernel_args must be a list of words (no spaces), got {args!r}"
        )
    return Recipe(name=name, path=path, data=data, scripts=scripts, tools=tools)
