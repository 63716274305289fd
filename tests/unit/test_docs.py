"""The README and the documentation site stay true to the code.

The site builds with MkDocs in its own virtualenv (``make docs`` makes it, at ``.venv-docs`` or
where ``$VMSANDBOX_DOCS_VENV`` says), strictly and with no network; every page of its nav exists
and is built; ``make test`` builds it. What the pages name must exist: the Python names in
their examples and prose, the files they mention, the CLI commands they show, every config key
with its environment variable and default, the package layers in their order. The performance
page is what docs/gen_performance.py makes of the committed benchmark reports.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
from framework.layering import read_layers
from framework.paths import REPO

import vmsandbox
from vmsandbox import config as config_module
from vmsandbox.cli.args import build_parser
from vmsandbox.cli.commands import split_guest_command
from vmsandbox.errors import InvalidArgument

DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 250
DOCS_VENV = Path(os.environ.get("VMSANDBOX_DOCS_VENV") or REPO / ".venv-docs").resolve()
sys.path.insert(0, str(DOCS))

import gen_performance  # noqa: E402


def nav_pages() -> list[str]:
    """The Markdown files the site's nav names, in order (mkdocs.yml's ``nav:`` block: pages,
    and sections of pages, ``- Use:``, whose pages are indented below them)."""
    lines = (REPO / "mkdocs.yml").read_text().splitlines()
    start = lines.index("nav:")
    pages = []
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        if re.fullmatch(r"  - [^:]+:", line):
            continue  # a section
        match = re.match(r"\s+- [^:]+: (\S+\.md)$", line)
        assert match, f"mkdocs.yml nav line not understood: {line!r}"
        pages.append(match.group(1))
    return pages


def markdown_files() -> list[Path]:
    return [README, *(DOCS / page for page in nav_pages())]


def code_blocks(path: Path, language: str) -> list[str]:
    """The fenced code blocks of one language in a Markdown file."""
    pattern = re.compile(rf"^```{language}\n(.*?)^```", re.MULTILINE | re.DOTALL)
    return pattern.findall(path.read_text())


def docs_python() -> Path:
    mkdocs = DOCS_VENV / "bin" / "mkdocs"
    assert mkdocs.exists(), (
        f"the docs virtualenv is missing ({mkdocs}): `make docs` installs it from "
        "docs/requirements.txt, or point VMSANDBOX_DOCS_VENV at one"
    )
    return mkdocs


# -- the README --------------------------------------------------------------------------------


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}"


def test_readme_links_into_docs_exist() -> None:
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert links, "README.md links into docs/"
    missing = [link for link in links if not (REPO / link).is_file()]
    assert missing == []
    assert {Path(link).name for link in links} >= set(nav_pages()) - {"index.md"}


# -- the site ----------------------------------------------------------------------------------


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    pages = nav_pages()
    assert pages[0] == "index.md"
    assert [page for page in pages if not (DOCS / page).is_file()] == []
    on_disk = {path.name for path in DOCS.glob("*.md")}
    assert on_disk == set(pages), "a page outside the nav, or a nav entry without a page"


def test_make_test_builds_the_docs_strictly() -> None:
    dry = subprocess.run(
        ["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    build = [line for line in dry.splitlines() if "mkdocs build" in line]
    assert build, f"make test does not build the docs:\n{dry}"
    assert "--strict" in build[0]
    assert dry.index("mkdocs build") < dry.index("pytest"), "the docs build comes before pytest"


def test_the_site_builds_strictly_without_network_and_has_every_page(tmp_path: Path) -> None:
    """In a network namespace of its own with no interface up, so nothing can be fetched."""
    site = tmp_path / "site"
    done = subprocess.run(
        ["unshare", "--net", str(docs_python()), "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in nav_pages():
        stem = page.removesuffix(".md")
        html = site / ("index.html" if stem == "index" else f"{stem}/index.html")
        assert html.is_file(), f"{page} was not built"
        text = html.read_text()
        loads = re.findall(r'<(?:script|img)[^>]+src="(https?:[^"]+)"', text)
        loads += re.findall(r'<link[^>]+href="(https?:[^"]+)"[^>]*rel="stylesheet"', text)
        loads += re.findall(r'<link[^>]+rel="stylesheet"[^>]+href="(https?:[^"]+)"', text)
        assert loads == [], f"{page} loads from outside the site: {loads}"
    api = (site / "api" / "index.html").read_text()
    for name in ("SandboxManager", "SandboxSpec", "GpuRequest", "create", "destroy"):
        assert name in api, f"the API reference lacks {name}"


def test_the_architecture_page_lists_the_layers_in_order() -> None:
    layers = read_layers(REPO / "vmsandbox" / "__init__.py")
    text = (DOCS / "architecture.md").read_text()
    rows = re.findall(r"^\| (?!core )[a-z]+ \| `([a-z]+)`", text, re.MULTILINE)
    assert rows == list(layers.order)
    [core_row] = [line for line in text.splitlines() if line.startswith("| core |")]
    assert set(re.findall(r"`([a-z_]+)`", core_row)) == set(layers.core)


def test_the_create_diagram_names_real_modules() -> None:
    """The diagram of one create names modules relative to vmsandbox/: each must exist."""
    [diagram] = code_blocks(DOCS / "architecture.md", "text")
    named = set(re.findall(r"\b([a-z_]+(?:/[a-z_]+)*(?:/|\.py))(?=[\s,]|$)", diagram))
    assert len(named) >= 20
    missing = [name for name in sorted(named) if not (REPO / "vmsandbox" / name).exists()]
    assert missing == []


def test_the_api_reference_covers_every_public_name() -> None:
    text = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: (\S+)$", text, re.MULTILINE))
    exports: dict[str, str] = vmsandbox._EXPORTS
    missing = [
        name
        for name in vmsandbox.__all__
        if name != "__version__"
        and f"{exports[name]}.{name}" not in documented
        and exports[name] not in documented
    ]
    assert missing == []


# -- what the pages name -----------------------------------------------------------------------


def resolve(dotted: str) -> Any:
    """The object a dotted name names: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_python_examples_import_real_names(path: Path) -> None:
    for block in code_blocks(path, "python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vmsandbox"):
                module = importlib.import_module(node.module or "")
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("vmsandbox"):
                        importlib.import_module(alias.name)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_dotted_names_in_the_text_exist(path: Path) -> None:
    names = set(re.findall(r"`(vmsandbox(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", path.read_text()))
    names |= set(re.findall(r"\]\[(vmsandbox(?:\.[A-Za-z_][A-Za-z0-9_]*)+)\]", path.read_text()))
    for name in sorted(names):
        resolve(name)


