"""The watchdog thread's sweep, a part of :class:`~lockaspect.engine.core.Engine`: holds whose
owner vanished without giving them back (an exception raised asynchronously, a leaked
``client.acquire()`` lease) and leases nobody holds any more are released. No I/O of its own:
the releases are the sync runner's."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..lease import Lease
from ..renewal import Renewal
from .holds import HoldRef

if TYPE_CHECKING:
    from .sync import SyncRunner

__all__ = ["Sweeping"]

release_log = logging.getLogger("lockaspect.release")


class Sweeping:
    """The sweep's decisions (a mixin of the engine: its tables and lock)."""

    lock: threading.Lock
    leases: set[Lease]
    held_keys: dict[str, int]
    orphans: deque[HoldRef]
    clock: Callable[[], float]
    sync: SyncRunner
    release_abandoned: Callable[[HoldRef], None]

    def forget(self, lease: Lease) -> None:
        """``lease`` has no hold left: drop it from the tables (lock held)."""
        if lease in self.leases:
            self.leases.discard(lease)
            held_keys = self.held_keys
            left = held_keys.get(lease.key, 0) - 1
            if left > 0:
                held_keys[lease.key] = left
            else:
                held_keys.pop(lease.key, None)

    def sweep(self) -> None:
        """Give back the holds whose owner vanished without giving them back, and recount."""
        orphans = self.orphans
        abandoned = False
        while orphans:
            ref = orphans.popleft()
            if ref not in ref.lease._refs:
                continue
            abandoned = True
            if ref.told:
                self.release_abandoned(ref)
                continue
            release_log.warning(
                "a hold of %r was abandoned without being released (its block or call was unwound by "
                "an exception raised asynchronously?); releasing it",
                ref.lease.key,
            )
            self.release_abandoned(ref)
        if not abandoned:
            return
        with self.lock:
            leases = {lease for lease in self.leases if lease._refs}
            self.leases = leases
            counts: dict[str, int] = {}
            for lease in leases:
                counts[lease.key] = counts.get(lease.key, 0) + 1
            self.held_keys = counts

    def vanished(self, record: Renewal) -> bool:
        """Whether a lease the watchdog is about to renew has nobody left to hold it: its
        lease object is gone, or it has no hold and nobody is releasing it (or a release
        began a whole lease ago and never finished)."""
        lease = None if record.lease_ref is None else record.lease_ref()
        if lease is None:
            return True
        if lease._refs:
            return False  # the usual case, read without the lock: holds only go away under it
        with self.lock:  # the owner gives its last hold back and claims the release at once
            if lease._refs:
                return False
            since = record.releasing_since
        return since is None or self.clock() - since > record.lease_time

    def _release_vanished(self, record: Renewal) -> None:
        self.sync.release_vanished(record)  # a round trip: the thread runner's

    def vanished_released(self, record: Renewal) -> None:
        """The sweep released a lease nobody held: forget it."""
        lease = None if record.lease_ref is None else record.lease_ref()
        if lease is not None:
            with self.lock:
                self.forget(lease)

    def held_count(self) -> int:
        with self.lock:
            return sum(1 for lease in self.leases if lease._refs)
