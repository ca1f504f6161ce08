"""SQL lock stores: the lease table (``sqlite://``, ``postgresql+table://``) and PostgreSQL
advisory locks (``postgresql://``). See ``docs/stores/sql.md`` for which to choose."""
