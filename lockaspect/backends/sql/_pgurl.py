"""A PostgreSQL store URL's query string, shared by ``postgresql://`` and
``postgresql+table://``: the store's own options are taken out of it, libpq's are left as
written (libpq decodes them itself), and a name that is neither is found before any
connection exists.

psycopg is imported when needed only: ``sqlite://`` users may not have it.
"""

from __future__ import annotations

from collections.abc import Collection
from urllib.parse import unquote

__all__ = ["split_query", "unknown_to_libpq"]


def split_query(url: str, ours: Collection[str]) -> tuple[str, dict[str, str]]:
    """``url`` without the query parameters named in ``ours`` (every other parameter kept
    byte for byte, in order), and those parameters percent-decoded (the last of a repeated
    one wins, as in libpq)."""
    head, sep, rest = url.partition("?")
    if not sep:
        return url, {}
    query, hash_, fragment = rest.partition("#")
    kept: list[str] = []
    taken: dict[str, str] = {}
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if unquote(name) in ours:
            taken[unquote(name)] = unquote(value)
        elif part:
            kept.append(part)
    return head + ("?" + "&".join(kept) if kept else "") + hash_ + fragment, taken


def unknown_to_libpq(url: str) -> list[str]:
    """The names in ``url``'s query string that libpq does not know (sorted, decoded): what
    ``conninfo_to_dict`` refuses as an ``invalid URI query parameter``."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    unknown: set[str] = set()
    for part in url.partition("?")[2].partition("#")[0].split("&"):
        if not part:
            continue
        try:
            conninfo_to_dict("postgresql:///?" + part)
        except psycopg.ProgrammingError as exc:
            if "invalid URI query parameter" in str(exc):
                unknown.add(unquote(part.partition("=")[0]))
    return sorted(unknown)
