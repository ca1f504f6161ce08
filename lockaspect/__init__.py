"""lockaspect: distributed locks as a decorator, on Redis and Valkey.

    from lockaspect import LockClient, configure, distributed_lock

    configure(LockClient.from_url("redis://127.0.0.1:6379/0"))

    @distributed_lock(key="order:<user.id>")
    def create_order(user, voucher_id): ...

See the documentation in ``docs/`` for the guarantees (lease, fencing token, lost-lock
signal) and what a lease lock cannot promise.
"""

from ._defaults import KeyTemplateWarning as KeyTemplateWarning
from .aspect import FailureContext as FailureContext
from .aspect import distributed_lock as distributed_lock
from .aspect import distributed_semaphore as distributed_semaphore
from .client import LockClient as LockClient
from .config import configure as configure
from .errors import BackendError as BackendError
from .errors import ConfigurationError as ConfigurationError
from .errors import KeyTemplateError as KeyTemplateError
from .errors import LockError as LockError
from .errors import LockLost as LockLost
from .errors import LockNotAcquired as LockNotAcquired
from .errors import NotReplicated as NotReplicated
from .info import Holder as Holder
from .info import LockInfo as LockInfo
from .keys import register_converter as register_converter
from .keys import register_resolver as register_resolver
from .lease import Lease as Lease
from .lease import MultiLease as MultiLease
from .lease import current_lease as current_lease

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "ConfigurationError",
    "FailureContext",
    "Holder",
    "KeyTemplateError",
    "KeyTemplateWarning",
    "Lease",
    "LockClient",
    "LockError",
    "LockInfo",
    "LockLost",
    "LockNotAcquired",
    "MultiLease",
    "NotReplicated",
    "configure",
    "current_lease",
    "distributed_lock",
    "distributed_semaphore",
    "register_converter",
    "register_resolver",
]
