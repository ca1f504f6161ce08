"""The ZooKeeper store's operations as plans: generators that yield a batch of
:class:`~._calls.Call` (sent pipelined, one round trip) and receive each call's answer, so the
thread store and the asyncio twin share every decision and differ only in how they wait.

A failed batch is thrown into the plan as :class:`~lockaspect.BackendError` (or the caller's
cancellation); the plan undoes what it made and re-raises.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from typing import Any

from ...errors import BackendError
from ..base import AcquireRequest, AcquireResult, ReleaseResult
from ._calls import Call
from ._layout import Contender, contender_prefix, decide, encode_key, family_of, infix_of, ordered
from ._record import encode
from ._session import Node, NodeExistsError, NoNodeError, Session

__all__ = ["Plan", "acquire", "admin_permits", "node_data", "parent_of", "reenter", "release", "unqueue"]

Plan = Generator[list[Call], list[Any], Any]

#: Re-lists of a queue within one attempt (the predecessor left while we looked).
RELISTS = 8


def node_data(session: Session, request: AcquireRequest) -> bytes:
    """The data a contender node of ``request`` carries: its token, kind, lease and owner
    record (see :mod:`._record`); ``b""`` with the URL's ``owner_info=false``."""
    if not session.settings.owner_info:
        return b""
    return encode(request.token, request.kind, request.lease, request.owner)


def admin_permits(parent_data: Any) -> int | None:
    """The permits an operator set on a semaphore (the parent node's data), if any."""
    if not isinstance(parent_data, tuple) or not parent_data[0]:
        return None
    try:
        value = json.loads(parent_data[0]).get("permits")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def parent_of(session: Session, key: str) -> str:
    return f"{session.root}/{encode_key(key)}"


def _created(session: Session, key: str, parent: str, infix: str, answer: Any, epoch: int, token: str) -> Node:
    path, stat = answer
    node = Node(key, parent, path.rsplit("/", 1)[1], infix, int(stat.czxid), epoch)
    node.written = token
    with session.lock:
        if session.epoch != epoch:
            stale = True
        else:
            stale = False
            session.book.paths[node.path] = node
    if stale:
        session.delete_later(node.path)
        raise BackendError(f"ZooKeeper {session.settings.shown}: the session was lost", key=key, transient=True)
    return node


def _create(session: Session, key: str, infix: str, data: bytes, sem: bool, token: str) -> Plan:
    """Create our contender under ``key``'s parent (making the parent, a container, if need
    be) and list the queue, in one round trip. Returns ``(node, children, parent data)``."""
    parent = parent_of(session, key)
    for _ in range(3):
        make = not session.ensure_parent(parent)
        calls = [Call("container" if session.settings.containers else "persistent", parent)] if make else []
        calls += [
            Call("create", f"{parent}/{contender_prefix(os.urandom(16).hex(), infix)}", data),
            Call("children", parent),
        ]
        if sem:
            calls.append(Call("get", parent))
        answers = yield calls
        epoch = getattr(answers, "epoch", session.epoch)  # the session's epoch when it was sent
        answers = answers[1:] if make else answers
        if isinstance(answers[0], NoNodeError):
            session.parent_gone(parent)  # reaped as an empty container meanwhile: make it again
            continue
        if isinstance(answers[0], Exception):
            raise BackendError(f"ZooKeeper {session.settings.shown}: {answers[0]!r}", key=key)
        session.parent_made(parent)
        node = _created(session, key, parent, infix, answers[0], epoch, token)
        return node, answers[1], answers[2] if sem else None
    raise BackendError(f"ZooKeeper {session.settings.shown}: {parent} keeps disappearing", key=key, transient=True)


def _drop(session: Session, node: Node) -> None:
    with session.lock:
        book = session.book
        book.paths.pop(node.path, None)
        if node.waiter and book.queued.get((node.key, node.waiter)) is node:
            del book.queued[(node.key, node.waiter)]
    session.delete_later(node.path)


