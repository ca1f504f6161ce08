"""What the Redis store's twins share, with no I/O: the key layout, how each script call's
keys and arguments are encoded and its reply decoded, and the operation table (:class:`Op`:
one entry per script-level operation, run by each twin's one generic routine).

Key layout for a lock rendered as ``order:42`` in namespace ``lockaspect:``::

    lockaspect:{order:42}            hash {<owner field>: <owner record>, "fence": n}, lease as TTL
    lockaspect:{order:42}:fence      fence counter (INCR per first acquisition, no TTL)
    lockaspect:{order:42}:waiters    FIFO list of waiter ids (one per waiting notifier)
    lockaspect:{order:42}:wake:<id>  pub/sub channel of one waiter; a release wakes the first
    lockaspect:{order:42}:fair…      the fair lock's queue (see acquire.lua)
    lockaspect:{order:42}:sem…       a semaphore's holders, permits, fences (and owner
                                     records), weights, waiters
    lockaspect:{order:42}:rw:…       a read-write lock's writer, readers, fences (and owner
                                     records), waiters

An owner's field is its token as it is, except that the token ``fence`` and tokens starting
with ``#`` are stored with a ``#`` in front (``fence`` -> ``#fence``, ``#x`` -> ``##x``; see
``owner_field`` in lua/lib.lua). No token's field is ``fence``, so no caller can pass for an
owner of the fencing token, whatever token it sends; a read-write lock's writer hash
(``…:rw:w``) stores its owner the same way. A value of another type at a lock's key (not
written by lockaspect) counts as another owner's: busy, and never ours to renew or release.

An owner field's value is the owner record sent with the acquisition
(``AcquireRequest.owner``), or ``1`` for none (as every hold written before records were
kept): it shares the hold's TTL and goes with it. Semaphore holders and readers keep theirs
with their fencing tokens (``…:sem:fences``, ``…:rw:fences``: ``"<fence> <record>"``), and a
semaphore the weights of its holders of more than one permit in ``…:sem:weights``, with the
holders' TTL (see sem_acquire.lua).

All of them share the hash tag ``{order:42}``, so Redis Cluster keeps them in one slot.
Rendered keys never contain ``{`` or ``}`` (values are percent-encoded, templates may not
contain them), so the tag cannot be broken from outside.

The fence counter outlives the lock on purpose: a fencing token must exceed every token
issued before for that key, also after the lock expired. That costs one small key per
distinct lock name ever used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ..._policy import FAIR_GONE_AFTER, FAIR_SUBSCRIBE_GRACE
from ...errors import ConfigurationError
from ..base import AcquireRequest, AcquireResult, Capability, ReleaseResult, new_waiter_id
from ._script import LuaScript
from ._wire import _Undo

__all__ = ["SCRIPTS", "Op"]

T = TypeVar("T")

#: A script call's keys and arguments, in the wire's bytes.
Encoded = tuple[tuple[bytes, ...], tuple[bytes, ...]]


def _ms(seconds: float) -> int:
    """Seconds as whole milliseconds, rounded UP (less a float's noise: 0.3 s is 300 ms): the
    store's lease must never end before the client's local estimate of it."""
    return max(1, math.ceil(seconds * 1000 - 1e-6))


_FAIR_GONE_MS = b"%d" % _ms(FAIR_GONE_AFTER)
_FAIR_GRACE_MS = b"%d" % _ms(FAIR_SUBSCRIBE_GRACE)

#: Every script a store runs (loaded per instance; see :class:`_Layout`).
SCRIPTS = (
    "acquire.lua",
    "reenter.lua",
    "release.lua",
    "renew.lua",
    "unqueue.lua",
    "sem_acquire.lua",
    "sem_release.lua",
    "sem_renew.lua",
    "sem_reenter.lua",
    "sem_set.lua",
    "rw_acquire.lua",
    "rw_release.lua",
    "rw_held.lua",
    "multi_acquire.lua",
    "multi_release.lua",
    "describe.lua",
    "force_release.lua",
    "held.lua",
)


class _Layout:
    """The namespace, the scripts (per instance: each keeps its own pre-packed heads), the key
    layout, and the encoders and undo builders the operation table names. No I/O."""

    capabilities = (
        Capability.RENEWABLE
        | Capability.BATCH_RENEW
        | Capability.RELEASE_NOTIFY
        | Capability.FENCING
        | Capability.MULTI_KEY
        | Capability.REPLICAS
        | Capability.FAIR_HANDOFF
    )
    kinds = frozenset({"lock", "fair", "semaphore", "read", "write"})
    #: Redis Cluster: the hash slot of a user key (all its store keys share it), by which
    #: renewals are grouped; ``None`` on a single server.
    slot_of: Callable[[str], int] | None = None

    @staticmethod
    def waiter_id(listens: bool) -> str:
        """A fresh waiter id (see :func:`~lockaspect.backends.base.new_waiter_id`)."""
        return new_waiter_id(listens)

    def __init__(self, namespace: str, *, sharded: bool = False) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError(f"namespace must not contain '{{' or '}}': {namespace!r}")
        self.namespace = namespace
        #: ``WAIT numreplicas timeout`` sent behind each acquire attempt, or ``None``.
        self._wait_command: tuple[bytes, ...] | None = None
        #: The scripts by file name, as the operation table names them.
        self._scripts = {name: LuaScript(name, sharded=sharded) for name in SCRIPTS}
        # The scripts the hot path, the undo builders and the renewals use by attribute.
        self._acquire = self._scripts["acquire.lua"]
        self._release = self._scripts["release.lua"]
        self._renew = self._scripts["renew.lua"]
        self._sem_renew = self._scripts["sem_renew.lua"]
        self._sem_release = self._scripts["sem_release.lua"]
        self._rw_release = self._scripts["rw_release.lua"]
        self._multi_release = self._scripts["multi_release.lua"]

    # -- the key layout --

    def lock_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}"

    def fence_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}:fence"

    def queue_key(self, key: str) -> str:
        return f"{self.namespace}{{{key}}}:waiters"

    def wake_channel(self, key: str, waiter: str) -> str:
        """The channel on which a release wakes ``waiter`` (see release.lua)."""
        return f"{self.namespace}{{{key}}}:wake:{waiter}"

    def semaphore_key(self, key: str) -> str:
        """A semaphore's holders: a sorted set of owner tokens by permit expiry (see
        sem_acquire.lua); ``…:permits``, ``…:fences`` and ``…:waiters`` sit next to it."""
        return f"{self.namespace}{{{key}}}:sem"

    def fair_queue_key(self, key: str) -> str:
        """The fair lock's waiter queue, in arrival order (see acquire.lua)."""
        return f"{self.namespace}{{{key}}}:fair"

    def rw_keys(self, key: str) -> dict[str, str]:
        """The store keys of read-write lock ``key``, by role (see rw_acquire.lua)."""
        base = f"{self.namespace}{{{key}}}:rw"
        return {
            "writer": base + ":w",
            "readers": base + ":r",
            "fences": base + ":fences",
            "waiting writers": base + ":wq",
            "waiters": base + ":waiters",
        }

    def _lock(self, key: str) -> bytes:
        return f"{self.namespace}{{{key}}}".encode()

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        """Send ``WAIT replicas timeout`` behind every acquire attempt, in the same write and
        on the same connection, and report in :attr:`AcquireResult.replicas` how many
        replicas confirmed an acquisition (the core decides what too few means). The timeout
        must be shorter than the connections' socket timeout (``WAIT`` blocks the read)."""
        socket_timeout = self._socket_timeout()
        if socket_timeout is not None and timeout >= socket_timeout:
            raise ConfigurationError(
                f"wait_replicas: the timeout ({timeout:g}s) must be shorter than the socket timeout "
                f"({socket_timeout:g}s), or the WAIT reply would time out the connection"
            )
        self._wait_command = (b"WAIT", b"%d" % replicas, b"%d" % _ms(timeout))

    def _socket_timeout(self) -> float | None:
        """The socket timeout of the store's connections (``None``: none, or not known)."""
        redis_client: Any = getattr(self, "redis", None)
        options = getattr(getattr(redis_client, "connection_pool", None), "connection_kwargs", {})
        timeout = options.get("socket_timeout")
        return None if timeout is None else float(timeout)

    # -- locks and fair locks (the hot path's two are static, on the lock's key in bytes) --

    @staticmethod
    def _acquire_request(
        lock: bytes, token: str, lease: float, waiter: str | None, front: bool, fair: bool, owner: str = ""
    ) -> Encoded:
        head = (token.encode(), b"%d" % _ms(lease), owner.encode())
        if fair:
            # Without a waiter id ("": a try-once call) the attempt is still fair, but queues nothing.
            fair_keys = (lock, lock + b":fence", lock + b":fair", lock + b":fair:seen", lock + b":fair:grant")
            return fair_keys, (*head, (waiter or "").encode(), b"fair", _FAIR_GONE_MS)
        keys = (lock, lock + b":fence", lock + b":waiters")
        if waiter is None:
            return keys, head
        return keys, (*head, waiter.encode(), b"front" if front else b"back")

    @staticmethod
    def _release_request(lock: bytes, token: str, fair: bool) -> Encoded:
        if fair:
            return (lock, lock + b":fair", lock + b":fair:seen", lock + b":fence", lock + b":fair:grant"), (
                token.encode(),
                b"fair",
                _FAIR_GONE_MS,
                _FAIR_GRACE_MS,
            )
        return (lock, lock + b":waiters"), (token.encode(),)

    def _lock_acquire_request(
        self, key: str, token: str, lease: float, waiter: str | None, front: bool, fair: bool, owner: str = ""
    ) -> Encoded:
        return self._acquire_request(self._lock(key), token, lease, waiter, front, fair, owner)

    def _lock_release_request(self, key: str, token: str, fair: bool) -> Encoded:
        return self._release_request(self._lock(key), token, fair)

    def _reenter_request(self, key: str, token: str) -> Encoded:
        return (self._lock(key),), (token.encode(),)

    def _multi_request(
        self, keys: Sequence[str], token: str, lease: float, waiter: str | None, owner: str = ""
    ) -> Encoded:
        packed: list[bytes] = []
        for key in keys:
            lock = self._lock(key)
            packed += (lock, lock + b":fence", lock + b":waiters")
        return tuple(packed), (token.encode(), b"%d" % _ms(lease), (waiter or "").encode(), owner.encode())

    def _multi_release_request(self, keys: Sequence[str], token: str) -> Encoded:
        packed: list[bytes] = []
        for key in keys:
            lock = self._lock(key)
            packed += (lock, lock + b":waiters")
        return tuple(packed), (token.encode(),)

    def _unqueue_request(self, key: str, waiter: str, kind: str) -> Encoded:
        lock = self._lock(key)
        if kind == "semaphore":
            return (lock + b":sem:waiters",), (waiter.encode(),)
        if kind in ("read", "write"):
            return (lock + b":rw:waiters", lock + b":rw:wq", lock + b":rw:w"), (waiter.encode(), b"zset", lock)
        if kind == "fair":
            return (lock + b":fair", lock + b":fair:seen", lock + b":fair:grant"), (waiter.encode(), b"hash")
        return (lock + b":waiters",), (waiter.encode(),)

    # -- semaphores --

    def _sem_acquire_request(
        self,
        key: str,
        token: str,
        lease: float,
        permits: int,
        waiter: str | None,
        front: bool,
        owner: str = "",
        weight: int = 1,
    ) -> Encoded:
        lock = self._lock(key)
        sem = lock + b":sem"
        keys = (sem, sem + b":permits", lock + b":fence", sem + b":waiters", sem + b":fences")
        args = (token.encode(), b"%d" % _ms(lease), b"%d" % permits, (waiter or "").encode())
        more = (b"front" if front else b"back", owner.encode(), b"%d" % weight)
        return (*keys, sem + b":weights"), (*args, *more)

    def _sem_release_request(self, key: str, token: str) -> Encoded:
        lock = self._lock(key)
        sem = lock + b":sem"
        return (sem, sem + b":fences", sem + b":waiters", sem + b":weights"), (token.encode(), lock)

    def _sem_reenter_request(self, key: str, token: str) -> Encoded:
        return (self._lock(key) + b":sem",), (token.encode(),)

    def _sem_set_request(self, key: str, permits: int | None) -> Encoded:
        lock = self._lock(key)
        sem = lock + b":sem"
        new = b"" if permits is None else b"%d" % permits
        return (sem, sem + b":permits", sem + b":waiters", sem + b":weights"), (new, lock)

    # -- read-write locks --

    def _rw_acquire_request(
        self, key: str, token: str, lease: float, mode: str, waiter: str | None, below: str, owner: str = ""
    ) -> Encoded:
        lock = self._lock(key)
        rw = lock + b":rw"
        keys = (rw + b":w", rw + b":r", rw + b":fences", rw + b":wq", rw + b":waiters", lock + b":fence")
        args = (token.encode(), b"%d" % _ms(lease), mode.encode(), (waiter or "").encode(), _FAIR_GONE_MS)
        return keys, (*args, below.encode(), owner.encode())

    def _rw_release_request(self, key: str, token: str, mode: str) -> Encoded:
        lock = self._lock(key)
        rw = lock + b":rw"
        return (rw + b":w", rw + b":r", rw + b":fences", rw + b":waiters"), (token.encode(), mode.encode(), lock)

    def _rw_held_request(self, key: str, token: str, mode: str) -> Encoded:
        rw = self._lock(key) + b":rw"
        return (rw + b":w", rw + b":r"), (token.encode(), mode.encode())

    # -- undo: what gives back an acquire attempt that failed after it was sent. Each takes
    # the acquisition's own parameters; EVAL with the whole text: an undo cannot meet
    # NOSCRIPT and retry. --

    def _acquire_undo(self, lock: bytes, token: str, fair: bool) -> _Undo:
        return lambda: [self._release.eval_command(*self._release_request(lock, token, fair))]

    def _lock_undo(
        self, key: str, token: str, lease: float, waiter: str | None, front: bool, fair: bool, *_: object
    ) -> _Undo:
        return _LockUndo(self, key, token, fair)

    def _multi_undo(self, keys: Sequence[str], token: str, *_: object) -> _Undo:
        return lambda: [self._multi_release.eval_command(*self._multi_release_request(keys, token))]

    def _sem_undo(self, key: str, token: str, *_: object) -> _Undo:
        return lambda: [self._sem_release.eval_command(*self._sem_release_request(key, token))]

    def _rw_undo(self, key: str, token: str, lease: float, mode: str, *_: object) -> _Undo:
        return lambda: [self._rw_release.eval_command(*self._rw_release_request(key, token, mode))]


