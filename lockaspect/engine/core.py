"""The engine's state and decisions, shared by the sync and async runners; no I/O.

The :class:`Engine` holds what one client knows about its locks: the store's description
(capabilities, kinds), the defaults, the holds it counts (every kind's re-entries are counted
here, one place), the watchdog it registers leases with, and the observers it tells. Every
decision that is not about waiting (see :mod:`.waiting`) is a method here: the plan of a lease,
what a re-entry finds, what a store's answer to a release means, when a lease is lost, and how a
finished body settles into a result or :class:`~lockaspect.LockLost`. The runners
(:mod:`.sync`, :mod:`.aio`) do the round trips around it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import _policy
from ..backends.base import AcquireResult, Capability, ReleaseResult, ReportsLosses
from ..errors import BackendError, ConfigurationError, LockLost, NotReplicated
from ..hooks import HookRunner, run_hook
from ..kinds import LockKind
from ..lease import Lease, find_held, fork_epoch
from ..observe import Observers
from ..options import LockSpec
from ..owner import owner_record, template_of
from ..renewal import Renewal, lost_guard
from ..timer import HashedWheelTimer
from ..watchdog import Watchdog
from . import manual
from .events import call_event, lease_event, store_name
from .holds import Hold, HoldRef
from .sweep import Sweeping
from .waiting import SpareIds, Waiting

if TYPE_CHECKING:
    from .aio import AsyncRunner
    from .sync import SyncRunner

__all__ = ["Engine", "Plan"]

release_log = logging.getLogger("lockaspect.release")
acquire_log = logging.getLogger("lockaspect.acquire")


def _no_record(key: str) -> str:
    return ""


class Plan(NamedTuple):
    """The lease an acquisition asks for and how it is renewed (``guard``: see
    :func:`~lockaspect.renewal.lost_guard`)."""

    watchdog: bool
    lease_time: float
    delay_weight: float
    guard: float


class Engine(Sweeping):
    """One client's locks: see the module docstring. Thread-safe."""

    #: The runners, set by the client that builds the engine.
    sync: SyncRunner
    aio: AsyncRunner

    def __init__(
        self,
        store: Any,
        *,
        watchdog_lease: float,
        tick: float,
        delay_weight: float,
        wait_replicas: tuple[int, float] | None,
        clock: Callable[[], float],
        emit: Observers,
        owner_info: bool = True,
    ) -> None:
        self.store = store
        #: The operations behind Lease.release(), extend(), owned(), remaining().
        self.hand = manual
        #: Whether acquisitions send an owner record (see :mod:`lockaspect.owner`), and the
        #: record of an acquisition of a key by this thread now.
        self.owner_info = owner_info
        self.owner: Callable[[str], str] = owner_record if owner_info else _no_record
        self.watchdog_lease = watchdog_lease
        self.tick = tick
        self.delay_weight = delay_weight
        self.wait_replicas = wait_replicas
        self.clock = clock
        self.emit = emit
        emit.store = store_name(store)
        # hears: release messages include other processes' (LOCAL_NOTIFY: waiters poll too)
        self.notify = bool(store.capabilities & (Capability.RELEASE_NOTIFY | Capability.LOCAL_NOTIFY))
        self.hears = bool(store.capabilities & Capability.RELEASE_NOTIFY)
        self.closed = False
        self.timer = HashedWheelTimer(tick, clock=clock)
        self.orphans: deque[HoldRef] = deque()
        self.hooks = HookRunner()
        self.watchdog = Watchdog(
            store,
            self.timer,
            self.watchdog_lost,
            sweep=self.sweep,
            orphans=self.orphans,
            vanished=self.vanished,
            release_vanished=self._release_vanished,
            clock=clock,
            emit=emit,
        )
        # The bookkeeping lock: hold counts and the live holds. A plain Lock entered with
        # ``with`` (C-level), never held across I/O or user code.
        self.lock = threading.Lock()
        # The leases that holds may still be given back to; those whose last hold went are
        # pruned by the watchdog's sweep.
        self.leases: set[Lease] = set()
        # key -> leases on it in this process (any context), for the re-entry fast path. Never
        # too low (a lease leaves only once its last hold is given back); the sweep recounts it.
        self.held_keys: dict[str, int] = {}
        self.spare_ids = SpareIds()
        # id(spec) -> (spec, its single-key plan): a spec is immutable and the store's kinds
        # and this engine's defaults do not change, so its plan is worked out once. The entry
        # keeps its spec alive, so an id here is never a later spec's.
        self.plans: dict[int, tuple[LockSpec, Plan]] = {}
        #: Called with the abandoned hold refs the sweep must release (set by the sync runner).
        self.release_abandoned: Callable[[HoldRef], None] = lambda ref: None
        if isinstance(store, ReportsLosses):
            store.report_losses(self.store_lost)

    # -- before an acquisition (no I/O) ---------------------------------------------------

    def held_here(self, key: str, family: str = "lock") -> Lease | None:
        """The lease this context holds on ``key`` in ``family`` (a re-entry), checking the
        client is open."""
        if self.closed:
            raise ConfigurationError("this LockClient is closed", key=key)
        # Walk this context's held leases only if the key is held here at all, so taking many
        # distinct locks in one context stays O(1) per lock.
        return find_held(self, key, family) if key in self.held_keys else None

    def find(self, key: str, family: str) -> Lease | None:
        """:meth:`held_here` without the closed check (the kinds' ``below`` lookup)."""
        return find_held(self, key, family) if key in self.held_keys else None

    def multi_held(self, keys: tuple[str, ...]) -> list[Lease] | None:
        """The leases this context holds on every key (a re-entry), ``None`` when it holds
        none of them; refused when it holds only some."""
        held = [self.held_here(key) for key in keys]
        if all(lease is None for lease in held):
            return None
        if any(lease is None for lease in held):
            mine = [key for key, lease in zip(keys, held, strict=True) if lease is not None]
            raise ConfigurationError(
                f"this context already holds {mine!r} and asks for them together with other keys: taking the "
                "rest later is how two callers deadlock; take the whole set at once, before any of them",
                key=mine[0],
            )
        return [lease for lease in held if lease is not None]

    def plan(self, spec: LockSpec, key: str, multi: bool = False) -> Plan:
        """The lease to ask for and how to renew it; refuses, before any I/O, a kind the store
        does not serve."""
        if not multi:
            cached = self.plans.get(id(spec))
            if cached is not None and cached[0] is spec:
                return cached[1]
        plan = self._plan(spec, key, multi)
        if not multi and spec.on_lost is None:  # a hook makes a fresh spec per call: not kept
            if len(self.plans) >= 256:
                self.plans.clear()
            self.plans[id(spec)] = (spec, plan)
        return plan

    def _plan(self, spec: LockSpec, key: str, multi: bool) -> Plan:
        store = self.store
        kind: LockKind = spec.kind
        if kind.name not in store.kinds or (multi and not store.capabilities & Capability.MULTI_KEY):
            what = "multi-key" if multi else kind.name
            raise ConfigurationError(
                f"{store!r} does not serve {what} locks (it serves: {', '.join(sorted(store.kinds))})", key=key
            )
        watchdog = spec.lease is None
        delay_weight = self.delay_weight if spec.delay_weight is None else spec.delay_weight
        if spec.lease is None:
            if spec.delay_weight is not None:
                _policy.check_margin(self.watchdog_lease, delay_weight, self.tick)
            lease_time = self.watchdog_lease
        else:
            lease_time = spec.lease
        if spec.max_hold is not None and spec.max_hold < lease_time:
            lease_time = spec.max_hold
        return Plan(watchdog, lease_time, delay_weight, lost_guard(lease_time, self.tick))

    def early_waiter(self, spec: LockSpec, notifier: Any, key: str = "") -> str | None:
        """The waiter id a first attempt may queue under: when the caller would wait and this
        process already listens for the key's wake-ups, a busy first attempt queues at once
        (one round trip fewer per contended acquisition). ``notifier``: the runner's."""
        if spec.kind.own_place:
            if spec.wait == 0:
                return None
            listens = self.hears and spec.wait_strategy == "notify"
            spare = self.spare_ids.take(key) if listens and self.hands_over(self.store, spec.kind) else None
            waiter: str = spare or self.store.waiter_id(listens)
            return waiter
        return None if notifier is None else notifier.waiter_id

    def spare(self, key: str, kind: LockKind, waiter: str | None) -> None:
        """An acquisition of ``kind`` for ``key`` that queued under ``waiter`` succeeded (the
        store took the id off the queue): keep a fair waiter's id for the next (SpareIds)."""
        if waiter is not None and waiter.startswith("n") and self.hands_over(self.store, kind):
            self.spare_ids.give(key, waiter)

    def listens(self, spec: LockSpec) -> bool:
        """Whether a wait of ``spec`` listens for release messages."""
        return self.notify and spec.wait_strategy == "notify" and spec.wait != 0

    # -- after an acquisition (no I/O) ----------------------------------------------------

    def granted(
        self,
        keys: tuple[str, ...],
        token: str,
        result: AcquireResult,
        spec: LockSpec,
        plan: Plan,
        sent: float,
        holds: list[Hold],
        loop: Any = None,
        waited: float | None = None,
    ) -> None:
        """The holds of a granted acquisition, one per key, appended to ``holds`` as they are
        made (the runner gives back what was made and discards the rest if this is cut short).
        Raises :class:`NotReplicated` when fewer replicas than asked confirmed it."""
        wanted = self.wait_replicas
        if wanted is None and len(keys) == 1:  # the usual case, without building anything
            holds.append(
                self.new_lease(keys[0], token, result.fencing_token, result.valid_for, spec, plan, sent, loop, waited)
            )
            return
        if wanted is not None and result.replicas is not None and result.replicas < wanted[0]:
            replicas, timeout = wanted
            refused = NotReplicated(
                f"lock {keys[0]!r} was confirmed by {result.replicas} of {replicas} replica(s) within "
                f"{timeout:g}s, so a failover could lose it; it was released",
                key=keys[0],
                replicas=result.replicas,
                wanted=replicas,
            )
            acquire_log.warning(
                "%r: %d of %d replica(s) confirmed the lock within %gs; released",
                keys[0], result.replicas, replicas, timeout,
            )  # fmt: skip
            raise refused
        fences = result.fencing_tokens or (result.fencing_token,)
        for key, fence in zip(keys, fences, strict=True):
            holds.append(self.new_lease(key, token, fence, result.valid_for, spec, plan, sent, loop, waited))

    def waiting(
        self,
        store: Any,
        keys: tuple[str, ...],
        token: str,
        plan: Plan,
        spec: LockSpec,
        start: float,
        result: AcquireResult,
        queued: str | None = None,
        below: str = "",
        failure: BackendError | None = None,
        multi: bool = False,
        owner: Callable[[str], str] | None = None,
    ) -> Waiting:
        """The wait loop's decisions for one caller (``store``: the runner's, for waiter ids;
        ``owner``: makes each attempt's owner record, default :meth:`owner`)."""
        own_id = store.waiter_id(True) if multi else (queued if spec.kind.own_place else None)
        handoff = not multi and self.hands_over(store, spec.kind)
        notifier = store.notifier() if handoff and queued is not None and self.listens(spec) else None
        return Waiting(
            keys,
            spec.kind,
            token,
            plan.lease_time,
            start,
            _policy.wait_deadline(start, spec.wait),
            spec.wait,
            result,
            queued=queued,
            notify=self.listens(spec),
            own_id=own_id,
            listens=own_id is not None and self.hears and self.listens(spec),
            below=below,
            failure=failure,
            multi=multi,
            owner=owner or self.owner,
            handoff=handoff,
            # Its channel was subscribed before its queueing attempt (only its waiter subscribes
            # it, so it still is): no wake-up was missed, no attempt is due once it listens.
            primed=notifier is not None and notifier.listening(keys[0], queued),
        )

    @staticmethod
    def hands_over(store: Any, kind: LockKind) -> bool:
        """Whether a release of ``store`` may make a waiter of ``kind`` the owner while it
        waits (FAIR_HANDOFF): a waiter that gives up then gives its token back too."""
        return kind.name == "fair" and bool(store.capabilities & Capability.FAIR_HANDOFF)

    def new_lease(
        self, key: str, token: str, fence: int, valid_for: float | None, spec: LockSpec, plan: Plan, sent: float,
        loop: Any = None, waited: float | None = None,
    ) -> Hold:  # fmt: skip
        """The lease for an acquisition, its first hold, registered with the watchdog and
        counted. ``sent``: when the acquire request left (the lease is trusted from then)."""
        kind = spec.kind
        lease_time = plan.lease_time
        granted = lease_time if valid_for is None else min(valid_for, lease_time)
        # Positional: this runs once per acquisition.
        record = Renewal(
            key, token, kind.name, lease_time, plan.delay_weight, sent, granted, spec.max_hold, plan.guard, self.clock
        )
        emit = self.emit
        template = template_of(key) if emit.observed else ""
        lease = Lease(self, record, fence, plan.watchdog, spec.on_lost, loop, kind.permits, kind.family, template)
        record.lease_ref = weakref.ref(lease)
        hold = Hold(lease)
        # The callback is deque.append itself (see new_hold).
        hold.ref = HoldRef(hold, self.orphans.append, lease)
        with self.lock:
            held_keys = self.held_keys
            held_keys[key] = held_keys.get(key, 0) + 1
            self.leases.add(lease)
            lease._refs.append(hold.ref)  # the hold exists from here: one step
        if plan.watchdog:
            self.watchdog.register(record)
        else:
            self.watchdog.watch(record)
        emit.cycle("acquired", lease, waited)
        return hold

    def new_hold(self, lease: Lease) -> Hold:
        hold = Hold(lease)
        # The callback is deque.append itself: a C call, which no exception raised
        # asynchronously can interrupt halfway (the watchdog thread sweeps the deque).
        hold.ref = HoldRef(hold, self.orphans.append, lease)
        return hold

    # -- re-entry (no I/O) ----------------------------------------------------------------

    def enter_hold(self, lease: Lease) -> Hold | None:
        """Count one more hold of ``lease`` before asking the store (so that an outer call
        returning meanwhile cannot release the lock under it); ``None`` when its last hold
        was already given back (the caller then takes the lock afresh)."""
        if lease.lost:
            reason = lease.lost_reason or "expired"
            message = f"cannot re-enter {lease.key!r}: its lease is lost ({reason})"
            raise LockLost(message, key=lease.key, reason=reason, lease=lease)
        hold = self.new_hold(lease)
        with self.lock:
            if not lease._refs:
                return None
            lease._refs.append(hold.ref)
        return hold

    def entered(self, hold: Hold, held: bool) -> None:
        """Settle a re-entry once the store said whether the lease is still ours."""
        lease = hold.lease
        if not held:
            self.lost_here(lease, "not-owner")
            message = f"cannot re-enter {lease.key!r}: the store no longer has it for this owner"
            raise LockLost(message, key=lease.key, reason="not-owner", lease=lease)
        lease_event(self.emit, "reentered", lease)

    # -- giving holds back (no I/O) -------------------------------------------------------

    def give_back(self, ref: HoldRef) -> Lease | None:
        """Count one hold of ``ref.lease`` given back (once per hold, whoever gives it back:
        its owner, or the sweep). Returns the lease when that was its last hold and the
        release must go to the store; ``None`` otherwise.

        Each step of the bookkeeping is one operation, and the watchdog's sweep completes
        what an exception raised asynchronously (a signal handler's) cuts short: a lease with
        no hold left that nobody is releasing is released by the sweep."""
        lease = ref.lease
        record = lease._record
        with self.lock:
            refs = lease._refs
            if ref not in refs:
                return None  # given back already
            refs.remove(ref)
            if refs or lease._epoch != fork_epoch():
                # Re-entered holds remain; or a forked child unwinding a block its parent
                # entered: the lock is the parent's.
                return None
            # The release is ours to send from here (the sweep leaves it to us a while).
            record.releasing_since = self.clock()
            self.forget(lease)
        if record.lost_reason is None and self.clock() >= record.lost_at:
            self.lost_here(lease, record.time_reason())
        if record.lost_reason == "not-owner":  # nothing of ours is left in the store
            self.watchdog.released(record)
            return None
        return lease

    def release_done(self, lease: Lease, code: ReleaseResult | BackendError, abandoned: bool = False) -> None:
        """Act on the store's answer to a release (or on its failure)."""
        record = lease._record
        self.watchdog.released(record)
        if (record.swept or abandoned) and code == ReleaseResult.NOT_OWNER:
            return  # released meanwhile by the sweep, or by the interrupted call itself
        if isinstance(code, BackendError):
            lease_event(self.emit, "release_failed", lease, error=code)
            release_log.warning(
                "release of %r failed; the key expires with its lease (at most %.1fs): %s",
                lease.key,
                lease.lease_time,
                code,
            )
        elif code == ReleaseResult.NOT_OWNER:
            self.lost_here(lease, "not-owner")
        elif code == ReleaseResult.RELEASED:
            self.emit.cycle("released", lease)
        else:
            release_log.warning("%r is still held by this owner after its last release", lease.key)

    def release_failed_locally(self, lease: Lease) -> None:
        """The release was interrupted (not by the store): nobody holds the lease; it expires."""
        self.watchdog.released(lease._record)

    # -- losses ---------------------------------------------------------------------------

    def lost_here(self, lease: Lease, reason: str) -> None:
        """The caller's thread learned of the loss (release, re-entry): the hook runs here."""
        if lease._mark_lost(reason, partial(lease_event, self.emit, "lost", lease, reason)):
            run_hook(lease)

    def store_lost(self, tokens: Collection[str], reason: str, keys: Collection[str] | None = None) -> None:
        """The store reported the holds of ``tokens`` lost, only those on ``keys`` when given
        (see ``LossCallback``)."""
        with self.lock:
            hit = [
                lease._record for lease in self.leases if lease.token in tokens and (keys is None or lease.key in keys)
            ]
        for record in hit:
            self.watchdog.lose(record, reason)

    def watchdog_lost(self, record: Renewal, reason: str) -> None:
        """Report a lease the timer or watchdog gave up; the hook runs on the hook thread."""
        lease = None if record.lease_ref is None else record.lease_ref()
        if lease is None:
            # Nobody holds the lease object any more (the sweep releases what is left).
            if record.lost_reason is None:
                record.lost_reason = reason
            return
        tell = partial(lease_event, self.emit, "lost", lease, reason)
        if lease._mark_lost(reason, tell) and lease._on_lost is not None:
            self.hooks.submit(lease)

    # -- the acquisition's events ---------------------------------------------------------

    def tell(
        self,
        name: str,
        key: str,
        kind: str,
        waited: float | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
        number: int = 1,
    ) -> None:
        """Emit an acquisition's ``waiting``, ``wait_ended``, ``not_acquired`` or
        ``acquire_failed`` (made only if someone is told of it)."""
        call_event(self.emit, name, key, kind, waited, reason, error, number)

    # -- life cycle -----------------------------------------------------------------------

    def stop(self) -> None:
        self.closed = True
        # The watchdog first: a renewal in flight must not find the timer already stopped.
        self.watchdog.stop(timeout=5.0)
        self.timer.stop()
        self.hooks.stop()

    def threads(self) -> Sequence[threading.Thread | None]:
        return [self.timer.thread, self.watchdog.thread, self.hooks.thread]

    def reset_after_fork(self) -> None:
        self.timer._reset_after_fork()
        self.watchdog._reset_after_fork()
        self.hooks = HookRunner()
        self.lock = threading.Lock()
        self.held_keys = {}
        self.spare_ids = SpareIds()  # the parent's: two processes must never share a waiter id
        # The parent's holds are not this process's.
        self.leases = set()
        self.orphans.clear()
