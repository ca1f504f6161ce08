"""The operator part of the Redis store (:class:`~lockaspect.backends.base.AdminStore`), with
no I/O: the keys of describe.lua and force_release.lua, their replies, and how
:meth:`held_keys` turns a glob over user keys into a ``SCAN ... MATCH`` over the namespace
and the names it finds back into user keys."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..base import KeyState
from ._layout import Encoded, Op

if TYPE_CHECKING:
    from ._layout import _Layout

__all__ = ["DESCRIBE", "FORCE_RELEASE", "SCAN_COUNT", "held_candidates", "scan_match"]

#: The ``COUNT`` hint of each ``SCAN`` of :meth:`held_keys` (keys the server looks at per call).
SCAN_COUNT = 500

#: The suffixes of a user key's holder keys: the lock (and fair lock), the semaphore's
#: holders, the read-write lock's writer and readers (see _layout's key layout).
HOLDER_SUFFIXES = (b"", b":sem", b":rw:w", b":rw:r")


def _describe_request(layout: _Layout, key: str) -> Encoded:
    lock = layout._lock(key)
    sem, rw = lock + b":sem", lock + b":rw"
    keys = (lock, lock + b":waiters", lock + b":fair", sem, sem + b":fences", sem + b":waiters", sem + b":permits")
    return (*keys, rw + b":w", rw + b":r", rw + b":fences", rw + b":waiters"), ()


def _described(reply: list[list[Any]], key: str) -> list[KeyState]:
    states = []
    for kind, holders, left, fence, waiters, permits in reply:
        states.append(
            KeyState(
                key,
                kind.decode() if isinstance(kind, bytes) else str(kind),
                int(holders),
                None if int(left) < 0 else int(left) / 1000.0,
                None if int(fence) < 0 else int(fence),
                int(waiters),
                None if int(permits) < 0 else int(permits),
            )
        )
    return states


def _force_request(layout: _Layout, key: str) -> Encoded:
    lock = layout._lock(key)
    sem, rw = lock + b":sem", lock + b":rw"
    keys = (lock, lock + b":waiters", lock + b":fair", sem, sem + b":fences", sem + b":waiters")
    return (*keys, rw + b":w", rw + b":r", rw + b":fences", rw + b":waiters"), (lock,)


def _forced(reply: int, key: str) -> bool:
    return bool(reply)


def held_flags(reply: list[int], key: object = None) -> list[bool]:
    """held.lua's reply: one flag per key asked about."""
    return [bool(flag) for flag in reply]


DESCRIBE = Op("describe.lua", _describe_request, _described, "describe")
FORCE_RELEASE = Op("force_release.lua", _force_request, _forced, "force_release")

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def scan_match(namespace: str, pattern: str) -> bytes:
    """The ``SCAN MATCH`` pattern of every holder key of the user keys matching the glob
    ``pattern``: ``<namespace>{<pattern>}*``, the namespace's glob characters escaped. User
    keys never contain braces, so the ``}`` in it matches the one that closes the user key:
    what ``pattern`` matches is exactly the user key."""
    if "{" in pattern or "}" in pattern:
        raise ValueError(f"a key pattern cannot contain '{{' or '}}' (no key does): {pattern!r}")
    return (_GLOB_SPECIAL.sub(r"\\\1", namespace) + "{" + pattern + "}*").encode()


def held_candidates(namespace: str, names: Iterable[bytes | str], seen: set[str]) -> list[tuple[str, bytes]]:
    """The holder keys among ``names`` (a page of a SCAN with :func:`scan_match`), each with
    its user key, leaving out user keys in ``seen`` (already reported)."""
    prefix = (namespace + "{").encode()
    found: list[tuple[str, bytes]] = []
    for name in names:
        raw = name.encode() if isinstance(name, str) else name
        if not raw.startswith(prefix):
            continue
        rest = raw[len(prefix) :]
        close = rest.find(b"}")
        if close < 0 or rest[close + 1 :] not in HOLDER_SUFFIXES:
            continue
        key = rest[:close].decode("utf-8", "surrogateescape")
        if key not in seen:
            found.append((key, raw))
    return found


def held_new(candidates: Sequence[tuple[str, bytes]], flags: Sequence[bool], seen: set[str]) -> list[str]:
    """The user keys of ``candidates`` found held (``flags``) and not reported before; adds
    them to ``seen``."""
    new = []
    for (key, _), held in zip(candidates, flags, strict=True):
        if held and key not in seen:
            seen.add(key)
            new.append(key)
    return new