# -- replies --


def _acquired(reply: int, key: object = None) -> AcquireResult:
    if reply > 0:
        return AcquireResult(True, reply)
    return AcquireResult(False, holder_ttl=(-reply - 1) / 1000.0 if reply < 0 else None)


def _sem_acquired(reply: list[int], key: object = None) -> AcquireResult:
    """A semaphore's or read-write lock's answer: ``{1, fence}``, ``{0, ms}``, ``{-1, n}``."""
    status, value = int(reply[0]), int(reply[1])
    if status == 1:
        return AcquireResult(True, value)
    if status == 0:
        # -1: nothing will free up by itself (a foreign value without expiry, no permits)
        return AcquireResult(False, holder_ttl=None if value < 0 else value / 1000.0)
    return AcquireResult(False, permits=value)


def _multi_acquired(reply: list[int], keys: Sequence[str]) -> AcquireResult:
    if int(reply[0]) == 1:
        fences = tuple(int(fence) for fence in reply[1:])
        return AcquireResult(True, fences[0], fencing_tokens=fences)
    ttl = int(reply[2])
    return AcquireResult(False, holder_ttl=None if ttl < 0 else ttl / 1000.0, busy=keys[int(reply[1]) - 1])


def _replicated(result: T, acked: Any) -> T:
    """``result`` with the replicas that confirmed it (an acquisition followed by ``WAIT``)."""
    if isinstance(result, AcquireResult) and result.acquired:
        replicated: Any = result._replace(replicas=int(acked))
        return replicated  # type: ignore[no-any-return]
    return result


