"""A semaphore's acquire for :class:`~._ops.Core` (kept apart for the size of that module):
a hold of ``request.weight`` slots, all or none, in one statement (see ``_sql.SEM_ACQUIRE``)."""

from __future__ import annotations

import random
import threading
from typing import Any

from ...base import AcquireRequest, AcquireResult
from . import _sql
from ._state import GRANTED, WAITING, Hold, Pending, Table, slot_keys
from ._steps import Leave, Plan, Queue, Run

__all__ = ["SemaphoreOps"]


class SemaphoreOps:
    """The semaphore part of :class:`~._ops.Core` (which provides the rest)."""

    namespace: str
    lock: threading.Lock
    table: Table

    def _claim(self, request: AcquireRequest, key: str, objkey: int, shared: bool) -> Pending | None:
        raise NotImplementedError

    def _record_claim(self, request: AcquireRequest, pending: Pending) -> Plan:
        raise NotImplementedError

    def _dequeue(self, key: str, waiter: str | None) -> Plan:
        raise NotImplementedError

    def _busy(self, request: AcquireRequest, busy: str | None = None) -> AcquireResult:
        raise NotImplementedError

    def _params(self, request: AcquireRequest, key: str, objkey: int, slot: int | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def _sem_acquire(self, request: AcquireRequest) -> Plan:
        """``request.weight`` slots at once, all or none, in one statement. A hold of one
        permit queues in the server on a slot; a hold of several polls (a granted slot held
        while waiting for the others would hold back permits others need: two such waiters
        would wait for each other)."""
        key, token, waiter, weight = request.key, request.token, request.waiter, request.weight
        permits = request.permits
        assert permits is not None
        slots = slot_keys(self.namespace, key, permits)
        claimed = leave = None
        with self.lock:
            hold = self.table.live(token, key)
            if hold is not None:
                return AcquireResult(True, hold.fence)
            pending = self.table.wait_of(key, waiter)
            if pending is not None and weight == 1:
                claimed = self._claim(request, key, pending.objkey, False)
            elif pending is not None and pending.state == GRANTED:  # this process's place, one permit
                self.table.remove_wait(pending)
                leave, pending = pending, None
            free = [None if self.table.conflict(slot, False, token, waiter) else slot for slot in slots]
        if claimed is not None:
            yield from self._record_claim(request, claimed)
            return AcquireResult(True, claimed.fence)
        if leave is not None:
            yield Leave(leave)
        params = {
            "name": self.namespace + key,
            "want": permits,
            "slots": free,
            "weight": weight,
            "lease": float(request.lease),
            "token": token,
            "owner": request.owner or None,
        }

        def after(session: Any, rows: list[tuple[Any, ...]]) -> tuple[int | None, int | None]:
            stored, taken, fence = rows[0][:3]
            if fence is None:
                return stored, None
            objkeys = [slots[n] for n in taken] if weight > 1 else [slots[taken]]
            with self.lock:
                if not any(self.table.conflict(objkey, False, token, waiter) for objkey in objkeys):
                    hold = Hold(key, token, "semaphore", objkeys[0], False, session, int(fence), tuple(objkeys[1:]))
                    self.table.add(hold)
                    return stored, int(fence)
            session.undo.extend((objkey, False) for objkey in objkeys)
            return stored, None

        sql = _sql.SEM_ACQUIRE if weight == 1 else _sql.SEM_ACQUIRE_MANY
        _, (stored, fence) = yield Run(sql, params, key, None, frozenset(slots), after)
        if stored is not None and stored != permits:
            return AcquireResult(False, permits=int(stored))
        if fence:
            yield from self._dequeue(key, waiter)
            return AcquireResult(True, fence)
        if waiter is not None and weight == 1 and (pending is None or pending.state != WAITING):
            # Queue on one slot (at random: a semaphore's waiters are not served in order).
            objkey = random.choice(slots)
            yield Queue(
                key,
                waiter,
                "semaphore",
                objkey,
                False,
                _sql.ACQUIRE_X,
                self._params(request, key, objkey, slots.index(objkey)),
            )
        return self._busy(request)
