"""Reading the docs' Markdown as the docs check needs it: fenced blocks (with the marker
that exempts one from running), headings and their anchors, and links.

Anchors follow both slug rules a reader meets: GitHub's (lower case, punctuation dropped,
each space a hyphen, ``-1`` for a repeated heading) and mkdocs' default ``toc`` slugify
(ASCII only, runs of spaces and hyphens one hyphen, ``_1`` for a repeat). An anchor a link
names must exist under both, so it works on GitHub and on the built site.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
#: The marker that exempts the fenced block right after it from running, with the reason.
NOT_RUNNABLE = re.compile(r"^<!--\s*not-runnable:(?P<why>.*?)-->\s*$")
HEADING = re.compile(r"^(?P<level>#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
LINK = re.compile(r"(?P<image>!?)\[(?P<text>[^\]]*)\]\((?P<target><[^>]+>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)


@dataclass(frozen=True)
class Block:
    """A fenced code block: ``line`` is the 1-based line of its opening fence."""

    path: Path
    line: int
    lang: str
    code: str
    not_runnable: str | None  # the marker's reason, or None when it has no marker
    previous: str  # the last non-blank line before the opening fence, stripped (a marker)

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            line = lines[end]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            end += 1
        previous = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        marker = NOT_RUNNABLE.match(previous.strip())
        lang = opening["info"].split()[0] if opening["info"].strip() else ""
        found.append(
            Block(
                path,
                index + 1,
                lang,
                "\n".join(body) + "\n",
                marker["why"].strip() if marker else None,
                previous.strip(),
            )
        )
        index = end + 1
    return found


def prose(path: Path, *, inline_code: bool = False) -> str:
    """The text of ``path`` with fenced blocks blanked (line numbers kept), and inline code
    too unless ``inline_code``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for block in blocks(path):
        for number in range(block.line - 1, block.line + block.code.count("\n") + 1):
            if number < len(lines):
                lines[number] = ""
    text = "\n".join(lines)
    return text if inline_code else INLINE_CODE.sub(lambda match: re.sub(r"[^\n]", " ", match.group(0)), text)


def github_slug(text: str) -> str:
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower())


def heading_text(raw: str) -> str:
    """What a heading reads as: links become their text, code spans lose their backticks."""
    raw = LINK.sub(lambda match: match["text"], raw)
    return raw.replace("`", "").replace("**", "").strip()


def anchors(path: Path) -> tuple[set[str], set[str]]:
    """The anchors of ``path``'s headings: (GitHub's, mkdocs')."""
    github: dict[str, int] = {}
    mkdocs: dict[str, int] = {}
    for line in prose(path, inline_code=True).splitlines():
        match = HEADING.match(line)
        if match is None:
            continue
        text = heading_text(match["text"])
        for seen, slug, separator in ((github, github_slug(text), "-"), (mkdocs, mkdocs_slug(text), "_")):
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}{separator}{count}"] = 1
    return set(github), set(mkdocs)


@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str
    image: bool


def links(path: Path) -> list[Link]:
    """Every Markdown link and image of ``path`` outside code."""
    text = prose(path)
    return [
        Link(path, text.count("\n", 0, match.start()) + 1, match["target"].strip("<>"), bool(match["image"]))
        for match in LINK.finditer(text)
    ]