def _give_back(session: Session, nodes: list[Node]) -> Plan:
    """A try that found a key busy deletes the nodes it made, and waits for the deletion: it
    must keep nothing once it answers (another session's try right after would find the
    node, as a holder of a multi-key set's first key, or ahead of it in the queue). Should
    the deletion fail, :func:`_drop` keeps at it."""
    with session.lock:
        for node in nodes:
            session.book.paths.pop(node.path, None)
    try:
        answers = yield [Call("delete", node.path) for node in nodes]
    except BackendError:
        answers = [None] * len(nodes)
        for node in nodes:
            session.delete_later(node.path)
    for node, answer in zip(nodes, answers, strict=True):
        if isinstance(answer, Exception) and not isinstance(answer, NoNodeError):
            session.delete_later(node.path)


def _hold(session: Session, node: Node, token: str, woke_others: bool, data: bytes) -> AcquireResult:
    """``node`` holds the lock for ``token``: book it (the watchdog's first renewal sets the
    watch that tells of its deletion by anyone else, see ``Session.watch_held``); a
    semaphore holder that waited touches its node, which wakes its successor. A node made
    for another token (a same-process waiter's, shared) gets ``data``, this hold's."""
    with session.lock:
        book = session.book
        if node.waiter and book.queued.get((node.key, node.waiter)) is node:
            del book.queued[(node.key, node.waiter)]
        waiter, node.waiter, node.token = node.waiter, "", token
        node.held_since = time.monotonic()
        book.holds[(node.key, token)] = node
    if waiter:
        session.forget((node.key, waiter))
    session.held()
    if woke_others or node.written != token:
        node.written = token
        try:
            session.send([Call("set", node.path, data)])  # answered later; nothing waits for it
        except BackendError:
            pass
    return AcquireResult(True, node.fence)


def _queue_of(children: Any, node: Node) -> list[Contender]:
    return ordered(children if isinstance(children, list) else [], family_of(node.infix))


def _decide(children: Any, node: Node, ignore: str, set_permits: int | None) -> Any:
    return decide(_queue_of(children, node), node.name, ignore=ignore, permits=set_permits)


def acquire(session: Session, request: AcquireRequest) -> Plan:
    """One attempt at a single key (see ``Store.acquire``)."""
    if len(request.keys) > 1:
        return (yield from acquire_multi(session, request))
    key, waiter = request.key, request.waiter
    with session.lock:
        book = session.book
        held = book.holds.get((key, request.token))
        if held is not None and held.epoch == session.epoch:
            return AcquireResult(True, held.fence)
        claim = (key, waiter) if waiter and (key, waiter) not in book.claims else None
        if claim is not None:
            book.claims.add(claim)
    try:
        return (yield from _acquire(session, request, waiter if claim is not None else None))
    finally:
        if claim is not None:
            with session.lock:
                session.book.claims.discard(claim)


