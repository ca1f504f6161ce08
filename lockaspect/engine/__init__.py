"""The engine: every decision of the lock cycle in :mod:`.core` and :mod:`.waiting` (no I/O,
no clock reads of their own), and two thin runners doing the round trips around them:
:mod:`.sync` for threads and :mod:`.aio` for asyncio, method for method."""