_RELEASE_CODES = {code.value: code for code in ReleaseResult}


def _released(reply: int, key: object = None) -> ReleaseResult:
    return _RELEASE_CODES[reply]


def _multi_released(reply: list[int], key: object = None) -> list[ReleaseResult]:
    return [_RELEASE_CODES[int(code)] for code in reply]


def _held(reply: int, key: object = None) -> bool:
    return bool(reply > 0)


def _sem_state(reply: list[int], key: object = None) -> tuple[int | None, int]:
    permits = int(reply[0])
    return (None if permits < 0 else permits), int(reply[1])


def _nothing(reply: object, key: object = None) -> None:
    return None


# -- the operation table --


class _LockUndo:
    """:meth:`_Layout._lock_undo`'s undo, made for every lock attempt and used only if it
    fails: a slotted object (64 bytes), not a closure over an encoded key (some 380 bytes, held
    by every attempt in flight: thousands at once when as many tasks start together)."""

    __slots__ = ("fair", "key", "store", "token")

    def __init__(self, store: _Layout, key: str, token: str, fair: bool) -> None:
        self.store = store
        self.key = key
        self.token = token
        self.fair = fair

    def __call__(self) -> list[tuple[object, ...]]:
        return self.store._acquire_undo(self.store._lock(self.key), self.token, self.fair)()


