"""The observer hook: typed events the engine emits at fixed points, and the observers built in.

An observer is any callable taking a :class:`LockEvent`. Register it when building the client
(``LockClient(..., observers=[my_observer])`` or ``LockClient.from_url(url, observers=[...])``);
:meth:`LockClient.stats <lockaspect.LockClient.stats>` and the library's log lines are
observers too (:class:`StatsObserver`, :class:`LogObserver`). Events are emitted once for
sync and async code, from the engine's decisions, on the thread that made them: the caller's
for acquisitions and releases, the watchdog's for renewals and most losses. An observer must be
quick and must not block; one that raises is logged once and never fails a lock. An observer
that wants only some events may say so with an ``event_names`` attribute (a frozenset of
names); no event is made for the lock cycle's ``acquired`` and ``released`` unless an observer
wants it (the statistics count them without one).

Events (``LockEvent.name``):

``"acquired"``
    A lock was taken (``fencing_token``, ``waited`` seconds since the first attempt).
``"reentered"``
    A context re-entered a lock it holds.
``"waiting"``
    A call found the lock busy and starts waiting (``waited`` is 0).
``"wait_ended"``
    That wait is over, however it ended (``waited`` seconds): acquired, given up, failed
    with a store error, cancelled or interrupted. Every ``waiting`` is followed by exactly
    one ``wait_ended``, so a gauge of waiting callers returns to 0.
``"not_acquired"``
    A call gave up: the lock stayed busy (``waited`` seconds, ``number`` attempts;
    ``reason``: ``"busy"`` for a single try, ``wait=0``, else ``"timeout"``).
``"acquire_failed"``
    An acquisition (or re-entry) failed with a :class:`~lockaspect.BackendError` (``error``):
    the store could not be reached or refused (``waited`` seconds since it began).
``"released"``
    A lock was given back to the store (``held`` seconds since it was taken).
``"release_failed"``
    The store could not be told (``error``); the key expires with its lease.
``"released_late"``
    A body outlived its caller (the call raised first); its lock is released when it ends.
``"renewing"``
    A watchdog round trip starts, renewing ``batch`` leases.
``"renewed"``
    That round trip's outcome: ``number`` leases renewed out of ``batch``.
``"renewal_failed"``
    ``number`` renewals failed and will be retried while their leases last (``error``).
``"lost"``
    A lease was lost (``reason``: ``"expired"``, ``"not-owner"``, ``"max-hold"``; ``held``
    seconds after it was taken).

Context for metrics and tracing (:mod:`lockaspect.contrib.prometheus`,
:mod:`lockaspect.contrib.otel`): the events about one lock carry its ``template`` (the
decorated call's key template, never the rendered key: a label of bounded cardinality), the
``store`` (its name, e.g. ``"redis"``, ``"memory"``), and the ``lease`` itself
(``acquired``, ``reentered``, ``released``, ``release_failed``, ``lost``), so an observer can
tell what it learned at the acquisition (on the caller's thread) to the watchdog thread's
``lost`` event. The template is worked out only when the client has an observer besides
its own log lines.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["ClientStats", "LockEvent", "LogObserver", "Observer", "Observers", "StatsObserver"]

log = logging.getLogger("lockaspect.observe")
lost_log = logging.getLogger("lockaspect.watchdog")
acquire_log = logging.getLogger("lockaspect.acquire")


class LockEvent(NamedTuple):
    """One thing the engine did (see the module docstring for the names). A named tuple: one
    is made for every acquisition and release, so it must be cheap.

    Attributes:
        name: What happened.
        key: The rendered key (empty for a watchdog round trip).
        kind: ``"lock"``, ``"fair"``, ``"semaphore"``, ``"read"`` or ``"write"`` (empty for a
            watchdog round trip).
        waited: Seconds spent waiting, for ``acquired``, ``not_acquired``, ``wait_ended`` and
            ``acquire_failed``.
        fencing_token: The lease's fencing token, where there is one.
        reason: Why a lease was lost; for ``not_acquired``, ``"busy"`` (a single try) or
            ``"timeout"`` (a wait ran out).
        error: The store's error, for the failures.
        number: How many leases a watchdog event covers; for ``not_acquired``, the attempts.
        batch: How many leases one renewal round trip carried.
        template: The key template of the decorated call the lock is for (its qualified name
            for a key given as a callable); ``""`` for ``client.lock(...)`` and the other
            calls that name a rendered key, and for a client with no observer but its log
            lines. Never the rendered key.
        store: The store's name: ``"redis"``, ``"cluster"``, ``"sentinel"``, ``"redlock"``,
            ``"memory"``, ``"table"`` (SQLite or PostgreSQL table), ``"postgres"``,
            ``"zookeeper"``, or a third-party store's class name, lower-cased.
        held: Seconds the lock was held, for ``released``, ``release_failed`` and ``lost``.
        lease: The :class:`~lockaspect.Lease` the event is about, where there is one.
    """

    name: str
    key: str = ""
    kind: str = ""
    waited: float | None = None
    fencing_token: int | None = None
    reason: str | None = None
    error: BaseException | None = None
    number: int = 1
    batch: int = 0
    template: str = ""
    store: str = ""
    held: float | None = None
    lease: Lease | None = None


#: What the engine calls for each event.
Observer = Callable[[LockEvent], object]


@dataclass(frozen=True, slots=True)
class ClientStats:
    """A snapshot of a client's counters (see :meth:`LockClient.stats <lockaspect.LockClient.stats>`)."""

    acquired: int
    reentered: int
    not_acquired: int
    released: int
    renewals: int
    renewal_round_trips: int
    renewal_failures: int
    lost: int
    held: int


