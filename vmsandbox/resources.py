"""Where the files that ship beside the code are: the domain XML template, the image recipes
and the systemd units.

They live at the top of the repository (``templates/``, ``images/``, ``systemd/``), which is
where a checkout or an editable install finds them; a wheel carries them inside the package as
``vmsandbox/_data/<folder>`` (mapped at build time by setup.py).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """The installed copy of top-level folder ``name`` if there is one, else the checkout's."""
    packaged = _PACKAGE / "_data" / name
    return packaged if packaged.is_dir() else _PACKAGE.parent / name


TEMPLATES = data_dir("templates")
RECIPES = data_dir("images")
SYSTEMD = data_dir("systemd")  # the units that run ``vmsandbox reap`` (docs/sandbox-access.md)
