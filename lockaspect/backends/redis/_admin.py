"""The operator part of the Redis store (:class:`~lockaspect.backends.base.AdminStore`), with
no I/O: the keys of describe.lua and force_release.lua, their replies, and how
:meth:`held_keys` turns a glob over user keys into a ``SCAN ... MATCH`` over the namespace
and the names it finds back into user keys."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import ConfigurationError
from ..base import HolderState, KeyState
from ._layout import Encoded, Op

if TYPE_CHECKING:
    from ._layout import _Layout

__all__ = ["ADD_PERMITS", "DESCRIBE", "FORCE_RELEASE", "SCAN_COUNT", "held_candidates", "scan_match"]

#: The ``COUNT`` hint of each ``SCAN`` of :meth:`held_keys` (keys the server looks at per call).
SCAN_COUNT = 500

#: The suffixes of a user key's holder keys: the lock (and fair lock), the semaphore's
#: holders, the read-write lock's writer and readers (see _layout's key layout).
HOLDER_SUFFIXES = (b"", b":sem", b":rw:w", b":rw:r")


def _describe_request(layout: _Layout, key: str) -> Encoded:
    lock = layout._lock(key)
    sem, rw = lock + b":sem", lock + b":rw"
    keys = (lock, lock + b":waiters", lock + b":fair", sem, sem + b":fences", sem + b":waiters", sem + b":permits")
    rw_keys = (rw + b":w", rw + b":r", rw + b":fences", rw + b":waiters")
    return (*keys, *rw_keys, sem + b":weights"), ()


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else str(value)


def _seconds(ms: Any) -> float | None:
    return None if int(ms) < 0 else int(ms) / 1000.0


def _holder(entry: Sequence[Any]) -> HolderState:
    """One holder of describe.lua's reply: ``{token, record, ms left, fence, weight}``."""
    token, record, left, fence, weight = entry
    return HolderState(_text(token), _text(record), _seconds(left), None if int(fence) < 0 else int(fence), int(weight))


def _described(reply: list[list[Any]], key: str) -> list[KeyState]:
    states = []
    for kind, holders, left, fence, waiters, permits, held_by in reply:
        states.append(
            KeyState(
                key,
                _text(kind),
                int(holders),
                _seconds(left),
                None if int(fence) < 0 else int(fence),
                int(waiters),
                None if int(permits) < 0 else int(permits),
                tuple(_holder(entry) for entry in held_by),
            )
        )
    return states


def _force_request(layout: _Layout, key: str) -> Encoded:
    lock = layout._lock(key)
    sem, rw = lock + b":sem", lock + b":rw"
    keys = (lock, lock + b":waiters", lock + b":fair", sem, sem + b":fences", sem + b":waiters")
    rw_keys = (rw + b":w", rw + b":r", rw + b":fences", rw + b":waiters")
    return (*keys, *rw_keys, sem + b":weights"), (lock,)


def _forced(reply: int, key: str) -> bool:
    return bool(reply)


#: The largest number of permits ``add_permits`` adds or takes away at once (sem_set.lua
#: counts in doubles: sums stay exact).
MAX_DELTA = 2**48


def _add_request(layout: _Layout, key: str, delta: object) -> Encoded:
    """sem_set.lua's "add" mode; a ``delta`` that is not an int is refused before any I/O."""
    if isinstance(delta, bool) or not isinstance(delta, int):
        raise TypeError(f"the permits to add must be an int, got {type(delta).__name__}")
    if abs(delta) > MAX_DELTA:
        raise ConfigurationError(f"the permits to add must be within ±{MAX_DELTA}, got {delta}")
    keys, (_, lock) = layout._sem_set_request(key, None)
    return keys, (b"%d" % delta, lock, b"add")


def _added(reply: list[int], key: object = None) -> tuple[int, int]:
    return int(reply[0]), int(reply[1])


def held_flags(reply: list[int], key: object = None) -> list[bool]:
    """held.lua's reply: one flag per key asked about."""
    return [bool(flag) for flag in reply]


DESCRIBE = Op("describe.lua", _describe_request, _described, "describe")
ADD_PERMITS = Op("sem_set.lua", _add_request, _added, "add_permits")
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
