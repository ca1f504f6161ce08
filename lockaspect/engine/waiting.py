"""How a caller waits for a busy lock: every decision of the wait loop, with no I/O and no
clock reads (the runners pass the time in).

A :class:`Waiting` is asked for its next step, and told what came of it:

- ``ATTEMPT``: send :meth:`Waiting.request` to the store, then report the answer with
  :meth:`Waiting.attempted` (or the store's error with :meth:`Waiting.failed`);
- ``LISTEN``: subscribe to :attr:`Waiting.listen_key`'s release messages as
  :attr:`Waiting.listen_as` (first unsubscribing the previous subscription and leaving
  :meth:`Waiting.leave_watched`'s queue), then report with :meth:`Waiting.listened`;
- ``PAUSE``: wait for a release message (or sleep, without a subscription) for
  :attr:`Waiting.pause` seconds, then report with :meth:`Waiting.paused`.

Each step is asked with the time, whether the client closed, and whether the subscription is
confirmed now.

:meth:`Waiting.step` raises :class:`~lockaspect.LockNotAcquired` when the wait runs out (or the
last transient store error), and :class:`~lockaspect.ConfigurationError` when the client closed.
When the loop ends, however it ends, :meth:`Waiting.leaving` names the queue place to give back.

The store's queue places: a busy attempt made with a waiter id queues that id for a wake-up,
a successful one takes it off. A process's waiters for one key coalesce: only the one whose
turn it is talks to the store, under the process's id (:attr:`Notifier.waiter_id`); kinds whose
waiters are served in order (``own_place``) and multi-key waiters keep a place of their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from os import urandom
from typing import TYPE_CHECKING

from .. import _policy
from ..backends.base import AcquireRequest, AcquireResult
from ..errors import BackendError, ConfigurationError, LockNotAcquired
from ..kinds import LockKind

if TYPE_CHECKING:
    from ..options import LockSpec
    from .core import Engine

__all__ = ["ATTEMPT", "LISTEN", "PAUSE", "SUBSCRIBE_TIMEOUT", "SpareIds", "Waiting", "new_token", "take_grant"]

#: How long a waiter waits for the store to confirm its release subscription before it
#: starts polling instead.
SUBSCRIBE_TIMEOUT = 1.0

ATTEMPT, LISTEN, PAUSE = range(3)


def new_token() -> str:
    """A fresh owner token: 128 bits from the OS CSPRNG (what ``secrets`` uses)."""
    return urandom(16).hex()


class Waiting:
    """One caller's wait for a busy lock (one key, or a multi-key set), after a failed first
    attempt (one key) or before any (a set: its first step is an attempt).

    Args:
        keys: The key, or the sorted keys of a multi-key lock.
        kind: The lock kind.
        token: The owner token of the attempts (replaced after a failed attempt: that attempt,
            and the release written behind it, may still arrive after a later one acquired).
        lease: The lease to ask for.
        start, deadline: When the call began; when its wait ends (``None``: never).
        wait: The call's ``wait`` option (0: one try, never queues).
        result: The last answer (busy), or an empty one.
        queued: The waiter id the failed first attempt queued under, if it did.
        notify: Release messages can be listened for (the store has them and the call asked).
        own_id: For kinds with a place of their own and for multi-key waiters: their waiter id.
        listens: That own waiter hears release messages.
        below: See :meth:`~lockaspect.kinds.LockKind.below`.
        failure: The first attempt failed transiently (it is retried).
    """

    __slots__ = (
        "_next",
        "attempt",
        "below",
        "deadline",
        "discard",
        "failure",
        "handoff",
        "has_sub",
        "keys",
        "kind",
        "lease",
        "listen_as",
        "listen_key",
        "listens",
        "multi",
        "notify",
        "now",
        "own",
        "own_id",
        "owner",
        "pause",
        "primed",
        "queued",
        "registered",
        "result",
        "sent",
        "stale",
        "start",
        "subscribed",
        "token",
        "tries",
        "wait",
        "waiter",
        "watched",
        "woken",
    )

    def __init__(
        self,
        keys: tuple[str, ...],
        kind: LockKind,
        token: str,
        lease: float,
        start: float,
        deadline: float | None,
        wait: float | None,
        result: AcquireResult,
        *,
        queued: str | None = None,
        notify: bool = False,
        own_id: str | None = None,
        listens: bool = False,
        below: str = "",
        failure: BackendError | None = None,
        multi: bool = False,
        owner: Callable[[str], str] = str,
        handoff: bool = False,
        primed: bool = False,
    ) -> None:
        self.keys = keys
        self.owner = owner
        self.kind = kind
        self.lease = lease
        self.start = start
        self.deadline = deadline
        self.wait = wait
        self.result = result
        self.notify = notify
        self.own = kind.own_place or multi
        self.own_id = own_id
        self.multi = multi
        self.listens = listens
        self.below = below
        self.failure = failure
        self.queued = queued
        # Our id in the lock's queue: a place of our own from the start, or the process's once
        # subscribed (a multi-key waiter's once it listens on the busy key).
        self.waiter: str | None = queued if kind.own_place and not multi else None
        self.token = new_token() if failure is not None else token
        self.watched: str | None = None
        self.subscribed = False  # a confirmed subscription
        self.has_sub = False  # a subscription, confirmed or not
        self.woken = False
        self.attempt = 0
        self.tries = 0 if multi else 1
        self.pause = 0.0
        self.sent = start  # when the last attempt left (the first was sent at the start)
        self.handoff = handoff
        self.primed = primed  # our channel already listened when the queueing attempt left
        # The token of the last attempt that registered our lease with our queue place (a store
        # with FAIR_HANDOFF may make it the owner on release): a grant is for it, never for a
        # token replaced since (after a failed attempt; the store undoes that one).
        self.registered: str | None = token if handoff and queued is not None and failure is None else None
        # Tokens registered with our queue place before an attempt failed (see failed): a
        # release may still make one the owner; and those to give back now (see discards).
        self.stale: list[str] = []
        self.discard: list[str] = []
        self.now = start  # the time of the last step
        self.listen_key = keys[0]
        self.listen_as: str | None = None
        self._next = ATTEMPT if multi else -1

    # -- the loop's steps ---------------------------------------------------------------

    def step(self, now: float, closed: bool, active: bool) -> int:
        """The next step, or raise: the wait ran out, or the client closed. ``active``: the
        subscription is confirmed now (a notifier whose connection failed loses it)."""
        if self.subscribed and not active:
            # A confirmed subscription was lost (the notifier's connection, or its channel's
            # Redis Cluster slot moved to another primary): listen again, then try at once (a
            # release may have been published while nobody listened).
            self.has_sub = False
            self.queued = None
        self.subscribed = active
        self.now = now
        if self._next == ATTEMPT:
            self._next = -1
            return ATTEMPT
        deadline = self.deadline
        if deadline is not None and now >= deadline:
            raise self.timed_out(now)
        if closed:
            raise ConfigurationError("the LockClient was closed while waiting", key=self.keys[0])
        if self.multi:
            busy = self.result.busy or self.keys[0]
            if self.notify and self.failure is None and (busy != self.watched or not self.has_sub):
                self.listen_key, self.listen_as = busy, self.own_id
                return LISTEN
        elif self.notify and not self.has_sub and self.failure is None:
            self.listen_key, self.listen_as = self.keys[0], self.waiter
            return LISTEN
        self.pause = _policy.retry_sleep(
            now=now,
            deadline=deadline,
            holder_ttl=self.result.holder_ttl if self.result.retry_after is None else self.result.retry_after,
            attempt=self.attempt,
            # a fair waiter that cannot hear its wake-up still re-checks often enough to keep its
            # place (FAIR_SUBSCRIBE_GRACE)
            notified=(self.failure is None or self.multi) and (self.subscribed or (self.listens and not self.multi)),
        )
        return PAUSE

    def listen_timeout(self) -> float:
        """How long to wait for the store to confirm a subscription: at most until the
        deadline, counted from the step that asked to listen."""
        deadline = self.deadline
        return SUBSCRIBE_TIMEOUT if deadline is None else min(SUBSCRIBE_TIMEOUT, deadline - self.now)

    def leave_watched(self) -> tuple[str, str] | None:
        """A multi-key waiter about to listen on another key: the queue place to leave first."""
        if self.multi and self.watched is not None and self.waiter is not None:
            return self.watched, self.waiter
        return None

    def listened(self, active: bool, process_id: str | None) -> None:
        """The subscription is made (``active``: confirmed); ``process_id``: the notifier's
        waiter id (what coalesced waiters queue under)."""
        self.subscribed = active
        self.has_sub = True
        if self.multi:
            self.watched = self.listen_key
            self.waiter = self.own_id if active else None
            self._next = ATTEMPT  # retry at once, queued for a wake-up
            return
        if active and not self.own:
            self.waiter = process_id
            if self.queued is not None:
                return  # queued by the failed attempt: wait for the wake-up
        elif active and self.primed and self.queued is not None:
            return  # queued by the first attempt, heard since before it: wait for the wake-up
        # Subscribed: retry at once (and queue for a wake-up), the holder may have released
        # meanwhile (a fair waiter may be first in line by now).
        self._next = ATTEMPT

    def paused(self, woken: bool, granted: int = 0, now: float = 0.0) -> bool:
        """The pause ended (``woken``: by a message); ``granted``: the fencing token of the hold
        the release handed us with it (FAIR_HANDOFF), 0 for none. ``True``: the lock is ours
        (:attr:`result` says so), with no round trip: its lease began after our last attempt
        left, and is trusted from then (:attr:`sent`). A grant of which less than half the
        lease is left by that count is confirmed by an attempt instead (it finds the lock ours
        and renews its lease from then)."""
        self.woken = woken
        self.attempt += 1
        self._next = ATTEMPT
        if granted and self.stale:
            # The grant may be for a token given up after a failed attempt (whose undo may
            # still arrive, so it cannot be ours again): give those back, which passes the
            # lock on if one has it; the attempt that follows finds the lock ours if the grant
            # was for our token after all.
            self.discard = list(self.stale)
            return False
        if granted and self.registered == self.token and now - self.sent < self.lease / 2:
            self.result = AcquireResult(True, granted)
            self.waiter = None  # the release took us off the queue
            return True
        return False

    def discards(self) -> list[str]:
        """Tokens to give back with a release now (see :meth:`paused`), once each."""
        tokens, self.discard = self.discard, []
        return tokens

    def granted_tokens(self) -> list[str]:
        """The tokens a fair release may have made the owner while we waited (FAIR_HANDOFF),
        to give back with a release once off the queue when the wait ends without the lock."""
        tokens = list(self.stale)
        if self.registered is not None and self.registered == self.token:
            tokens.append(self.token)
        return tokens

    def request(self, sent: float) -> AcquireRequest:
        """The next attempt (sent at ``sent``). Woken for this release but beaten to it: keep
        the head of the queue."""
        self.sent = sent
        kind = self.kind
        front = self.woken and not self.own
        keys, token, lease, waiter = self.keys, self.token, self.lease, self.waiter
        return AcquireRequest(
            kind.name, keys, token, lease, waiter, front, self.below, kind.permits, self.owner(keys[0]), kind.weight
        )

    def attempted(self, result: AcquireResult) -> bool:
        """The store's answer; ``True`` when acquired (the attempt took us off the queue)."""
        self.failure = None
        self.tries += 1
        self.result = result
        if result.acquired:
            self.waiter = None
            return True
        if self.handoff and self.waiter is not None:
            self.registered = self.token
        return False

    def failed(self, exc: BackendError, now: float) -> None:
        """An attempt failed: raise unless a retry may succeed while the wait lasts. The
        failed attempt left nothing behind (the store undoes it); the next one uses a fresh
        token (that attempt may still arrive)."""
        if not exc.transient:
            raise exc
        if self.multi and (self.wait == 0 or (self.deadline is not None and now >= self.deadline)):
            raise exc
        self.failure = exc
        if self.registered is not None:
            # Its registration stays with our queue place until an attempt replaces it: a
            # release may make that token the owner meanwhile (see paused, granted_tokens).
            self.stale.append(self.registered)
            self.registered = None
        self.token = new_token()
        self.result = AcquireResult(False, busy=self.watched or self.keys[0])
        if self.multi:
            self.tries += 1
        else:
            self._next = -1

    def timed_out(self, now: float) -> BaseException:
        if self.failure is not None:
            return self.failure
        return not_acquired(self.result.busy or self.keys[0], self.wait, now - self.start, self.result)

    def leaving(self, others: bool) -> tuple[str, str] | None:
        """The queue place to give back when the loop ends without the lock (``others``: other
        waiters of this process for the key still use the process's place)."""
        if self.waiter is None:
            return None
        if self.multi:
            # Where the store has it now: the key its last attempt found busy (it may have
            # moved the place there since we last listened), else the key we listened on.
            place = self.result.busy or self.watched
            return None if place is None else (place, self.waiter)
        if others and not self.own:
            return None
        return self.keys[0], self.waiter