class Op(Generic[T]):
    """One script-level operation as a table entry: which script, how the method's parameters
    become its keys and arguments (``encode(store, key, *params)``), how its reply becomes the
    result (``decode(reply, key)``), the action an error names, and for an acquisition what
    undoes it (``undo(store, key, *params)``: written behind a failed attempt, and followed by
    ``WAIT`` when the store waits for replicas). Each twin runs every entry through one
    routine (``_op``); adding an operation is one entry and one one-line method per twin."""

    __slots__ = ("action", "decode", "encode", "script", "undo")

    def __init__(
        self,
        script: str,
        encode: Callable[..., Encoded],
        decode: Callable[[Any, Any], T],
        action: str,
        undo: Callable[..., _Undo] | None = None,
    ) -> None:
        self.script = script
        self.encode = encode
        self.decode = decode
        self.action = action
        self.undo = undo


L = _Layout
LOCK_ACQUIRE = Op("acquire.lua", L._lock_acquire_request, _acquired, "acquire", L._lock_undo)
LOCK_RELEASE = Op("release.lua", L._lock_release_request, _released, "release")
LOCK_REENTER = Op("reenter.lua", L._reenter_request, _held, "re-enter")
MULTI_ACQUIRE = Op("multi_acquire.lua", L._multi_request, _multi_acquired, "acquire", L._multi_undo)
MULTI_RELEASE = Op("multi_release.lua", L._multi_release_request, _multi_released, "release")
UNQUEUE = Op("unqueue.lua", L._unqueue_request, _nothing, "unqueue")
SEM_ACQUIRE = Op("sem_acquire.lua", L._sem_acquire_request, _sem_acquired, "acquire", L._sem_undo)
SEM_RELEASE = Op("sem_release.lua", L._sem_release_request, _released, "release")
SEM_REENTER = Op("sem_reenter.lua", L._sem_reenter_request, _held, "re-enter")
SEM_SET = Op("sem_set.lua", L._sem_set_request, _sem_state, "set_permits")
SEM_PERMITS = Op("sem_set.lua", L._sem_set_request, _sem_state, "permits")
RW_ACQUIRE = Op("rw_acquire.lua", L._rw_acquire_request, _sem_acquired, "acquire", L._rw_undo)
RW_RELEASE = Op("rw_release.lua", L._rw_release_request, _released, "release")
RW_HELD = Op("rw_held.lua", L._rw_held_request, _held, "re-enter")
del L

