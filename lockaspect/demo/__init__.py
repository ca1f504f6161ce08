"""``lockaspect demo``: a flash sale run by several worker processes on one lock store: a
Redis server (embedded, or ``--url redis://...``) or a SQLite file (``--url sqlite:///...``,
no server at all).

What it shows, with real processes on a real store:

* **One order per user.** Users double-click and retry. ``place_order(user, voucher)`` is
  decorated with ``@distributed_lock(key="order:<user.id>")``; inside the lock a plain
  "has this user ordered?" check turns every duplicate away.
* **No overselling.** The stock is a deliberately naive read-modify-write (``GET``, a
  pause, ``SET``) that would oversell under concurrency; a nested
  ``client.lock("stock:<voucher>")`` makes it safe. "oversold: 0" is earned by the lock,
  not by an atomic ``DECR``. (``--unsafe`` runs the same sale without the locks.)
* **The watchdog.** A report job runs for longer than its lease; the watchdog renews the
  lease while it runs, and a probe from the parent finds the lock still held after the
  first lease would have ended.
* **The lost-lock signal and fencing.** A worker holding ``ledger:<book>`` is frozen with
  SIGSTOP for longer than its lease. Another worker takes the lock (a larger fencing token)
  and writes the ledger through a fence (:class:`~lockaspect.fencing.RedisFence` on Redis,
  on SQLite the fenced ``UPDATE ... WHERE fence <= :token`` of :mod:`lockaspect.fencing`).
  When the frozen worker is continued it tries its own fenced write with its old token:
  rejected. Its lease reports ``lost``, its ``on_lost`` hook runs, and the decorated call
  raises :class:`~lockaspect.LockLost` instead of returning as if it had been protected.

The parent process is the conductor: it hands out work to the workers over one pipe each,
sends the signals, and checks the invariants against the store at the end. Exit status 0
when every invariant holds, 1 otherwise.

The demo is an application of the library: it uses only the public API (``lockaspect``,
``lockaspect.fencing``, ``lockaspect.testing``), and for the shop's own data redis-py or the
standard library's ``sqlite3`` (``data``), in the same store as the locks.
Run it with ``lockaspect demo`` or ``python -m lockaspect demo``. The modules:

* ``scenario``: settings, constants, the users' requests;
* ``data``: the shop's data (stock, orders, customers, the fenced ledger) on Redis or SQLite;
* ``workers``: the worker processes and the shop's decorated functions;
* ``conductor``: :func:`run_demo`, the parent process from start to verdict;
* ``pool``: the parent's side of the workers (state, start, stop);
* ``story``: the parent's event loop (dispatch, messages, SIGSTOP/SIGCONT, the probe);
* ``invariants``: the final table, checked against the store;
* ``report``: the plain and rich reporters.
"""

from __future__ import annotations

from .conductor import DemoOptions, run_demo
from .scenario import MAX_WORKERS, MIN_WORKERS

__all__ = ["MAX_WORKERS", "MIN_WORKERS", "DemoOptions", "run_demo"]
