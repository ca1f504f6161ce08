"""Batched renewal for the Redis store's twins, with no I/O: a batch of leases becomes script
calls of at most :data:`RENEW_CHUNK` items (:func:`renew_chunks`), sent in one pipelined
round trip; NOSCRIPT is handled by sending the chunks that met it again. Both twins drive
the same generator (:func:`renewal`) with their own round trip. On Redis Cluster (a layout
with a ``slot_of``) a script call holds the items of one hash slot only, and the round trip
is a cluster pipeline: one write per node, whatever the number of slots."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from redis.exceptions import NoScriptError, RedisError

from ...errors import BackendError
from ..base import RenewItem
from ._client import map_redis_error
from ._layout import _ms
from ._script import LuaScript

if TYPE_CHECKING:
    from ._layout import _Layout

__all__ = ["RENEW_CHUNK", "arenew_with", "renew_error", "renew_with", "renewal"]

log = logging.getLogger("lockaspect.backend")

# One EVALSHA per chunk keeps each script call short on the server (Redisson uses 100);
# all chunks of one batch still travel in one pipelined round trip.
RENEW_CHUNK = 256

#: One round trip's commands, each with the index of the chunk it answers for (``None``:
#: a SCRIPT LOAD).
_Round = list[tuple[int | None, tuple[object, ...]]]


class _RenewChunk(NamedTuple):
    """One script call of a renewal: its script, keys and arguments, and the indexes (into
    the renewed items) of the items it answers for, in the order of its statuses."""

    script: LuaScript
    keys: list[str]
    args: list[object]
    indexes: list[int]


def renewal(
    layout: _Layout, leases: Sequence[RenewItem]
) -> Generator[list[tuple[object, ...]], list[Any], list[bool | None]]:
    """A renewal of ``leases``: yields the commands of each round trip, is sent their replies
    (one per command, an error reply as an exception), and returns one status per item
    (``True`` renewed, ``False`` not ours any more, ``None`` its chunk failed: retry). Round 0
    sends every chunk with EVALSHA; the chunks that met NOSCRIPT go again, in round 1 after
    a SCRIPT LOAD of their scripts, in round 2 with EVAL (it cannot meet NOSCRIPT)."""
    chunks = renew_chunks(layout, leases)
    replies: list[Any] = [None] * len(chunks)
    pending = list(range(len(chunks)))
    # A cluster pipeline cannot route a keyless SCRIPT LOAD to the node that needs it: there,
    # the chunks that met NOSCRIPT go again with EVAL (which also caches the script).
    attempts = (0, 2) if layout.slot_of is not None else (0, 1, 2)
    for attempt in attempts:
        commands = _round(chunks, pending, attempt)
        results = yield [command for _, command in commands]
        pending = _record(commands, results, replies)
        if not pending:
            break
    return _renewed(chunks, replies, len(leases))


def renew_chunks(layout: _Layout, leases: Sequence[RenewItem]) -> list[_RenewChunk]:
    """``leases`` as script calls of at most :data:`RENEW_CHUNK` items each: locks and
    writers with renew.lua, semaphore permits and readers (by the item's kind, see
    :data:`RenewItem`) with sem_renew.lua. Each chunk keeps the indexes into ``leases``
    of its items, in the order of the script's statuses."""
    namespace = layout.namespace
    # renew.lua extends a hash its token is in: a lock (or fair lock), a writer;
    # sem_renew.lua a sorted-set member: a semaphore permit, a reader.
    items: Sequence[tuple[Any, ...]] = leases
    kinds = [str(item[3]) if len(item) > 3 else "lock" for item in items]
    unknown = set(kinds) - {"lock", "fair", "write", "semaphore", "read"}
    if unknown:
        raise ValueError(f"cannot renew leases of kind {sorted(unknown)}")
    hashes = [i for i, kind in enumerate(kinds) if kind in ("lock", "fair", "write")]
    members = [i for i, kind in enumerate(kinds) if kind in ("semaphore", "read")]
    chunks: list[_RenewChunk] = []
    for indexes in _slices(hashes, items, layout.slot_of):
        keys: list[str] = []
        args: list[object] = []
        for i in indexes:
            key, token, lease = items[i][:3]
            keys.append(f"{namespace}{{{key}}}" + (":rw:w" if kinds[i] == "write" else ""))
            args.append(token)
            args.append(_ms(lease))
        chunks.append(_RenewChunk(layout._renew, keys, args, indexes))
    for indexes in _slices(members, items, layout.slot_of):
        keys = []
        args = []
        for i in indexes:
            key, token, lease = items[i][:3]
            base = f"{namespace}{{{key}}}" + (":sem" if kinds[i] == "semaphore" else ":rw")
            keys.append(base if kinds[i] == "semaphore" else base + ":r")
            # their fencing tokens (and owner records) and weights live as long (a read-write
            # lock's ":weights" never exists: readers hold one permit)
            keys += (base + ":fences", base + ":weights")
            args.append(token)
            args.append(_ms(lease))
        chunks.append(_RenewChunk(layout._sem_renew, keys, args, indexes))
    return chunks