PATH_RE = re.compile(r"`((?:vmsandbox|tests|setup|bench|images|docs|templates)/[^` ]*)`")


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_files_named_in_the_text_exist(path: Path) -> None:
    named = {found.rstrip(".,:") for found in PATH_RE.findall(path.read_text())}
    placeholders = ("NAME", "<", "*")
    missing = [
        found
        for found in sorted(named)
        if not any(mark in found for mark in placeholders) and not (REPO / found).exists()
    ]
    assert missing == []


def cli_lines(path: Path) -> list[list[str]]:
    """Each ``vmsandbox ...`` command of the page's shell blocks, as the words after the name."""
    commands = []
    for block in code_blocks(path, "sh"):
        for line in block.splitlines():
            line = line.split(" #", 1)[0]
            for part in re.split(r"\s*(?:&&|\|\||\||;)\s*", line):
                words = shlex.split(part)
                if words and words[0] in ("vmsandbox", ".venv/bin/vmsandbox"):
                    commands.append(words[1:])
    return commands


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.name)
def test_cli_commands_shown_parse(path: Path) -> None:
    """As the command reads them: for exec and ssh what follows ``--`` is the guest's."""
    parser = build_parser()
    for words in cli_lines(path):
        ours, _guest_command = split_guest_command(words)  # as the CLI reads exec and ssh
        try:
            parser.parse_args(ours)
        except InvalidArgument as exc:
            pytest.fail(f"{path.name}: `vmsandbox {shlex.join(words)}` does not parse: {exc}")


def test_the_pages_show_cli_commands() -> None:
    assert len(cli_lines(README)) >= 10
    assert len(cli_lines(DOCS / "usage.md")) >= 15


def toml_default(value: object) -> str:
    """A default as the configuration table writes it: a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(repr(item) for item in value) + "]"
    return f'"{value}"'


def test_the_configuration_table_has_every_key_its_variable_and_default() -> None:
    text = (DOCS / "operations.md").read_text()
    rows = {
        match.group(1): (match.group(2), match.group(3))
        for match in re.finditer(r"^\| `([a-z_0-9]+)` \| ([^|]+) \| ([^|]+) \|", text, re.M)
    }
    assert list(rows) == [field.name for field in fields(config_module.Config)]
    for field in fields(config_module.Config):
        variable, default = (cell.strip() for cell in rows[field.name])
        env = config_module._ENV.get(field.name)
        assert variable == (f"`{env}`" if env else "-"), field.name
        value = field.default
        assert value is not MISSING, field.name
        if value is None:
            assert default.startswith("unset"), field.name
        elif field.name == "pool":
            assert default == "none"
        else:
            assert default == f"`{toml_default(value)}`", field.name


@pytest.mark.parametrize("path", [README, DOCS / "operations.md"], ids=lambda p: p.name)
def test_configuration_examples_load(path: Path, tmp_path: Path) -> None:
    """The config.toml examples are valid configurations (keys, values, pool shapes)."""
    blocks = code_blocks(path, "toml")
    assert blocks
    for index, block in enumerate(blocks):
        file = tmp_path / f"config-{index}.toml"
        file.write_text(block)
        loaded = config_module.Config.load(file)
        assert loaded.pool or "[pool" not in block


# -- the performance page ----------------------------------------------------------------------


def test_the_performance_page_is_what_the_reports_give() -> None:
    expected = gen_performance.render(gen_performance.RESULTS)
    page = gen_performance.PAGE.read_text()
    assert page == expected, "docs/performance.md is stale: run docs/gen_performance.py"


def test_every_report_carries_its_date_machine_and_command() -> None:
    reports = gen_performance.load(gen_performance.RESULTS)
    assert reports, "docs/results/ holds benchmark reports"
    for report in reports:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", report["when"]), report["bench"]
        assert report["machine"]["cpus"] >= 1, report["bench"]
        assert report["command"].startswith(".venv/bin/python bench/"), report["bench"]
        assert report["bench"] in gen_performance.ABOUT, report["bench"]


def test_the_generator_checks_a_stale_page(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n\nTyped by hand.\n")
    assert gen_performance.main(["--page", str(page), "--check"]) == 1
    assert gen_performance.main(["--page", str(page)]) == 0
    assert gen_performance.main(["--page", str(page), "--check"]) == 0
    assert page.read_text() == gen_performance.PAGE.read_text()
