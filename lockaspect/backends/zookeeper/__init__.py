"""``zookeeper://``: locks held as ephemeral sequential nodes in ZooKeeper, through kazoo.

Open it with ``LockClient.from_url("zookeeper://zk1:2181,zk2:2181,zk3:2181/chroot")`` or
:func:`open_zookeeper_store` (extra ``lockaspect[zookeeper]``). Options (in the query string
or as keywords): ``session_timeout`` (seconds, default 10), ``connect_timeout`` (default 10),
``request_timeout`` (default: the session timeout), ``owner_info`` (default true).
``user:password@`` adds digest authentication. One ZooKeeper session per client; every lock
of the client lives in it.

**How a lock is taken.** Each key is a container node under the namespace's node
(``/lockaspect/<key>``); a contender creates an ephemeral sequential node under it
(``_c_<uuid>-lock-<seq>``, with ``read``/``write``/``sem.<permits>`` for the other kinds, and
as data a JSON object with the hold's token and owner record) and lists the queue, in one
pipelined round trip. The lowest holds the lock (readers: no earlier writer; a semaphore:
the permits taken ahead and its own fit in ``permits``, a hold of several permits being one
node ``sem.<permits>w<count>``). Otherwise a waiter watches only its predecessor (no herd)
and is woken when it goes; a try (``wait=0``) deletes its node at once. Waiters are served in
order: every kind is fair.

**Operating it.** ``describe`` lists every holder (token, owner record, fencing token,
permits taken) from one read of the queue and one pipelined read of the holders' nodes;
``force_release`` deletes every node of the key, holders' and waiters' (the waiters queue
again); ``add_permits`` changes the permits stored on the key's node with a versioned write.

**What it guarantees.**

* Mutual exclusion decided by the ensemble (a quorum write per contender).
* Fencing tokens: the contender node's creation zxid (64 bits, ordered across the ensemble),
  strictly increasing per key, never the 32-bit sequence suffix (which wraps; the queue's
  order survives the wrap).
* No orphan nodes: a create whose reply was lost is found again by its ``_c_<uuid>-`` prefix
  and deleted; a release whose reply was lost is retried until the node is gone (Curator's
  guaranteed delete); a cancelled or timed-out waiter deletes its node.
* No parent leaks: parents are container nodes, which the server removes after their last
  child (at its ``znode.container.checkIntervalMs``, 60 s by default).
* The lost-lock signal from the session (see :mod:`._session` for the lease estimate): a
  session the server expired (LOST) loses every lock of the client at once; a connection
  suspended past ``last contact + session timeout`` loses them at that moment, without
  waiting for the server; a held node deleted by an operator loses that lock at once. Each
  sets the lease's flag, runs ``on_lost``, raises ``LockLost`` at the block's end and
  cancels an async body.

**What it cannot do.**

* A fixed lease (``lease=5``) does not end a hold: the node lives as long as the session.
  The lease is flagged lost at its end, others get the lock when the holder releases it or
  its session ends.
* A frozen holder (SIGSTOP, a VM pause) keeps its locks until the server expires its session
  (the session timeout after its last heartbeat); a holder that crashed frees them the same
  way (a clean exit frees them at once).
* ``wait_replicas`` is refused: every write is acknowledged by a quorum already.
"""

from __future__ import annotations

from typing import Any

from ._options import parse_settings
from .store import AsyncZooKeeperStore, ZooKeeperStore

__all__ = ["AsyncZooKeeperStore", "ZooKeeperStore", "open_zookeeper_store"]


def open_zookeeper_store(url: str, *, namespace: str = "lockaspect:", **options: Any) -> ZooKeeperStore:
    """The store factory of ``zookeeper://`` URLs (no I/O: the session starts on first use).

    Raises:
        TypeError: ``url`` is not a ``str``.
        ConfigurationError: a malformed URL or an unknown option (the password redacted).
    """
    return ZooKeeperStore(parse_settings(url, namespace, options))
