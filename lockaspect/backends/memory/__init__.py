"""The memory store: locks in this process's memory, for one process only.

:class:`MemoryStore` (threads) and its asyncio twin :class:`AsyncMemoryStore` keep every
lock kind (the mutex, the fair lock, semaphores, read-write locks, multi-key locks) in
plain dictionaries under one ``threading.Lock``, with the semantics of the Redis store's
Lua scripts: they **are** the reference semantics of the store protocol
(:mod:`lockaspect.backends.base`), written so that they can be read in one sitting, and
they pass the same contract suite (``tests/contract/``) as the Redis store.

What it is for:

* unit tests of single-process code that uses lockaspect, without a server
  (``LockClient.from_url("memory://")``, or ``LockClient(MemoryStore())``), and tests of
  time with an injectable clock (``MemoryStore(clock=ManualClock())``): leases end when the
  clock says so, evaluated on every operation;
* the engine's own test double: a real store, not a mock;
* a readable statement of what each kind does (:mod:`._state`, :mod:`._kinds`: pure state
  machines, no threads and no clock of their own).

What it is not: shared between processes. Nothing leaves the process, so two processes
each using ``memory://`` never exclude each other, and a forked child forgets what its
parent held (:meth:`MemoryStore.reset_after_fork`). ``memory://<name>`` shares one state
between every store of that name *within* the process (and its async twins); a plain
``memory://`` is private to its store. Named states live as long as the process. Fencing
counters are kept for every key ever locked, as the Redis store keeps its ``…:fence`` keys.

Capabilities: RENEWABLE, BATCH_RENEW, RELEASE_NOTIFY, FENCING and MULTI_KEY, every kind of
:data:`~lockaspect.backends.base.KINDS`; no replicas.
"""

from __future__ import annotations

from .store import AsyncMemoryStore, MemoryStore, open_memory_store

__all__ = ["AsyncMemoryStore", "MemoryStore", "open_memory_store"]
