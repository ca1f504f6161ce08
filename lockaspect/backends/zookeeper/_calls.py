"""The round trips of the ZooKeeper store: :class:`Call`, one ZooKeeper request, and how a
batch of them goes out on kazoo's connection (pipelined: every request of a batch is sent
before the first reply is read; ZooKeeper answers one session's requests in order).

A batch either succeeds as a whole (each call's answer, a kazoo "no node" or "node exists"
error counting as an answer) or fails as a whole with a :class:`~lockaspect.BackendError`
(the connection dropped, the session ended, no reply in time, the caller was interrupted).
A failed batch leaves nothing behind: a contender node it created is deleted once the create
is answered, and a create whose answer was lost is found again by its protected uuid prefix
and deleted after the reconnection (see ``Session.doubt``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kazoo.exceptions import (
    BadVersionError,
    ConnectionClosedError,
    ConnectionLoss,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    OperationTimeoutError,
    SessionExpiredError,
)
from kazoo.protocol.serialization import Create2
from kazoo.security import OPEN_ACL_UNSAFE

from ...errors import BackendError

__all__ = ["ANSWERS", "Call", "CreateContainer", "batch_error", "connection_trouble"]

#: Kazoo errors that are answers about the tree, handed to the plan as values.
ANSWERS = (NoNodeError, NodeExistsError, NotEmptyError, BadVersionError)

#: Kazoo errors that mean the round trip's fate is unknown (a retry may succeed).
_TRANSIENT = (ConnectionLoss, SessionExpiredError, ConnectionClosedError, OperationTimeoutError)


class CreateContainer(Create2):  # type: ignore[misc]
    """ZooKeeper's ``createContainer`` (opcode 19; kazoo has no call for it): the body of a
    CREATE2 with the container flag. The server deletes a container once it had children and
    has none left."""

    type = 19


class Call(NamedTuple):
    """One request: ``op`` is ``create`` (an ephemeral sequential contender, with its stat),
    ``container``, ``persistent``, ``children``, ``exists``, ``get``, ``set``, ``delete``,
    or ``deletes``: one transaction deleting ``paths`` (all or none; its answer lists one
    result per path, errors included); ``watch``: a one-shot watch for ``children``,
    ``exists`` and ``get``; ``version``: the version a ``set`` expects (``-1``: any)."""

    op: str
    path: str
    data: bytes = b""
    watch: Callable[[Any], None] | None = None
    version: int = -1
    paths: tuple[str, ...] = ()


def connection_trouble(exc: BaseException) -> bool:
    """Whether ``exc`` leaves a round trip's fate unknown (not an answer)."""
    return isinstance(exc, _TRANSIENT) or type(exc).__name__ == "KazooTimeoutError"


def batch_error(exc: BaseException, key: str | None, shown: str) -> BackendError:
    """The :class:`BackendError` of a failed batch (transient unless the server refused us)."""
    if isinstance(exc, BackendError):
        return exc
    if isinstance(exc, NoAuthError):
        return BackendError(f"ZooKeeper {shown}: not allowed (ACL): {exc!r}", key=key)
    if connection_trouble(exc) or isinstance(exc, TimeoutError):
        what = (
            "no reply in time" if not isinstance(exc, KazooException) or "Timeout" in type(exc).__name__ else repr(exc)
        )
        return BackendError(f"ZooKeeper {shown}: {what}", key=key, transient=True)
    return BackendError(f"ZooKeeper {shown}: {exc!r}", key=key)


class Answers(list[Any]):
    """A batch's answers, one per call, and the session epoch it was sent in (a node it
    created belongs to that epoch)."""

    epoch: int = -1


class Batch:
    """One batch in flight: its calls, kazoo's async results, when it was sent, and the
    session's epoch then."""

    __slots__ = ("calls", "epoch", "results", "sent")

    def __init__(self, calls: Sequence[Call], results: list[Any], sent: float, epoch: int = -1) -> None:
        self.calls = calls
        self.results = results
        self.sent = sent
        self.epoch = epoch

    def answers(self, values: list[Any]) -> Answers:
        out = Answers(values)
        out.epoch = self.epoch
        return out

    def outcomes(self, timeout: float) -> list[Any]:
        """Each call's answer, waiting (this thread) until ``timeout`` seconds from now.
        Raises the first error that is not an answer."""
        deadline = time.monotonic() + timeout
        if self.results:
            # Replies come in order: once the last is in, so is every other (one wake-up).
            self.results[-1].wait(timeout)
        out: list[Any] = []
        for result in self.results:
            try:
                out.append(result.get(True, max(0.0, deadline - time.monotonic())))
            except ANSWERS as exc:
                out.append(exc)
        return out

    def collected(self) -> list[Any]:
        """Each call's answer once every result is in (no waiting); raises like
        :meth:`outcomes`."""
        out: list[Any] = []
        for result in self.results:
            try:
                out.append(result.get_nowait())
            except ANSWERS as exc:
                out.append(exc)
        return out

    def when_done(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future of ``loop`` that completes once every result is in (one hop to the loop
        for the whole batch, from kazoo's completion thread)."""
        future: asyncio.Future[None] = loop.create_future()
        left = [len(self.results)]
        guard = threading.Lock()

        def settle() -> None:
            if not future.done():
                future.set_result(None)

        def one_done(_: Any) -> None:
            with guard:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    loop.call_soon_threadsafe(settle)
                except RuntimeError:  # the loop closed: nobody awaits this any more
                    pass

        if not self.results:
            settle()
        for result in self.results:
            result.rawlink(one_done)
        return future


def container_request(path: str, data: bytes) -> CreateContainer:
    return CreateContainer(path, data, OPEN_ACL_UNSAFE, 4)
