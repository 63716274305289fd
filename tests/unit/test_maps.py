"""The maps of the repository stay true to what they map.

- **Package maps.** The docstring of every package below ``vmsandbox`` (its ``__init__.py``)
  names each of the package's modules and sub-packages in double backticks, by its bare name
  (````create````) or by its full dotted name (````vmsandbox.guest.verify.checks````). The
  generated gRPC stubs (``*_pb2*``, setup/gen_proto.py) and ``__main__`` are left out. The top
  of ``vmsandbox`` has its layer table instead, which tests/unit/test_layering.py holds to the
  tree (every package a layer, every top-level module in the core).
- **The site's home page.** docs/index.md links every page of mkdocs.yml's nav but itself, and
  no page outside it, under a ``##`` heading per nav section, in the nav's order.
- **Unit test files.** A test file under ``tests/unit/<package>/...`` is named after what it
  tests in ``vmsandbox/<package>/...``: ``test_<name>.py`` or ``test_<name>_<aspect>.py``, where
  ``<name>`` is a module, a sub-package or another file of that directory, or the package
  itself. ``tests/unit/core/`` is named after the top-level modules of ``vmsandbox`` (the
  core), ``tests/unit/framework/`` after the helpers in ``tests/framework/``, and the files at
  the top of ``tests/unit/`` are the checks of the whole repository (``WHOLE_REPOSITORY``).

Each test lists every offender with what is allowed, so one run shows the whole drift.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from framework.paths import FRAMEWORK, REPO

PACKAGE = REPO / "vmsandbox"
DOCS = REPO / "docs"
UNIT = REPO / "tests" / "unit"
# The files at the top of tests/unit/: checks of the whole repository, not of one module.
WHOLE_REPOSITORY = ("docs", "layering", "maps", "packaging")
# Files a test directory may hold besides its tests.
NOT_TESTS = ("__init__.py", "conftest.py")


def left_out(module: str) -> bool:
    """The modules no map names: the generated gRPC stubs and ``__main__``."""
    return "_pb2" in module or module == "__main__"


def parts_of(package: Path) -> list[str]:
    """The bare names of a package's modules and sub-packages, sorted."""
    names = [
        path.stem
        for path in package.glob("*.py")
        if path.name != "__init__.py" and not left_out(path.stem)
    ]
    names += [path.name for path in package.iterdir() if (path / "__init__.py").is_file()]
    return sorted(names)


def packages() -> list[Path]:
    """Every package below ``vmsandbox``, at any depth."""
    return sorted(init.parent for init in PACKAGE.rglob("*/__init__.py"))


def dotted(path: Path) -> str:
    return ".".join(path.relative_to(REPO).parts)


def named(doc: str, package: str, part: str) -> bool:
    """Whether ``doc`` names ``part`` of ``package`` in double backticks, bare or dotted."""
    return f"``{part}``" in doc or f"``{package}.{part}``" in doc


def test_every_package_docstring_names_its_modules() -> None:
    found = []
    for package in packages():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        name = dotted(package)
        missing = [part for part in parts_of(package) if not named(doc, name, part)]
        if missing:
            found.append(
                f"{package.relative_to(REPO)}/__init__.py: the docstring does not name "
                + ", ".join(f"``{part}``" for part in missing)
                + f" (each module and sub-package of {name}, as ``name`` or ``{name}.name``)"
            )
    assert not found, "\n".join(found)


# -- the site's home page ------------------------------------------------------------------------


def nav() -> list[tuple[str, list[str]]]:
    """mkdocs.yml's nav as (section, its pages in order); a page at the top level (the home
    page) is a section of its own named after the page's title."""
    lines = (REPO / "mkdocs.yml").read_text().splitlines()
    sections: list[tuple[str, list[str]]] = []
    for line in lines[lines.index("nav:") + 1 :]:
        if not line.startswith(" "):
            break
        match = re.fullmatch(r"( *)- ([^:]+):(?: (\S+\.md))?", line)
        assert match, f"mkdocs.yml nav line not understood: {line!r}"
        indent, title, page = match.groups()
        if len(indent) <= 2:
            sections.append((title, [page] if page else []))
        else:
            assert page and sections, f"mkdocs.yml nav line not understood: {line!r}"
            sections[-1][1].append(page)
    return sections


