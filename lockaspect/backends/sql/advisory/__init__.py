"""``postgresql://`` (and ``postgres://``): locks held as PostgreSQL session advisory locks.

Open it with ``LockClient.from_url("postgresql://user:pw@host:5432/db")`` (any libpq URL:
``postgresql:///db?host=/var/run/postgresql`` for a unix socket) or
:func:`open_postgres_store`. Options: ``pool_size`` (holder connections, default 4),
``max_waiters`` (connections blocked in the server's queue at once, default 64),
``connect_timeout`` (seconds, default 10), ``create_schema`` (default ``True``),
``idle_session_timeout`` (seconds, default 60; 0: off), ``application_name``.

**Keys.** A lock key becomes ``advisory_key(namespace + key)`` (:mod:`.._keys`: the first 8
bytes of its SHA-256, a stable format); a semaphore's slot ``i`` is
``advisory_key(namespace + key + ":slot:" + i)``. Two keys share an advisory key with
probability 2**-64 per pair: astronomically unlikely, and then they only exclude each other.
Each acquisition records the full key, kind, fencing token, backend pid, lease, owner token
and owner record in ``lockaspect_advisory`` (one row per advisory key; a reader's token and
record in ``lockaspect_advisory_reader``), in the acquiring statement itself, for
:meth:`describe` and :meth:`held_keys` (joined with ``pg_locks``).

**What it guarantees.**

* Mutual exclusion among clients of one database, decided by the server; the owners of one
  client (threads, tasks) are kept apart by the client first (a session never conflicts with
  itself).
* Fencing tokens from one sequence, ``lockaspect_fence``, drawn in the acquiring statement:
  strictly increasing for every key (and across keys), also across the transaction-scoped
  helper, which uses the same sequence and key hash. Created by ``create_schema=True``; with
  ``create_schema=False`` and no schema, a :class:`~lockaspect.ConfigurationError` names the
  statements to run.
* FIFO waiting with no polling: a waiter queues in the server's own lock queue (a blocking
  ``pg_advisory_lock`` on a connection of its own) and keeps that place across the engine's
  rechecks; a release hands the lock to the head of that queue (the waiter claims it with its
  next attempt; nobody else may take it). A waiter that gives up, is cancelled or times out
  leaves the queue at once (the blocking statement is cancelled server-side; a lock granted
  meanwhile is unlocked). A waiter that vanishes without leaving loses a granted lock after
  :data:`~._state.GONE_AFTER` seconds.
* Liveness is the session (``SESSION_BOUND``): each lock is pinned to the connection that
  took it, and released there. The watchdog's renewal probes each holder connection once
  (``pg_locks`` of ``pg_backend_pid()``); a failed probe, a terminated backend
  (``pg_terminate_backend``, a server restart) or an unlock that returns false marks every
  lease on that connection lost: ``on_lost`` runs, the block raises
  :class:`~lockaspect.LockLost`, an async body is cancelled. New locks then use new
  connections.
* A crashed holder's locks free at once (the server sees the socket close). A frozen holder
  (SIGSTOP, a hung host) keeps them until ``idle_session_timeout`` ends its session (PG >= 14;
  not set on older servers): keep it above the watchdog's renewal interval
  (``delay_weight * watchdog_lease`` + a tick) and expect the server to free a frozen
  holder's locks at most that long after its last probe. Its local lease is flagged lost at
  the lease end, before the server frees the lock. A lease at or above
  ``idle_session_timeout`` is refused (:class:`~lockaspect.ConfigurationError`).

**What it cannot do.**

* A fixed lease (``lease=5``) does not end a hold by itself: the server keeps the lock while
  the session lives. The holder's lease is flagged lost at its end (and the block raises
  ``LockLost``), but others get the lock only when the holder releases it or its session
  ends. There is no ``RENEWABLE`` lease.
* Transaction poolers (PgBouncer in transaction mode) break session locks: statements run on
  other backends. Detected, not prevented: a probe that sees another backend pid, or an unlock
  that returns false, marks the session's leases lost and logs why. Use a direct connection
  or session pooling (or the transaction-scoped helper).
* ``force_release`` terminates the holding sessions (PostgreSQL cannot unlock another
  session's lock): every lock on those sessions is freed, not only that key's.
* Advisory locks live in the primary's memory: a failover loses them (and ``wait_for_replicas``
  is refused). After a crash or failover to an asynchronous replica, the sequence could repeat
  values (PostgreSQL WAL-logs sequences ahead, and a ``nextval`` commit is not flushed).

**Differences from the memory store's semantics.**

* A read-write lock and a plain lock of one name share the advisory key: a write lock and a
  plain lock exclude each other, and a read lock excludes a plain lock (the memory store keeps
  them apart). A plain key named ``x:slot:0`` shares semaphore ``x``'s slot 0.
* ``fair`` and ``lock`` are the same here: the server serves waiters in order for both. A
  waiting writer keeps new readers out (the server queues them behind it).
* A semaphore's waiter queues on one slot (picked at random) and retries every slot at each
  recheck: not FIFO. A hold of several permits takes that many slots at once, all or none;
  its waiter polls (a slot held while waiting for the others would hold back permits). Its
  number of permits is stored in ``lockaspect_semaphore``; a request with another number is
  refused (``AcquireResult.permits``), as in the memory store.
* A busy answer's ``holder_ttl`` is the lease asked for (a session lock has no expiry to
  report). ``describe`` reports the holder's lease as ``remaining``.
* A waiter beyond ``max_waiters`` (no connection to spare) polls instead of queueing.
"""

from __future__ import annotations

from typing import Any

from ._options import parse_settings
from .store import PostgresAdvisoryStore

__all__ = ["PostgresAdvisoryStore", "open_postgres_store"]


def open_postgres_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> PostgresAdvisoryStore:
    """The store factory of ``postgresql://`` and ``postgres://`` URLs (no I/O: connections
    open on first use, and the first checks, or creates, the schema).

    Raises:
        TypeError: ``url`` is not a ``str``.
        ConfigurationError: a malformed URL or an unknown option (the password redacted).
    """
    return PostgresAdvisoryStore(parse_settings(url, namespace, options))
