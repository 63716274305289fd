"""The package's layers hold: every import of vmsandbox goes down the table in vmsandbox/__init__.py
(or stays in its own package), no modules or packages import each other in a cycle, no module
grows past its line limit, and the top level stays a small shared core.

The line limit is one cap for every module (LINE_LIMIT), and a module is split where its
concepts part, never at a line count. A module held to a limit of its own, above or below the
cap, is a named exemption in LINE_EXEMPTIONS that says why; a module past its own limit is
reported with that reason, and an exemption without a reason, or naming no module, is
reported too.

The checker reads the source, not the running program: every ``import`` and ``from ... import``
anywhere in a module counts, at module level, inside functions (lazy imports) and under
``TYPE_CHECKING`` alike. ``from vmsandbox import Name`` of a public name (the ``_EXPORTS`` table
of vmsandbox/__init__.py) counts as an import of the module that defines it, so a module cannot
reach above its layer through the root. The root's own imports (its lazy public names and the
imports that type them) belong to no layer: they are the facade above every layer. The gRPC
stubs that setup/gen_proto.py generates are not ours and are left out.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

LINE_LIMIT = 450
# module -> (its own line limit, why it is not LINE_LIMIT)
LINE_EXEMPTIONS: dict[str, tuple[int, str]] = {
    "vmsandbox.sandbox.manager": (
        350,
        "the orchestrator stays smaller than the rest: the work is in the modules it calls",
    ),
}
CORE_MAX = 8  # modules at the top level besides __init__.py
CORE = "core"
FACADE = "<public names>"  # the node that stands for the root's imports
GENERATED = ("*_pb2.py", "*_pb2_grpc.py")  # setup/gen_proto.py writes them; not ours


@dataclass(frozen=True)
class Layers:
    """The layer table: package names top first, and the modules of the shared core."""

    order: tuple[str, ...]
    core: frozenset[str]

    def rank(self, layer: str) -> int:
        """0 for the top layer; the core below every package."""
        return len(self.order) if layer == CORE else self.order.index(layer)


@dataclass
class Module:
    """One module of the tree: where it is, how long, and what it imports (module names)."""

    name: str
    path: Path
    lines: int
    is_package: bool
    imports: dict[str, int] = field(default_factory=dict)  # imported module -> first line


def read_layers(init: Path) -> Layers:
    """The table of ``init``'s docstring: after the line that says "Layers, top first",
    one indented line per layer, its first word the package ("core": the words after it are
    the core's modules), until a line that is not indented."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if "Layers, top first" in line)
    table = []
    for line in lines[start + 1 :]:
        if table and not line.startswith("    "):
            break
        if line.startswith("    "):
            table.append(line.split())
    order = tuple(words[0] for words in table if words[0] != CORE)
    core = next((words[1:] for words in table if words[0] == CORE), [])
    return Layers(order, frozenset(core))


def scan(root: Path, package: str) -> dict[str, Module]:
    """Every module of ``root/package`` with its imports of the package resolved."""
    base = root / package
    modules: dict[str, Module] = {}
    for path in sorted(base.rglob("*.py")):
        if any(path.match(pattern) for pattern in GENERATED):
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        text = path.read_text()
        modules[name] = Module(name, path, len(text.splitlines()), is_package)
    exports = _exports(base / "__init__.py")
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        for node in ast.walk(tree):
            for target in _targets(node, module, package, modules, exports):
                if target != module.name:
                    module.imports.setdefault(target, getattr(node, "lineno", 0))
    return modules


def _exports(init: Path) -> dict[str, str]:
    """The root's public names: the ``_EXPORTS`` dict literal, name -> defining module."""
    for node in ast.parse(init.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["_EXPORTS"]
            and isinstance(node.value, ast.Dict)
        ):
            return {
                ast.literal_eval(key): ast.literal_eval(value)
                for key, value in zip(node.value.keys, node.value.values, strict=True)
                if key is not None
            }
    return {}


def _targets(
    node: ast.AST,
    module: Module,
    package: str,
    modules: Mapping[str, Module],
    exports: Mapping[str, str],
) -> Iterable[str]:
    """The modules of ``package`` that one AST node imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == package or alias.name.startswith(package + "."):
                yield _known(alias.name, modules)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            here = module.name.split(".")
            base = here if module.is_package else here[:-1]
            base = base[: len(base) - node.level + 1]
            source = ".".join([*base, node.module] if node.module else base)
        else:
            source = node.module or ""
        if source != package and not source.startswith(package + "."):
            return
        for alias in node.names:
            if f"{source}.{alias.name}" in modules:
                yield f"{source}.{alias.name}"
            elif source == package and alias.name in exports:
                yield exports[alias.name]
            else:
                yield _known(source, modules)
    elif (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == package
        and node.attr in exports
    ):
        yield exports[node.attr]  # ``import vmsandbox`` then ``vmsandbox.SandboxManager``


def _known(name: str, modules: Mapping[str, Module]) -> str:
    """``name``, or the longest prefix of it that is a module (a name imported from it)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def layer_of(name: str, package: str, modules: Mapping[str, Module]) -> str:
    """The layer of a module: its top-level package, or the core for top-level modules."""
    parts = name.split(".")
    if len(parts) == 1:
        return CORE  # the root's plain part (__version__): loaded before every other module
    top = f"{package}.{parts[1]}"
    return parts[1] if modules[top].is_package else CORE


def problems(
    root: Path,
    package: str,
    layers: Layers,
    exemptions: Mapping[str, tuple[int, str]] = LINE_EXEMPTIONS,
) -> list[str]:
    """Every broken rule, one message each, naming the modules and the rule; ``exemptions``
    are the modules with line limits of their own (module -> (limit, reason))."""
    modules = scan(root, package)
    found: list[str] = []
    order = ", ".join([*layers.order, CORE])
    graph: dict[str, set[str]] = {}
    for module in modules.values():
        # The root's imports are the facade's, above every layer (see the module docstring).
        source = FACADE if module.name == package else module.name
        graph.setdefault(source, set()).update(module.imports)
        if source == FACADE:
            continue
        mine = layer_of(module.name, package, modules)
        for target in module.imports:
            theirs = layer_of(target, package, modules)
            if mine in layers.order or mine == CORE:
                if theirs not in layers.order and theirs != CORE:
                    continue  # reported once below, as a package missing from the table
                if layers.rank(theirs) < layers.rank(mine):
                    where = f"{module.path.relative_to(root)}:{module.imports[target]}"
                    found.append(
                        f"{module.name} imports {target} ({where}): {mine} may not import "
                        f"{theirs}, which is above it (layers, top first: {order})"
                    )
    for name, module in modules.items():
        parts = name.split(".")
        if len(parts) == 2 and module.is_package and parts[1] not in layers.order:
            found.append(f"package {name} is not in the layer table of {package}/__init__.py")
        if len(parts) == 2 and not module.is_package and parts[1] not in layers.core:
            found.append(f"top-level module {name} is not in the core line of the layer table")
        found.extend(_too_long(module, root, exemptions))
    for name, (_limit, reason) in sorted(exemptions.items()):
        if not name.startswith(package + "."):
            continue
        if name not in modules:
            found.append(f"the line-limit exemption of {name} names no module of {package}")
        if not reason.strip():
            found.append(f"the line-limit exemption of {name} gives no reason")
    top = sorted(n for n, m in modules.items() if n.count(".") == 1 and not m.is_package)
    if len(top) > CORE_MAX:
        found.append(
            f"the top level of {package} holds {len(top)} modules, more than {CORE_MAX}: "
            + ", ".join(top)
        )
    for cycle in cycles(graph):
        found.append("import cycle between modules: " + " -> ".join(cycle))
    packages: dict[str, set[str]] = {}
    for source, targets in graph.items():
        if source == FACADE:
            continue
        mine = layer_of(source, package, modules)
        for target in targets:
            theirs = layer_of(target, package, modules)
            if theirs != mine:
                packages.setdefault(mine, set()).add(theirs)
    for cycle in cycles(packages):
        found.append("import cycle between packages: " + " -> ".join(cycle))
    return found


def _too_long(
    module: Module, root: Path, exemptions: Mapping[str, tuple[int, str]]
) -> Iterable[str]:
    """The module's line count past its limit: the cap, or its exemption's (with the reason)."""
    limit, reason = exemptions.get(module.name, (LINE_LIMIT, ""))
    if module.lines > limit:
        why = f" (its own limit: {reason})" if reason else ""
        yield f"{module.path.relative_to(root)} has {module.lines} lines, more than {limit}{why}"


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle (first node repeated at the end) per strongly connected group of nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_path(group, graph) for group in groups]


def _path(group: set[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A cycle through the first member of ``group``, found breadth first inside it."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt in group and nxt not in came:
                    came[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group has one