def index_sections() -> list[tuple[str, list[str]]]:
    """docs/index.md's ``##`` headings, each with the pages linked under it in order."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    for line in (DOCS / "index.md").read_text().splitlines():
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
            continue
        for page in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", line):
            if page not in sections[-1][1]:
                sections[-1][1].append(page)
    return sections


def test_the_home_page_links_every_page_of_the_nav_by_section() -> None:
    wanted = [(title, pages) for title, pages in nav() if pages != ["index.md"]]
    have = index_sections()
    in_nav = {page for _title, pages in wanted for page in pages}
    linked_anywhere = {page for _heading, pages in have for page in pages}
    found = [
        f"docs/index.md does not link {page} (mkdocs.yml's nav: {title})"
        for title, pages in wanted
        for page in pages
        if page not in linked_anywhere
    ]
    found += [
        f"docs/index.md links {page}, which is not a page of mkdocs.yml's nav besides itself"
        for page in sorted(linked_anywhere - in_nav)
    ]
    if have[0][1]:
        found.append(f"docs/index.md links {', '.join(have[0][1])} above its first ## heading")
    linked = [(heading, pages) for heading, pages in have if heading]
    if linked != wanted:
        found.append(
            "docs/index.md's sections and their links differ from mkdocs.yml's nav:\n"
            + "\n".join(f"  nav:   ## {title}: {', '.join(pages)}" for title, pages in wanted)
            + "\n"
            + "\n".join(f"  index: ## {title}: {', '.join(pages)}" for title, pages in linked)
        )
    assert not found, "\n".join(found)


# -- unit test files -----------------------------------------------------------------------------


def file_names(folder: Path) -> set[str]:
    """What a test in ``folder``'s tests may be named after: its modules, sub-packages and other
    files, by their name without suffix (``firstboot_lean.sh``: ``firstboot_lean``)."""
    return {
        path.name.split(".", 1)[0]
        for path in folder.iterdir()
        if not path.name.startswith(("_", ".")) and path.name != "__pycache__"
    }


def allowed_names(folder: Path) -> set[str] | None:
    """The names the tests of ``folder`` (under tests/unit/) may be named after; None when the
    folder stands for nothing that exists."""
    relative = folder.relative_to(UNIT)
    if relative == Path("."):
        return set(WHOLE_REPOSITORY)
    if relative == Path("core"):
        return {path.stem for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    if relative == Path("framework"):
        return {path.stem for path in FRAMEWORK.glob("*.py") if path.name != "__init__.py"}
    target = PACKAGE / relative
    if not (target / "__init__.py").is_file():
        return None
    return file_names(target) | {target.name}


def named_after(stem: str, names: set[str]) -> bool:
    return any(stem == f"test_{name}" or stem.startswith(f"test_{name}_") for name in names)


def test_every_unit_test_file_is_named_after_what_it_tests() -> None:
    found = []
    for path in sorted(UNIT.rglob("*.py")):
        if path.name in NOT_TESTS:
            continue
        relative = path.relative_to(REPO)
        names = allowed_names(path.parent)
        if names is None:
            where = PACKAGE / path.parent.relative_to(UNIT)
            found.append(
                f"{relative}: tests/unit/{path.parent.relative_to(UNIT)}/ stands for no "
                f"package ({where.relative_to(REPO)}/ is none); a unit test lives in "
                "tests/unit/<package>/ after vmsandbox/<package>/, in tests/unit/core/ or "
                "tests/unit/framework/"
            )
        elif not path.name.startswith("test_"):
            found.append(f"{relative}: not a test file; helpers live in tests/framework/")
        elif not named_after(path.stem, names):
            found.append(
                f"{relative}: name it test_<name>.py or test_<name>_<aspect>.py, <name> one of: "
                + ", ".join(sorted(names))
            )
    assert not found, "\n".join(found)
