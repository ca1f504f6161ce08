"""The engine's record of a hold: one acquisition or re-entry, owned by the block or call that
took it, referenced weakly so that an abandoned one is found and released."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

from ..lease import Lease

__all__ = ["Hold", "HoldRef"]

_SEQ = itertools.count()


class Hold:
    """One hold of a lease (its acquisition, or one re-entry), owned by the ``with`` block or
    the decorated call that took it, which gives it back through its runner.

    The engine keeps only a weak reference to it (:class:`HoldRef`): a hold that is
    garbage-collected without having been released (its owner was unwound by an exception
    raised asynchronously, say a signal handler's, at a point where no cleanup could run) is
    released by the watchdog thread's sweep, so nothing renews a lease nobody holds."""

    __slots__ = ("__weakref__", "lease", "ref", "seq")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.ref: HoldRef | None = None
        # Orders a lease's holds: ``lease.release()`` gives back the most recent one.
        self.seq = next(_SEQ)


class HoldRef(weakref.ref):  # type: ignore[type-arg]
    """The engine's record of a :class:`Hold`: its lease."""

    __slots__ = ("lease", "told")

    def __new__(cls, hold: Hold, callback: Callable[[HoldRef], object], lease: Lease) -> HoldRef:
        return super().__new__(cls, hold, callback)

    def __init__(self, hold: Hold, callback: Callable[[HoldRef], object], lease: Lease) -> None:
        super().__init__(hold, callback)  # type: ignore[call-arg]
        self.lease = lease
        #: The loss of this hold was already reported (a leaked ``client.acquire()`` lease).
        self.told = False