# Which script-level call serves each kind of the generic protocol (the same names on both
# twins; on the async twin each returns a coroutine).
_ACQUIRE: dict[str, Callable[[Any, AcquireRequest], Any]] = {
    "lock": lambda s, r: (
        s.lock_acquire(r.keys[0], r.token, r.lease, r.waiter, r.front, False, r.owner)
        if len(r.keys) == 1
        else s.multi_acquire(r.keys, r.token, r.lease, r.waiter, r.owner)
    ),
    "fair": lambda s, r: s.lock_acquire(r.keys[0], r.token, r.lease, r.waiter, False, True, r.owner),
    "semaphore": lambda s, r: s.sem_acquire(
        r.keys[0], r.token, r.lease, r.permits, r.waiter, r.front, r.owner, r.weight
    ),
    "read": lambda s, r: s.rw_acquire(r.keys[0], r.token, r.lease, "read", r.waiter, r.below, r.owner),
    "write": lambda s, r: s.rw_acquire(r.keys[0], r.token, r.lease, "write", r.waiter, r.below, r.owner),
}
_RELEASE: dict[str, Callable[[Any, str, str], Any]] = {
    "lock": lambda s, key, token: s.lock_release(key, token),
    "fair": lambda s, key, token: s.lock_release(key, token, True),
    "semaphore": lambda s, key, token: s.sem_release(key, token),
    "read": lambda s, key, token: s.rw_release(key, token, "read"),
    "write": lambda s, key, token: s.rw_release(key, token, "write"),
}
_REENTER: dict[str, Callable[[Any, str, str], Any]] = {
    "lock": lambda s, key, token: s.lock_reenter(key, token),
    "fair": lambda s, key, token: s.lock_reenter(key, token),
    "semaphore": lambda s, key, token: s.sem_reenter(key, token),
    "read": lambda s, key, token: s.rw_held(key, token, "read"),
    "write": lambda s, key, token: s.rw_held(key, token, "write"),
}
