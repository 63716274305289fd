"""An import that would replace what an image name is now: refused unless asked for.

Every later create, ``make demo`` and pool fill of an image boots its ``current`` build, so an
import under a name that has one (a recipe's build, or another file's import), or under a
recipe's name (the recipe's next build would replace the import in turn), changes what they
boot. That takes ``--replace`` (``replace=True``); without it, ALREADY_EXISTS says what the
name is now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vmsandbox.errors import AlreadyExists
from vmsandbox.image.recipe import recipe_names


def kind(meta: dict[str, Any]) -> str:
    """What a build is, in words: the recipe's build, or the import of which file."""
    if meta.get("kind") == "import":
        return f"imported from {meta.get('source', '?')}"
    return f"built from recipe {meta.get('name', '?')!r}"


def refuse_replacing(name: str, current: str | None, meta: dict[str, Any], root: Path) -> None:
    """ALREADY_EXISTS for an import that would replace image ``name`` (whose current build is
    ``current``, described by ``meta``; None: it has none) unasked."""
    if current is not None:
        what = f"its current build {current} is {kind(meta)}"
    elif name in recipe_names():
        what = f"it is the name of recipe {name!r}, whose next build would replace the import"
    else:
        return
    raise AlreadyExists(
        f"image {name!r} exists in {root}: {what}; every later create and pool fill of "
        f"{name!r} would boot the import instead. Import it under another name, or pass "
        "--replace to replace it (its builds stay on disk for the sandboxes made from them "
        "until 'vmsandbox images prune')",
        details={"field": "name", "value": name, "current": current},
    )