def _slices(
    indexes: list[int], items: Sequence[tuple[Any, ...]], slot_of: Callable[[str], int] | None
) -> Iterator[list[int]]:
    """``indexes`` in runs of at most :data:`RENEW_CHUNK`; with ``slot_of`` (Redis Cluster),
    each run holds the items of one hash slot (a script's keys must share a slot)."""
    groups: Iterable[list[int]] = [indexes]
    if slot_of is not None:
        by_slot: dict[int, list[int]] = {}
        for i in indexes:
            by_slot.setdefault(slot_of(str(items[i][0])), []).append(i)
        groups = by_slot.values()
    for group in groups:
        for start in range(0, len(group), RENEW_CHUNK):
            yield group[start : start + RENEW_CHUNK]


def _round(chunks: list[_RenewChunk], pending: list[int], attempt: int) -> _Round:
    """The commands of one round trip of a renewal, each with the index of the chunk it
    answers for (``None``: a SCRIPT LOAD). Round 0 sends every chunk with EVALSHA;
    the chunks that met NOSCRIPT go again, in round 1 after a SCRIPT LOAD of their
    scripts, in round 2 with EVAL (the full text: it cannot meet NOSCRIPT)."""
    commands: _Round = []
    if attempt == 1:
        loaded: list[LuaScript] = []
        for index in pending:
            script = chunks[index].script
            if script not in loaded:
                loaded.append(script)
                commands.append((None, ("SCRIPT", "LOAD", script.source)))
    for index in pending:
        chunk = chunks[index]
        make = chunk.script.eval_command if attempt == 2 else chunk.script.command
        commands.append((index, make(chunk.keys, chunk.args)))
    return commands


def _record(commands: _Round, results: list[Any], replies: list[Any]) -> list[int]:
    """Record the replies of one round trip in ``replies`` (by chunk); the chunks that met
    NOSCRIPT, to send again."""
    again: list[int] = []
    for (index, _), result in zip(commands, results, strict=True):
        if index is None:
            continue
        replies[index] = result
        if isinstance(result, NoScriptError):
            again.append(index)
    return again


def _renewed(chunks: list[_RenewChunk], replies: list[Any], count: int) -> list[bool | None]:
    """One status per item from the chunks' replies: ``True`` renewed, ``False`` not ours
    any more, ``None`` when its chunk's call failed (an error reply: that chunk only)."""
    renewed: list[bool | None] = [None] * count
    for chunk, reply in zip(chunks, replies, strict=True):
        if isinstance(reply, Exception):
            log.warning("renewal of %d lease(s) failed, to be retried: %s", len(chunk.indexes), reply)
            continue
        for index, status in zip(chunk.indexes, reply, strict=True):
            renewed[index] = bool(status)
    return renewed


def renew_error(exc: RedisError, leases: Sequence[RenewItem]) -> BackendError:
    first = leases[0][0] if len(leases) == 1 else None
    return map_redis_error(exc, first, f"renewal of {len(leases)} lease(s)")


#: One round trip of a renewal: its commands in, one reply per command out (an error reply as
#: an exception).
RoundTrip = Callable[[list[tuple[object, ...]]], list[Any]]
AsyncRoundTrip = Callable[[list[tuple[object, ...]]], Awaitable[list[Any]]]


def renew_with(layout: _Layout, leases: Sequence[RenewItem], round_trip: RoundTrip) -> list[bool | None]:
    """Renew ``leases`` (see :func:`renewal`), each round sent by ``round_trip``; a driver
    error becomes a :class:`~lockaspect.BackendError`."""
    if not leases:
        return []
    steps = renewal(layout, leases)
    try:
        commands = next(steps)
        while True:
            commands = steps.send(round_trip(commands))
    except StopIteration as done:
        statuses: list[bool | None] = done.value
        return statuses
    except RedisError as exc:
        raise renew_error(exc, leases) from exc


async def arenew_with(layout: _Layout, leases: Sequence[RenewItem], round_trip: AsyncRoundTrip) -> list[bool | None]:
    """:func:`renew_with` for one event loop."""
    if not leases:
        return []
    steps = renewal(layout, leases)
    try:
        commands = next(steps)
        while True:
            commands = steps.send(await round_trip(commands))
    except StopIteration as done:
        statuses: list[bool | None] = done.value
        return statuses
    except RedisError as exc:
        raise renew_error(exc, leases) from exc
