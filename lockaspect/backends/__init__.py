"""Lock stores. :mod:`lockaspect.backends.base` defines what a store must do;
:mod:`lockaspect.backends.redis` is the Redis/Valkey implementation."""
