"""What the operator tools report about a lock: :class:`LockInfo` and its :class:`Holder` items,
as :meth:`LockClient.describe <lockaspect.LockClient.describe>`, :meth:`LockClient.held_locks
<lockaspect.LockClient.held_locks>` and ``lockaspect list --json`` / ``inspect --json`` give
them (the JSON output uses the same field names: :meth:`LockInfo.to_dict`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .backends.base import HolderState, KeyState
from .errors import ConfigurationError
from .owner import parse_owner

__all__ = ["KIND_FILTERS", "Holder", "LockInfo", "infos_from", "pick"]

#: Characters of an owner token shown (never the whole token: whoever has it can release).
TOKEN_PREFIX = 8

#: What ``describe(key, kind=...)`` accepts, and the groups each selects.
KIND_FILTERS = {
    "lock": "lock",
    "fair": "lock",
    "semaphore": "semaphore",
    "read": "rw",
    "write": "rw",
    "rw": "rw",
}


@dataclass(frozen=True, slots=True)
class Holder:
    """One holder of a lock, as the store recorded it.

    Attributes:
        host: The host name of the process that took it (``None`` when it recorded no owner:
            a client with ``owner_info=False``, an older version, a value written by hand).
        pid: Its process id.
        thread: The thread's name, or the asyncio task's.
        function: The decorated function's qualified name, or ``None`` for ``client.lock``,
            ``client.acquire`` and the like.
        template: The decorated function's key template(s), or ``None``.
        acquired_at: Wall-clock time of the acquisition (``time.time()`` of the taker).
        fencing_token: Its fencing token (``None``: the store has none for it).
        token_prefix: The first characters of its owner token (never the whole token).
        remaining: Seconds until its lease ends, from the store; ``math.inf`` for a hold that
            lasts as long as its holder's session (ZooKeeper, PostgreSQL advisory locks) or a
            key with no expiry.
        kind: What it holds: ``"lock"``, ``"fair"``, ``"read"``, ``"write"`` or
            ``"semaphore"`` (a read-write lock's :class:`LockInfo` lists both sides).
        permits: Permits it holds (a semaphore holder that took several; 1 otherwise).
    """

    host: str | None
    pid: int | None
    thread: str | None
    function: str | None
    template: str | None
    acquired_at: float | None
    fencing_token: int | None
    token_prefix: str
    remaining: float
    kind: str = "lock"
    permits: int = 1

    @classmethod
    def from_state(cls, state: HolderState, kind: str) -> Holder:
        fields = parse_owner(state.owner)
        return cls(
            host=_text(fields.get("host")),
            pid=_number(fields.get("pid"), int),
            thread=_text(fields.get("thread")),
            function=_text(fields.get("function")),
            template=_text(fields.get("template")),
            acquired_at=_number(fields.get("acquired_at"), float),
            fencing_token=state.fencing_token,
            token_prefix=state.token[:TOKEN_PREFIX],
            remaining=math.inf if state.remaining is None else max(0.0, state.remaining),
            kind=kind,
            permits=state.weight,
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (``remaining`` of a session-bound hold: ``None``)."""
        out = asdict(self)
        if math.isinf(self.remaining):
            out["remaining"] = None
        return out


@dataclass(frozen=True, slots=True)
class LockInfo:
    """Everything the store knows about one lock.

    Attributes:
        key: The key, without the client's namespace.
        kind: ``"lock"``, ``"fair"`` (a fair lock, or a lock with a fair queue),
            ``"semaphore"``, ``"read"`` (readers only), ``"write"`` (a writer only) or
            ``"rw"`` (a writer and readers: a writer that downgraded).
        holders: Who holds it (a semaphore's permit holders, a read lock's readers).
        waiters: How many wait in the store's queue (callers that poll are not counted; one
            per process for a plain lock's coalesced waiters).
        permits: A semaphore's number of permits (``None`` otherwise, or if never set).
        fencing_token: The largest fencing token among the holders (``None``: none known).
        remaining: The longest remaining lease among the holders, in seconds (``math.inf``:
            a session-bound hold).
        unknown_holders: Holders the store counts but cannot describe (a value at the key
            that lockaspect did not write); usually 0.
    """

    key: str
    kind: str
    holders: tuple[Holder, ...]
    waiters: int
    permits: int | None
    fencing_token: int | None
    remaining: float
    unknown_holders: int = 0

    @property
    def in_use(self) -> int:
        """Permits in use (a semaphore; for other kinds the number of holders)."""
        return sum(holder.permits for holder in self.holders) + self.unknown_holders

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict, as ``lockaspect inspect --json`` prints them."""
        return {
            "key": self.key,
            "kind": self.kind,
            "holders": [holder.to_dict() for holder in self.holders],
            "waiters": self.waiters,
            "permits": self.permits,
            "fencing_token": self.fencing_token,
            "remaining": None if math.isinf(self.remaining) else self.remaining,
            "unknown_holders": self.unknown_holders,
        }


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _number(value: object, kind: type[int] | type[float]) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def _group(state: KeyState) -> str:
    return KIND_FILTERS.get(state.kind, state.kind)


def _merge(key: str, states: Sequence[KeyState]) -> LockInfo:
    holders: list[Holder] = []
    unknown = 0
    remaining: list[float] = []
    fences: list[int] = []
    for state in states:
        holders.extend(Holder.from_state(held, state.kind) for held in state.held_by)
        unknown += max(0, state.holders - len(state.held_by))
        remaining.append(math.inf if state.remaining is None else max(0.0, state.remaining))
        if state.fencing_token is not None:
            fences.append(state.fencing_token)
    kinds = {state.kind for state in states}
    kind = "rw" if kinds == {"read", "write"} else states[0].kind
    permits = next((state.permits for state in states if state.permits is not None), None)
    return LockInfo(
        key=key,
        kind=kind,
        holders=tuple(holders),
        waiters=max(state.waiters for state in states),
        permits=permits,
        fencing_token=max(fences) if fences else None,
        remaining=max(remaining) if remaining else 0.0,
        unknown_holders=unknown,
    )


def infos_from(key: str, states: Sequence[KeyState]) -> list[LockInfo]:
    """The :class:`LockInfo` of each lock held at ``key`` (the lock or fair lock, the
    read-write lock, the semaphore: a key's name may carry one of each), from the store's
    states."""
    groups: dict[str, list[KeyState]] = {}
    for state in states:
        groups.setdefault(_group(state), []).append(state)
    order = {"lock": 0, "rw": 1, "semaphore": 2}
    return [_merge(key, groups[group]) for group in sorted(groups, key=lambda group: order.get(group, 3))]


def check_kind(kind: str | None) -> str | None:
    """The group ``kind`` selects (``None``: any), or :class:`ConfigurationError`."""
    if kind is None:
        return None
    group = KIND_FILTERS.get(kind) if isinstance(kind, str) else None
    if group is None:
        raise ConfigurationError(f"kind must be one of {', '.join(KIND_FILTERS)} or None, got {kind!r}")
    return group


def pick(infos: Sequence[LockInfo], group: str | None) -> LockInfo | None:
    """The lock of ``group`` among ``infos`` (``None``: the first, in the order lock,
    read-write, semaphore)."""
    for info in infos:
        if group is None or KIND_FILTERS.get(info.kind) == group:
            return info
    return None