class StatsObserver:
    """Counts events for :meth:`LockClient.stats <lockaspect.LockClient.stats>`."""

    __slots__ = ("_lock", "counts")

    _NAMES = ("acquired", "reentered", "not_acquired", "released", "lost")

    def __init__(self) -> None:
        # A plain Lock entered with ``with``: a counter update is a few bytecodes.
        self._lock = threading.Lock()
        self.counts = dict.fromkeys((*self._NAMES, "renewals", "round_trips", "renewal_failures"), 0)

    def count(self, name: str) -> None:
        """Count one ``name`` event (the cycle's hot path: no event is made for it)."""
        with self._lock:
            self.counts[name] += 1

    def __call__(self, event: LockEvent) -> None:
        name = event.name
        with self._lock:
            counts = self.counts
            if name in counts:
                counts[name] += 1
            elif name == "renewed":
                counts["renewals"] += event.number
            elif name == "renewing":
                counts["round_trips"] += 1
            elif name == "renewal_failed":
                counts["renewal_failures"] += event.number

    def snapshot(self, held: int) -> ClientStats:
        with self._lock:
            counts = dict(self.counts)
        return ClientStats(
            acquired=counts["acquired"],
            reentered=counts["reentered"],
            not_acquired=counts["not_acquired"],
            released=counts["released"],
            renewals=counts["renewals"],
            renewal_round_trips=counts["round_trips"],
            renewal_failures=counts["renewal_failures"],
            lost=counts["lost"],
            held=held,
        )

    def reset(self) -> None:
        """Forget the counts (a forked child starts afresh)."""
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.counts, 0)


class LogObserver:
    """The library's own log lines for events: a lost lease is a warning
    (``lockaspect.watchdog``), a call that gave up a debug line (``lockaspect.acquire``)."""

    __slots__ = ()

    #: The events it logs (an observer may declare ``event_names``: it is then told of no others).
    event_names = frozenset({"lost", "not_acquired"})

    def __call__(self, event: LockEvent) -> None:
        name = event.name
        if name == "lost":
            lost_log.warning(
                "lease on %r lost (%s); fencing token %d is stale from now on",
                event.key,
                event.reason,
                event.fencing_token or 0,
            )
        elif name == "not_acquired" and acquire_log.isEnabledFor(logging.DEBUG):
            acquire_log.debug("%r not acquired after %d attempt(s)", event.key, event.number)


