"""Read the host's apt sources, so image builds use the mirrors this host already trusts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vmsandbox.errors import FailedPrecondition


@dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str
    signed_by: str | None = None


def host_sources(root: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every ``deb`` source of the host, from sources.list, *.list and deb822 *.sources files."""
    found: list[AptSource] = []
    files = [root / "sources.list", *sorted((root / "sources.list.d").glob("*.list"))]
    for path in files:
        if path.is_file():
            found.extend(_parse_one_line(path.read_text(errors="replace")))
    for path in sorted((root / "sources.list.d").glob("*.sources")):
        found.extend(_parse_deb822(path.read_text(errors="replace")))
    return found


def mirror_lines(suite: str, components: list[str], root: Path = Path("/etc/apt")) -> list[str]:
    """sources.list lines for ``suite`` and its -updates/-security suites, with ``components``.

    Only sources that serve the wanted suite family are kept; their component lists are replaced
    by the recipe's (so an image can add non-free to a host that only lists main).
    """
    wanted = {suite, f"{suite}-updates", f"{suite}-security"}
    sources = [source for source in host_sources(root) if source.suite in wanted]
    if not any(source.suite == suite for source in sources):
        raise FailedPrecondition(
            f"the host's apt sources under {root} list no mirror for {suite!r}; "
            f"add one (e.g. a 'deb URI {suite} main' line) so images can be built"
        )
    lines: list[str] = []
    for source in sources:
        options = f"[signed-by={source.signed_by}] " if source.signed_by else ""
        line = f"deb {options}{source.uri} {source.suite} {' '.join(components)}"
        if line not in lines:
            lines.append(line)
    return lines


def _parse_one_line(text: str) -> list[AptSource]:
    """``deb [opt=value ...] URI SUITE [COMPONENT...]`` lines; the options in brackets may be
    one or several, with or without spaces inside the brackets."""
    out = []
    for raw in text.splitlines():
        parts = raw.split("#", 1)[0].split(maxsplit=1)
        if len(parts) < 2 or parts[0] != "deb":
            continue
        rest = parts[1]
        options: list[str] = []
        if rest.startswith("["):
            inside, closed, rest = rest[1:].partition("]")
            if not closed:
                continue
            options = inside.split()
        words = rest.split()
        if len(words) < 2:
            continue
        signed_by = next(
            (opt.split("=", 1)[1] for opt in options if opt.startswith("signed-by=")), None
        )
        out.append(AptSource(uri=words[0], suite=words[1], signed_by=signed_by))
    return out


def _parse_deb822(text: str) -> list[AptSource]:
    out = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split():
            continue
        if fields.get("enabled", "yes").lower() == "no":
            continue
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                out.append(AptSource(uri=uri, suite=suite, signed_by=fields.get("signed-by")))
    return out