def _acquire(session: Session, request: AcquireRequest, waiter: str | None) -> Plan:
    key, token, kind = request.key, request.token, request.kind
    sem = kind == "semaphore"
    with session.lock:
        book = session.book
        node = book.queued.get((key, waiter)) if waiter else None
        below = book.holds.get((key, request.below)) if request.below else None
    ignore = below.name if below is not None else ""
    infix = infix_of(kind, request.permits, request.weight)
    parent = parent_of(session, key)
    if node is not None and (node.epoch != session.epoch or node.infix != infix):
        _drop(session, node)
        node = None
    if node is not None and waiter and session.hub.is_armed((key, waiter)):
        # Our watch is set and has not fired: nothing ahead of us left; still busy.
        return AcquireResult(False, holder_ttl=request.lease)
    waited = node is not None
    data = node_data(session, request)
    if node is None:
        node, children, pdata = yield from _create(session, key, infix, data, sem, token)
        if waiter:
            with session.lock:
                node.waiter = waiter
                session.book.queued[(key, waiter)] = node
    else:
        answers = yield ([Call("children", parent), Call("get", parent)] if sem else [Call("children", parent)])
        children, pdata = answers[0], (answers[1] if sem else None)
    try:
        for _ in range(RELISTS):
            verdict = _decide(children, node, ignore, admin_permits(pdata))
            if verdict is None:  # our queue place vanished (deleted by someone): start again
                _drop(session, node)
                return AcquireResult(False, holder_ttl=request.lease, retry_after=0.0)
            if sem and verdict.permits != request.permits:
                _drop(session, node)
                return AcquireResult(False, holder_ttl=request.lease, permits=verdict.permits)
            if verdict.holds:
                return _hold(session, node, token, sem and waited, data)
            if not waiter:
                yield from _give_back(session, [node])
                return AcquireResult(False, holder_ttl=request.lease)
            wake = _waker(session, key, waiter)
            channel = (key, waiter)
            session.hub.arm(channel)
            try:
                if verdict.watch == "":
                    # The queue, and the key's data: an operator's raising the permits wakes it.
                    answers = yield [Call("children", parent, watch=wake), Call("get", parent, watch=wake)]
                else:
                    answers = yield [Call("exists", f"{parent}/{verdict.watch}", watch=wake)]
            except BaseException:
                session.hub.disarm(channel)
                raise
            if verdict.watch == "":
                children, pdata = answers[0], (answers[1] if sem else pdata)
                if _decide(children, node, ignore, admin_permits(pdata)) == verdict:
                    return AcquireResult(False, holder_ttl=request.lease)
                session.hub.disarm(channel)
                waited = True
                continue
            stat = answers[0]
            if stat is not None and not isinstance(stat, Exception):
                return AcquireResult(False, holder_ttl=request.lease)
            session.hub.disarm(channel)
            answers = yield ([Call("children", parent), Call("get", parent)] if sem else [Call("children", parent)])
            children, pdata = answers[0], (answers[1] if sem else None)
            waited = True
        return AcquireResult(False, holder_ttl=request.lease, retry_after=0.05)
    except BaseException:
        if not waiter:
            _drop(session, node)
        raise


def _waker(session: Session, key: str, waiter: str) -> Any:
    return session.hub.waker((key, waiter))


def acquire_multi(session: Session, request: AcquireRequest) -> Plan:
    """One attempt at several keys (sorted): held in order, so a waiter keeps its nodes on a
    prefix of the keys (lowest on all but the last) and never waits for a key while a later
    one's node could block someone (no deadlock); a try keeps nothing."""
    keys, token, waiter = request.keys, request.token, request.waiter
    with session.lock:
        book = session.book
        held = [book.holds.get((key, token)) for key in keys]
        if all(node is not None and node.epoch == session.epoch for node in held):
            fences = tuple(node.fence for node in held if node is not None)
            return AcquireResult(True, fences[0], fencing_tokens=fences)
        mine = list(book.multi.get(waiter, ())) if waiter else []
    if any(node.epoch != session.epoch for node in mine):
        for node in mine:
            _drop(session, node)
        mine = []
    data = node_data(session, request)
    try:
        if True:
            if mine:  # re-check the key we wait for
                last = mine[-1]
                (children,) = yield [Call("children", last.parent)]
                verdict = _decide(children, last, "", None)
                if verdict is None:
                    raise BackendError("a multi-key waiter's node vanished", key=last.key, transient=True)
                if not verdict.holds:
                    return (yield from _multi_wait(session, request, mine, verdict))
            verdict = None
            for key in keys[len(mine) :]:
                node, children, _ = yield from _create(session, key, "lock", data, False, token)
                mine.append(node)
                verdict = _decide(children, node, "", None)
                if verdict is None:
                    raise BackendError("a multi-key contender's node vanished", key=key, transient=True)
                if not verdict.holds:
                    break
            if verdict is None or verdict.holds:  # None: every key was ours already
                taken: list[int] = []
                with session.lock:
                    session.book.multi.pop(waiter or "", None)
                if waiter:
                    for node in mine:
                        session.forget((node.key, waiter))
                for node in mine:
                    node.waiter = ""
                    taken.append(_hold(session, node, token, False, data).fencing_token)
                return AcquireResult(True, taken[0], fencing_tokens=tuple(taken))
            return (yield from _multi_wait(session, request, mine, verdict))
    except BaseException:
        if not waiter:
            for node in mine:
                _drop(session, node)
        raise


