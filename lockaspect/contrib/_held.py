"""The leases an observer saw acquired and not yet ended, for the ``held`` gauges of
:mod:`lockaspect.contrib.prometheus` and :mod:`lockaspect.contrib.otel`.

A lease ends with its first ``released``, ``release_failed`` or ``lost`` event (a lease lost
and then released ends once). A lease nobody releases (its holder vanished; the watchdog's
sweep releases it without an event) is held weakly and leaves when it is collected, so the
gauges are counted from what is live at a scrape and always return to 0.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["HeldLeases"]

V = TypeVar("V")
K = TypeVar("K", bound=tuple[str, ...])


class HeldLeases(Generic[V, K]):
    """Live leases, each with a value (what an observer remembers of it), counted by the
    value's ``label``."""

    __slots__ = ("_label", "_live", "_lock", "_seen")

    def __init__(self, label: Callable[[V], K]) -> None:
        self._label = label
        self._lock = threading.Lock()
        self._live: weakref.WeakKeyDictionary[Any, V] = weakref.WeakKeyDictionary()
        self._seen: set[K] = set()  # every label a lease had

    def add(self, lease: Any, value: V) -> None:
        with self._lock:
            self._live[lease] = value
            self._seen.add(self._label(value))

    def end(self, lease: Any) -> V | None:
        """Forget ``lease``: its value the first time, ``None`` after (or for one never added)."""
        with self._lock:
            return self._live.pop(lease, None)

    def counts(self) -> dict[K, int]:
        """How many live leases there are per label, with 0 for the labels of leases gone (a
        gauge goes back to 0 rather than vanishing), sorted by label."""
        with self._lock:
            values = list(self._live.values())
            seen = sorted(self._seen)
        label = self._label
        counts = Counter(label(value) for value in values)
        return {key: counts.get(key, 0) for key in seen}
