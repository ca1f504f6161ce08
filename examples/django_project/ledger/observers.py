"""An observer named in ``settings.LOCKASPECT["OBSERVERS"]`` (by dotted path: the app calls
the class to make it). Real projects would use lockaspect.contrib.prometheus or .otel."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, ClassVar


class LockEventCounter:
    """Counts the lock events of this process by name."""

    counts: ClassVar[Counter[str]] = Counter()
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __call__(self, event: Any) -> None:
        with self._lock:
            self.counts[event.name] += 1
