"""Integrations with the user's stack: metrics and tracing observers, web frameworks, task
queues. Each module needs its own extra (``pip install 'lockaspect[prometheus]'``, ...); the
core never imports them."""