def _multi_wait(session: Session, request: AcquireRequest, mine: list[Node], verdict: Any) -> Plan:
    """Not all keys are ours: a try gives everything back; a waiter keeps its nodes and
    watches the predecessor on the busy key."""
    busy = mine[-1]
    waiter = request.waiter
    if not waiter:
        yield from _give_back(session, mine)
        return AcquireResult(False, holder_ttl=request.lease, busy=busy.key)
    with session.lock:
        for node in mine:
            node.waiter = waiter
            session.book.paths[node.path] = node
        session.book.multi[waiter] = mine
    (stat,) = yield [Call("exists", f"{busy.parent}/{verdict.watch}", watch=_waker(session, busy.key, waiter))]
    retry = 0.0 if stat is None or isinstance(stat, Exception) else None
    return AcquireResult(False, holder_ttl=request.lease, busy=busy.key, retry_after=retry)


def release(session: Session, key: str, token: str) -> Plan:
    """Give back ``token``'s hold: delete its node (and, should the connection fail, keep
    deleting it until it is gone)."""
    with session.lock:
        node = session.book.holds.pop((key, token), None)
        if node is None:
            return ReleaseResult.NOT_OWNER
        session.book.paths.pop(node.path, None)
        current = node.epoch == session.epoch
        connected = session.connected
    if not current:
        return ReleaseResult.NOT_OWNER
    if not connected:
        session.delete_later(node.path)
        return ReleaseResult.RELEASED
    calls = [Call("delete", node.path)]
    if not session.settings.containers:
        # A plain key node goes with its last contender: refused (not empty) while others queue.
        calls.append(Call("delete", node.parent))
        session.parent_gone(node.parent)
    try:
        answer = (yield calls)[0]
    except BackendError:
        session.delete_later(node.path)
        return ReleaseResult.RELEASED
    if isinstance(answer, NoNodeError):
        return ReleaseResult.NOT_OWNER
    return ReleaseResult.RELEASED


def reenter(session: Session, key: str, token: str) -> Plan:
    """Whether ``token`` still holds ``key``: the node is looked at (one round trip; its
    deletion by an operator may not have reached the session's watch yet), and the watch set
    with it if the hold has none yet. While the connection is down or being re-read, and if
    the look fails, the session's own state answers (see the lease estimate)."""
    with session.lock:
        node = session.book.holds.get((key, token))
        if node is None or node.epoch != session.epoch:
            return False
        if not (session.connected and session.verified):
            return True
        watch = None
        if not node.watched:
            node.watched = True
            watch = session.held_watch(node)
    try:
        (stat,) = yield [Call("exists", node.path, watch=watch)]
    except BackendError:
        if watch is not None:
            node.watched = False
        return _booked(session, node)
    if stat is None:
        session.lose_nodes([node], "not-owner")
        return False
    return _booked(session, node)


def _booked(session: Session, node: Node) -> bool:
    with session.lock:
        return session.book.holds.get((node.key, node.token)) is node and node.epoch == session.epoch


def unqueue(session: Session, key: str, waiter: str) -> None:
    """``waiter`` stopped waiting on ``key``: delete its queue place (a multi-key waiter's
    nodes on every key, unless it only moves on to its next key). No waiting."""
    with session.lock:
        book = session.book
        mine = book.multi.get(waiter)
        if mine is not None:
            if mine[-1].key != key:
                return
            del book.multi[waiter]
            nodes = list(mine)
        else:
            node = book.queued.pop((key, waiter), None)
            nodes = [node] if node is not None else []
        for node in nodes:
            book.paths.pop(node.path, None)
    session.forget((key, waiter))
    for node in nodes:
        session.forget((node.key, waiter))
        session.delete_later(node.path)


__all__ += ["NodeExistsError"]