class SpareIds:
    """Fair waiter ids given back by acquisitions (off every queue by then), by key: the next
    fair waiter of the key in this process takes one and finds its wake-up channel still
    subscribed (no SUBSCRIBE round trip, no attempt after subscribing). An id is used by one
    waiter at a time; a few per key, for a bounded number of keys. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids: dict[str, list[str]] = {}

    def take(self, key: str) -> str | None:
        with self._lock:
            spare = self._ids.get(key)
            return spare.pop() if spare else None

    def give(self, key: str, waiter: str) -> None:
        with self._lock:
            spare = self._ids.get(key)
            if spare is None:
                if len(self._ids) >= 256:
                    del self._ids[next(iter(self._ids))]
                spare = self._ids[key] = []
            if len(spare) < 16:
                spare.append(waiter)


def take_grant(subscription: object) -> int:
    """The fencing token a fair release handed over with its wake-up (FAIR_HANDOFF: the
    subscription's ``granted``), consumed; 0 for none (no subscription, or another store)."""
    granted: int = getattr(subscription, "granted", 0)
    if granted:
        subscription.granted = 0  # type: ignore[attr-defined]
    return granted


def not_acquired(key: str, wait: float | None, waited: float, result: AcquireResult) -> LockNotAcquired:
    """The error of a call that gave up on a busy lock."""
    waited = waited if wait else 0.0
    return LockNotAcquired(
        f"lock {key!r} is held by another owner" + (f" (waited {waited:.3f}s)" if wait else ""),
        key=key,
        waited=waited,
        holder_ttl=result.holder_ttl,
    )


def gave_up(engine: Engine, key: str, spec: LockSpec, start: float, result: AcquireResult) -> LockNotAcquired:
    """Tell of a call that gave up on a busy lock (``not_acquired``) and make its error (both
    runners)."""
    waited = engine.clock() - start
    why = "busy" if spec.wait == 0 else "timeout"
    engine.tell("not_acquired", key, spec.kind.name, waited if spec.wait else 0.0, why)
    return not_acquired(key, spec.wait, waited, result)