class Observers:
    """The client's observers, called in order for each event; one that raises is logged once
    (per observer) and otherwise ignored. An observer with an ``event_names`` attribute (a
    frozenset of event names) is told only of those.

    ``stats`` is counted first, for every event; the two events of every lock cycle
    (``acquired``, ``released``) go through :meth:`cycle`, which makes a :class:`LockEvent`
    only when another observer wants it, and the engine asks :meth:`wants` before making the
    others."""

    __slots__ = ("_broken", "_by_name", "_observers", "_stats", "_wanted", "observed", "store")

    def __init__(self, observers: Iterable[Observer] = (), stats: StatsObserver | None = None) -> None:
        self._stats = stats
        self._observers: tuple[Observer, ...] = tuple(observers)
        self._broken: set[int] = set()
        self._by_name: dict[str, tuple[Observer, ...]] = {}
        self._wanted: dict[str, bool] = {}
        #: Whether an observer besides the library's log lines is registered: only then is an
        #: acquisition's template worked out (see :func:`lockaspect.owner.template_of`).
        self.observed = any(not isinstance(o, LogObserver) for o in self._observers)
        #: The store's name, set by the engine (``LockEvent.store``).
        self.store = ""

    def _wanting(self, name: str) -> tuple[Observer, ...]:
        found = self._by_name.get(name)
        if found is None:
            found = tuple(o for o in self._observers if _wants(o, name))
            self._by_name[name] = found
        return found

    def wants(self, name: str) -> bool:
        """Whether anyone (the statistics or an observer) is told of ``name`` events: the
        engine makes no event otherwise."""
        found = self._wanted.get(name)
        if found is None:
            stats = name in _STATS_NAMES and self._stats is not None
            found = self._wanted[name] = stats or bool(self._wanting(name))
        return found

    def cycle(self, name: str, lease: Lease, waited: float | None = None) -> None:
        """Emit ``name`` (``acquired`` or ``released``) for ``lease`` without making an event
        nobody reads."""
        stats = self._stats
        if stats is not None:  # StatsObserver.count, inlined: this runs twice per lock cycle
            with stats._lock:
                stats.counts[name] += 1
        wanting = self._by_name.get(name)
        if wanting is None:
            wanting = self._wanting(name)
        if wanting:
            held = None if name == "acquired" else lease._held_for()
            event = LockEvent(
                name, lease.key, lease.kind, waited, lease.fencing_token, None, None, 1, 0,
                lease._template, self.store, held, lease,
            )  # fmt: skip
            self._tell(wanting, event)

    @staticmethod
    def check(observers: object) -> list[Observer]:
        """``observers=`` as given by a user: a list of callables."""
        if observers is None:
            return []
        if isinstance(observers, (str, bytes)) or not isinstance(observers, Iterable):
            raise TypeError(f"observers must be a list of callables, got {type(observers).__name__}")
        checked = list(observers)
        for observer in checked:
            if not callable(observer):
                raise TypeError(f"every observer must be callable, got {type(observer).__name__}")
        return checked

    def __call__(self, event: LockEvent) -> None:
        if self._stats is not None:
            self._stats(event)
        self._tell(self._wanting(event.name), event)

    def _tell(self, observers: tuple[Observer, ...], event: LockEvent) -> None:
        for observer in observers:
            try:
                observer(event)
            except Exception:
                if id(observer) not in self._broken:
                    self._broken.add(id(observer))
                    log.exception("observer %r raised on %s (logged once; it keeps being called)", observer, event.name)


#: The events :class:`StatsObserver` counts.
_STATS_NAMES = frozenset({*StatsObserver._NAMES, "renewed", "renewing", "renewal_failed"})


def _wants(observer: Observer, name: str) -> bool:
    """Whether ``observer`` is told of ``name`` events: all of them, unless it declares
    ``event_names`` (a frozenset)."""
    names = getattr(observer, "event_names", None)
    return not isinstance(names, frozenset) or name in names
