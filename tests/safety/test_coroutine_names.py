"""The coroutine a decorated ``async def`` returns is named after the user's function.

Before, every such coroutine was ``_decorator.<locals>.decorate.<locals>.async_wrapper``,
so Python's "coroutine ... was never awaited" RuntimeWarning (the usual sign of a missing
``await``, which here also means the lock was never taken) did not say whose call it was.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import warnings
from typing import Any

from lockaspect import LockClient, distributed_lock


def never_awaited_warnings(make: Any) -> list[str]:
    """Create a coroutine with ``make()``, drop it unawaited, and return the RuntimeWarnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        coroutine = make()
        del coroutine
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


class TestCoroutineNames:
    def test_coroutine_is_named_after_the_function(self) -> None:
        @distributed_lock(key="job:<x>")
        async def my_job(x: int) -> int:
            return x

        coroutine = my_job(1)
        try:
            assert coroutine.__name__ == "my_job"
            assert coroutine.__qualname__ == my_job.__qualname__
            assert coroutine.__qualname__.endswith(".<locals>.my_job")
        finally:
            coroutine.close()

    def test_never_awaited_warning_names_the_function(self) -> None:
        """The RuntimeWarning for a forgotten ``await`` names ``my_job``."""

        @distributed_lock(key="job:<x>")
        async def my_job(x: int) -> int:
            return x

        messages = never_awaited_warnings(lambda: my_job(1))
        assert len(messages) == 1, messages
        assert "my_job" in messages[0]
        assert "never awaited" in messages[0]
        assert "async_wrapper" not in messages[0]

    def test_each_decoration_keeps_its_own_name(self) -> None:
        """Two decorated functions (and a method) give coroutines of their own names, not the last one's."""

        @distributed_lock(key="first")
        async def first() -> None:
            return None

        @distributed_lock(key="second")
        async def second() -> None:
            return None

        class Jobs:
            @distributed_lock(key="jobs:<x>")
            async def run(self, x: int) -> int:
                return x

        coroutines = [first(), second(), Jobs().run(1)]
        try:
            assert [c.__name__ for c in coroutines] == ["first", "second", "run"]
            assert coroutines[2].__qualname__.endswith("Jobs.run")
        finally:
            for coroutine in coroutines:
                coroutine.close()
        assert any("Jobs.run" in m for m in never_awaited_warnings(lambda: Jobs().run(2)))

    def test_decorated_function_is_unchanged(self, client: LockClient) -> None:
        """``iscoroutinefunction``, ``__name__``, ``__qualname__``, ``__wrapped__`` and the lock still work."""

        async def my_job(x: int) -> int:
            return x * 2

        decorated = distributed_lock(key="job:<x>", client=client)(my_job)
        assert inspect.iscoroutinefunction(decorated)
        assert decorated.__name__ == "my_job"
        assert decorated.__qualname__ == my_job.__qualname__
        assert decorated.__wrapped__ is my_job  # type: ignore[attr-defined]
        coroutine = decorated(21)
        assert coroutine.__qualname__ == my_job.__qualname__
        assert asyncio.run(coroutine) == 42
