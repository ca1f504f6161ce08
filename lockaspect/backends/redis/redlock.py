"""RedLock: one lock over several independent Redis or Valkey masters.

The algorithm Redis's documentation describes: an acquisition asks every node with the same
owner token and lease, and holds the lock only if a majority granted it within the
validity time (the lease minus the time the round trips took minus a clock-drift
allowance); otherwise it releases on every node. Releases go to every node; a renewal counts
as renewed when a majority renewed it. Waiters poll with random, PTTL-bounded delays (the
nodes' release messages are not used: a message from one node says nothing about the
others).

The validity time, not the lease, is how long the holder may trust the lock, so acquire
and renew report it, in seconds counted from when the request was sent. The caller reads its
clock before calling; the backend measures the elapsed time from its own, later, clock read
before the first request to after the last reply. The validity left once the replies are in
is ``lease - elapsed - drift`` (Redis's description): an attempt is a success only while it
is positive. Counted from the send, that is ``lease - drift``: every node started its lease
after the caller's clock read, so ``sent + lease - drift`` ends before the lease does on any
node that granted it, by at least the drift allowance. The contract:

* :meth:`RedlockStore.acquire`: when acquired, :attr:`AcquireResult.valid_for` is
  ``lease - drift`` (an attempt whose round trips left no validity is not an acquisition).
* :meth:`RedlockStore.renew`: one status per item, ``float | bool | None``:

  - a ``float`` (> 0): renewed by a majority, valid for that many seconds from when the
    renewal was sent (the item's lease - drift);
  - ``False``: not ours: so many nodes said so that no majority can renew it;
  - ``None``: not decided, retry: too few nodes answered for this item, or a majority
    renewed it but the round trips left no validity.

  The call raises :class:`~lockaspect.BackendError` when fewer than a majority of nodes
  answered at all. (Single-server backends answer ``True`` for renewed, meaning the whole
  lease asked for.)

What it does not guarantee, and why fencing is still needed, is in docs/concepts/redlock.md.
Each node is a :class:`~lockaspect.backends.redis.RedisStore` running the same Lua
scripts as a single-server lock; the lock family beyond the plain lock (fair, semaphore,
read-write, multi-key) and ``wait_replicas`` are single-server features.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from ...errors import BackendError, ConfigurationError
from ..base import AcquireRequest, AcquireResult, Capability, ReleaseResult, RenewItem
from .options import SCHEMES, check_redis_options
from .store import AsyncRedisStore, RedisStore

__all__ = ["AsyncRedlockBackend", "AsyncRedlockStore", "RedlockBackend", "RedlockStore", "open_redlock_store"]

#: Clock-drift allowance: this fraction of the lease plus DRIFT_MIN seconds (the Redis
#: documentation's figures: 1% plus 2 ms).
DRIFT_FACTOR = 0.01
DRIFT_MIN = 0.002


class _Quorum:
    """The counting both twins share (no I/O)."""

    # No FENCING: each node counts its own tokens (see docs/concepts/redlock.md).
    capabilities = Capability.RENEWABLE | Capability.BATCH_RENEW
    kinds = frozenset({"lock"})

    def __init__(self, size: int) -> None:
        if size < 3:
            raise ConfigurationError(f"RedLock needs at least 3 independent nodes, got {size}")
        self.size = size
        self.quorum = size // 2 + 1

    @staticmethod
    def drift(lease: float) -> float:
        """The clock-drift allowance for a lease of ``lease`` seconds."""
        return float(lease * DRIFT_FACTOR + DRIFT_MIN)

    def validity(self, lease: float, elapsed: float) -> float:
        """How long a lease of ``lease`` seconds may still be trusted once round trips that
        took ``elapsed`` seconds are answered: the lease minus the elapsed time minus the
        clock-drift allowance (the validity time of Redis's description)."""
        return float(lease - elapsed - self.drift(lease))

    def acquired(
        self, key: str, lease: float, elapsed: float, replies: Sequence[AcquireResult | BaseException]
    ) -> AcquireResult:
        """The outcome of one round of acquire attempts (``BaseException``: that node failed)."""
        granted = [r for r in replies if isinstance(r, AcquireResult) and r.acquired]
        reachable = sum(1 for r in replies if isinstance(r, AcquireResult))
        if len(granted) >= self.quorum and self.validity(lease, elapsed) > 0:
            valid_for = lease - self.drift(lease)  # counted from the send (module docstring)
            # Each node counts its own fencing tokens: the largest of a majority. Two
            # majorities share a node whose counter grew, but this is not a strict order (see
            # docs/concepts/redlock.md).
            return AcquireResult(True, max(r.fencing_token for r in granted), valid_for=valid_for)
        if reachable < self.quorum:
            raise BackendError(
                f"RedLock on {key!r}: only {reachable} of {self.size} nodes answered, {self.quorum} are needed",
                key=key,
            )
        ttls = [r.holder_ttl for r in replies if isinstance(r, AcquireResult) and r.holder_ttl is not None]
        return AcquireResult(False, holder_ttl=min(ttls) if ttls else None)

    def released(self, key: str, replies: Sequence[ReleaseResult | BaseException]) -> ReleaseResult:
        codes = [r for r in replies if isinstance(r, ReleaseResult)]
        for code in (ReleaseResult.RELEASED, ReleaseResult.STILL_HELD):
            if codes.count(code) >= self.quorum:
                return code
        if len(codes) < self.quorum:
            raise BackendError(f"RedLock release of {key!r}: only {len(codes)} of {self.size} nodes answered", key=key)
        return ReleaseResult.NOT_OWNER

    def reentered(self, replies: Sequence[bool | BaseException]) -> bool:
        """Whether a majority still has the lock for the token (a read-only check)."""
        return sum(1 for r in replies if r is True) >= self.quorum

    def renewed(
        self,
        leases: Sequence[RenewItem],
        elapsed: float,
        replies: Sequence[Sequence[bool | None] | BaseException],
    ) -> list[float | bool | None]:
        """The outcome of one renewal round trip, per item (see the module docstring): each
        node answers one ``bool | None`` per item (``None``: that item failed on that node)
        or failed as a whole (``BaseException``)."""
        answers = [r for r in replies if not isinstance(r, BaseException)]
        if len(answers) < self.quorum:
            failed = next((r for r in replies if isinstance(r, BaseException)), None)
            raise BackendError(
                f"RedLock renewal: only {len(answers)} of {self.size} nodes answered ({failed})", key=None
            )
        statuses: list[float | bool | None] = []
        for i, item in enumerate(leases):
            granted = sum(1 for answer in answers if answer[i])
            refused = sum(1 for answer in answers if answer[i] is not None and not answer[i])
            if granted >= self.quorum:
                lease = item[2]
                statuses.append(lease - self.drift(lease) if self.validity(lease, elapsed) > 0 else None)
            elif refused > self.size - self.quorum:
                statuses.append(False)  # even the nodes yet to answer cannot make a majority
            else:
                statuses.append(None)
        return statuses

    @staticmethod
    def waiter_id(listens: bool) -> str:
        """RedLock waiters poll and never queue: no id is ever used."""
        return ""

    @staticmethod
    def check(request: AcquireRequest) -> None:
        """Only plain single-key locks (the client refuses other kinds before any I/O)."""
        if request.kind != "lock" or len(request.keys) != 1:
            raise ConfigurationError(
                "RedLock supports plain single-key locks only (not fair, semaphore, read-write or multi-key)",
                key=request.keys[0] if request.keys else None,
            )


class RedlockStore(_Quorum):
    """A lock store made of several independent Redis or Valkey masters (RedLock). (Old name:
    ``RedlockBackend``.) It serves plain single-key locks only (:attr:`kinds`).

    Args:
        nodes: At least 3 :class:`RedisStore` on independent servers (not replicas of each
            other), all with the same namespace. 5 is the usual choice: it survives 2 nodes
            down.
    """

    def __init__(self, nodes: Sequence[RedisStore]) -> None:
        super().__init__(len(nodes))
        self.nodes = tuple(nodes)

    @classmethod
    def from_urls(cls, urls: Sequence[str], *, namespace: str = "lockaspect:", **options: Any) -> RedlockStore:
        # A dead node must cost little: short timeouts by default (redis-py options win).
        options.setdefault("socket_timeout", 0.25)
        options.setdefault("socket_connect_timeout", 0.25)
        return cls([RedisStore.from_url(url, namespace=namespace, **options) for url in urls])

    def asyncio_twin(self) -> AsyncRedlockStore:
        return AsyncRedlockStore([node.asyncio_twin() for node in self.nodes])

    def __repr__(self) -> str:
        return f"<RedLock store over {self.size} nodes>"

    @staticmethod
    def _each(calls: Any) -> list[Any]:
        replies: list[Any] = []
        for call in calls:
            try:
                replies.append(call())
            except BackendError as exc:
                replies.append(exc)
        return replies

    def acquire(self, request: AcquireRequest) -> AcquireResult:
        self.check(request)
        key, token, lease = request.keys[0], request.token, request.lease
        single = AcquireRequest("lock", request.keys, token, lease, owner=request.owner)
        start = time.monotonic()
        replies = self._each(lambda node=node: node.acquire(single) for node in self.nodes)
        try:
            result = self.acquired(key, lease, time.monotonic() - start, replies)
        except BackendError:
            self._release_everywhere(key, token)
            raise
        if not result.acquired:
            self._release_everywhere(key, token)  # the minority that granted it must not keep it
        return result

    def _release_everywhere(self, key: str, token: str) -> None:
        self._each(lambda node=node: node.release(key, token) for node in self.nodes)

    def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        return self.released(key, self._each(lambda node=node: node.release(key, token) for node in self.nodes))

    def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        return self.reentered(self._each(lambda node=node: node.reenter(key, token) for node in self.nodes))

    def renew(self, leases: Sequence[RenewItem]) -> list[float | bool | None]:
        """Renew on every node; one ``float | bool | None`` per item (module docstring)."""
        if not leases:
            return []
        start = time.monotonic()
        replies = self._each(lambda node=node: node.renew(leases) for node in self.nodes)
        return self.renewed(leases, time.monotonic() - start, replies)

    def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Nothing to do: RedLock waiters never queue."""

    def notifier(self) -> None:
        return None

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        raise ConfigurationError("wait_replicas needs a single server: RedLock nodes are independent masters")

    def threads(self) -> list[threading.Thread]:
        return [thread for node in self.nodes for thread in node.threads()]

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def reset_after_fork(self) -> None:
        for node in self.nodes:
            node.reset_after_fork()


class AsyncRedlockStore(_Quorum):
    """:class:`RedlockStore` for one event loop: the nodes are asked concurrently. (Old name:
    ``AsyncRedlockBackend``.)"""

    def __init__(self, nodes: Sequence[AsyncRedisStore]) -> None:
        super().__init__(len(nodes))
        self.nodes = tuple(nodes)

    @staticmethod
    async def _each(calls: Any) -> list[Any]:
        async def one(call: Any) -> Any:
            try:
                return await call()
            except BackendError as exc:
                return exc

        return list(await asyncio.gather(*(one(call) for call in calls)))

    async def acquire(self, request: AcquireRequest) -> AcquireResult:
        self.check(request)
        key, token, lease = request.keys[0], request.token, request.lease
        single = AcquireRequest("lock", request.keys, token, lease, owner=request.owner)
        start = time.monotonic()
        replies = await self._each(lambda node=node: node.acquire(single) for node in self.nodes)
        try:
            result = self.acquired(key, lease, time.monotonic() - start, replies)
        except BackendError:
            await self._release_everywhere(key, token)
            raise
        if not result.acquired:
            await self._release_everywhere(key, token)
        return result

    async def _release_everywhere(self, key: str, token: str) -> None:
        await self._each(lambda node=node: node.release(key, token) for node in self.nodes)

    async def release(self, key: str, token: str, kind: str = "lock") -> ReleaseResult:
        return self.released(key, await self._each(lambda node=node: node.release(key, token) for node in self.nodes))

    async def reenter(self, key: str, token: str, kind: str = "lock") -> bool:
        return self.reentered(await self._each(lambda node=node: node.reenter(key, token) for node in self.nodes))

    async def renew(self, leases: Sequence[RenewItem]) -> list[float | bool | None]:
        """Renew on every node; one ``float | bool | None`` per item (module docstring)."""
        if not leases:
            return []
        start = time.monotonic()
        replies = await self._each(lambda node=node: node.renew(leases) for node in self.nodes)
        return self.renewed(leases, time.monotonic() - start, replies)

    async def unqueue(self, key: str, waiter: str, kind: str = "lock") -> None:
        """Nothing to do: RedLock waiters never queue."""

    def notifier(self) -> None:
        return None

    async def aclose(self) -> None:
        for node in self.nodes:
            await node.aclose()


#: The old names of the two stores.
RedlockBackend = RedlockStore
AsyncRedlockBackend = AsyncRedlockStore


def open_redlock_store(urls: object, *, namespace: str = "lockaspect:", **options: Any) -> RedlockStore:
    """A RedLock store over ``urls`` (see :meth:`lockaspect.LockClient.from_urls`), every URL
    and option checked before any connection: at least 3 distinct Redis URLs."""
    if isinstance(urls, str) or not isinstance(urls, Sequence) or not all(isinstance(url, str) for url in urls):
        raise TypeError("urls must be a list of URL strings")
    for url in urls:
        check_redis_options(url, options)
        if urlsplit(url).scheme not in SCHEMES:
            raise ConfigurationError(f"unsupported lock store URL {url!r}")
    if len(set(urls)) != len(urls):
        raise ConfigurationError("RedLock needs distinct servers: a URL is repeated")
    if not isinstance(namespace, str) or "{" in namespace or "}" in namespace:
        raise ConfigurationError(f"namespace must be a str without '{{' or '}}', got {namespace!r}")
    if len(urls) < 3:
        raise ConfigurationError(f"RedLock needs at least 3 independent servers, got {len(urls)}")
    return RedlockStore.from_urls(list(urls), namespace=namespace, **options)
