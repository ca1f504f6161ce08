"""The lockaspect error tree.

Every error lockaspect raises derives from :class:`LockError` and carries the lock's
rendered key as ``.key`` (``None`` where no key exists yet, e.g. a template that does not
parse)::

    LockError                      root; .key
    ├── LockNotAcquired            the lock was busy until the wait ran out; .waited
    ├── LockLost                   the lease ended while the call ran; .reason, .lease,
    │                              .result / .exception of the body when it finished
    ├── KeyTemplateError           a key template is malformed (decoration) or cannot be
    │                              rendered for these arguments (call, before any I/O)
    ├── ConfigurationError         bad options, also a ValueError
    └── BackendError               the store failed or could not be reached; chained
                                   (``raise ... from``) to the driver's exception

Kept in a leaf module so that every other module can import it without cycles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .lease import Lease

__all__ = [
    "BackendError",
    "ConfigurationError",
    "KeyTemplateError",
    "LockError",
    "LockLost",
    "LockNotAcquired",
    "NotReplicated",
]


class LockError(Exception):
    """Root of every lockaspect error.

    Every error can be made from its message alone (the other arguments have defaults) and
    pickles with its attributes, so it crosses process boundaries: a process pool, a Celery
    result (with the JSON serializer only the message travels).

    Attributes:
        key: The rendered lock key (without the store namespace), or ``None`` when the
            error happened before a key existed.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        # The keyword-only arguments are not in ``args``: rebuild from the attributes, so an
        # error pickles (a process pool, a Celery result with the pickle serializer).
        return (_rebuild, (type(self), self.args, self._picklable_state()))

    def _picklable_state(self) -> dict[str, Any]:
        return dict(self.__dict__)


class LockNotAcquired(LockError):
    """The lock was held by someone else for the whole wait.

    Attributes:
        waited: Seconds spent waiting (0.0 for a single try).
        holder_ttl: The holder's remaining lease in seconds as last reported by the store,
            or ``None`` if unknown.
    """

    key: str

    def __init__(self, message: str, *, key: str = "", waited: float = 0.0, holder_ttl: float | None = None) -> None:
        super().__init__(message, key=key)
        self.waited = waited
        self.holder_ttl = holder_ttl


_NO_RESULT: Any = object()


class LockLost(LockError):
    """The lease ended before the locked call was done with it.

    Raised by :meth:`Lease.check` once the lease is lost, and by a decorated call or a
    ``with client.lock(...)`` block instead of returning as if the work had been protected.

    Attributes:
        reason: Why the lease is considered lost (``"not-owner"``, ``"expired"``,
            ``"max-hold"``, ...).
        lease: The :class:`~lockaspect.Lease` that was lost, if there was one.
        result: The body's return value when the body finished normally (else ``None``;
            see :attr:`has_result`).
        exception: The exception the body raised, if it raised (the ``LockLost`` is also
            chained to it).
    """

    key: str

    def __init__(
        self,
        message: str,
        *,
        key: str = "",
        reason: str = "",
        lease: Lease | None = None,
        result: Any = _NO_RESULT,
        exception: BaseException | None = None,
    ) -> None:
        super().__init__(message, key=key)
        self.reason = reason
        self.lease = lease
        self.has_result = result is not _NO_RESULT
        self.result = None if result is _NO_RESULT else result
        self.exception = exception

    def _picklable_state(self) -> dict[str, Any]:
        return {**self.__dict__, "lease": None}  # the lease is this process's object


class KeyTemplateError(LockError):
    """A key template cannot be parsed, or cannot be rendered for a call's arguments.

    Parse errors are raised when the decorator is applied; render errors are raised at
    call time before anything is sent to the store, and the body does not run.

    Attributes:
        template: The template text (``None`` for callable keys).
        position: 0-based character offset in the template where the problem is, if known.
        expression: The placeholder expression concerned, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        template: str | None = None,
        position: int | None = None,
        expression: str | None = None,
        key: str | None = None,
    ) -> None:
        super().__init__(message, key=key)
        self.template = template
        self.position = position
        self.expression = expression


class ConfigurationError(LockError, ValueError):
    """An option has a bad value, or no lock client is configured.

    Also a :class:`ValueError`, so code that guards option parsing with ``except
    ValueError`` keeps working.
    """


class BackendError(LockError):
    """The store failed or could not be reached.

    Chained to the driver's exception when there is one (``raise BackendError(...) from
    exc``). The lock state is unknown to the caller; lockaspect has already cleaned up what
    it could.

    Attributes:
        transient: ``True`` for a failure that retrying may cure (a connection refused or
            reset, a timeout: a server restarting, a failover). A waiting acquire retries
            those with backoff until its ``wait`` runs out; other errors (a refused command,
            a permission error) end the wait at once.
    """

    def __init__(self, message: str, *, key: str | None = None, transient: bool = False) -> None:
        super().__init__(message, key=key)
        self.transient = transient


class NotReplicated(BackendError):
    """The lock was taken on the primary, but fewer replicas than the client's
    ``wait_replicas`` confirmed it in time (``WAIT``), so a failover could lose it. The
    lock has been released again; the body did not run.

    Attributes:
        replicas: How many replicas confirmed the lock.
        wanted: How many the client asks for.
    """

    def __init__(self, message: str, *, key: str = "", replicas: int = 0, wanted: int = 0) -> None:
        super().__init__(message, key=key)
        self.replicas = replicas
        self.wanted = wanted


def _rebuild(cls: type[LockError], args: tuple[Any, ...], state: dict[str, Any]) -> LockError:
    """A pickled :class:`LockError` again (see ``LockError.__reduce__``)."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error
