"""The observer events the engine makes outside the lock cycle (which :meth:`Observers.cycle
<lockaspect.observe.Observers.cycle>` makes): each is built only when someone is told of it,
with the context metrics and tracing need (the template, the store, the lease)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..observe import LockEvent, Observers
from ..owner import template_of

if TYPE_CHECKING:
    from ..lease import Lease

__all__ = ["call_event", "lease_event", "store_name"]

#: Store class names (lower-cased, without ``Async`` and ``Store``) whose name in events is
#: another, the one users know the store by.
_RENAMED = {"postgresadvisory": "postgres", "bridge": "table"}


def store_name(store: object) -> str:
    """The store's name in events (``LockEvent.store``): its ``store_name`` attribute when it
    has one, else its class name lower-cased without ``Async`` and ``Store`` (``RedisStore``:
    ``"redis"``, ``MemoryStore``: ``"memory"``)."""
    name = getattr(store, "store_name", None)
    if isinstance(name, str) and name:
        return name
    cls = type(store).__name__
    short = cls.removeprefix("Async").removesuffix("Store").lower() or cls.lower()
    return _RENAMED.get(short, short)


def call_event(
    emit: Observers,
    name: str,
    key: str,
    kind: str,
    waited: float | None = None,
    reason: str | None = None,
    error: BaseException | None = None,
    number: int = 1,
) -> None:
    """Tell of an acquisition's step before it has a lease (``waiting``, ``wait_ended``,
    ``not_acquired``, ``acquire_failed``), on the caller's thread: the template is this
    context's decorated call's."""
    if emit.wants(name):
        template = template_of(key) if emit.observed else ""
        emit(LockEvent(name, key, kind, waited, None, reason, error, number, 0, template, emit.store))


def lease_event(
    emit: Observers, name: str, lease: Lease, reason: str | None = None, error: BaseException | None = None
) -> None:
    """Tell of something that happened to ``lease`` (``reentered``, ``release_failed``,
    ``lost``), on any thread: the template travels with the lease."""
    if emit.wants(name):
        held = lease._held_for() if name == "lost" or name == "release_failed" else None
        emit(
            LockEvent(
                name, lease.key, lease.kind, None, lease.fencing_token, reason, error, 1, 0,
                lease._template, emit.store, held, lease,
            )
        )  # fmt: skip
