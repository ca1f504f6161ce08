# Two promises (see README): `make demo` and `make test` work on a fresh machine with Python 3.10+.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test docs lint typecheck unit bench bench-quick bench-core bench-async bench-sql bench-zk bench-cluster bench-scale clean

$(BIN)/python:
	@$(PYTHON) .ci/bootstrap_venv.py $(VENV)

$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[demo]'
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,demo]'
	$(BIN)/python .ci/ensure_postgres.py
	$(BIN)/python .ci/ensure_zookeeper.py
	@touch $@

## demo: create .venv, install, run the flash-sale demo on an embedded server
demo: $(VENV)/.installed-demo
	$(BIN)/lockaspect demo

## test: install the test dependencies (PostgreSQL too), lint, type-check, run the whole suite
# LOCKASPECT_REQUIRE_POSTGRES / _ZOOKEEPER: a missing server fails its tests instead of skipping them.
test: $(VENV)/.installed-test lint typecheck
	LOCKASPECT_REQUIRE_POSTGRES=1 LOCKASPECT_REQUIRE_ZOOKEEPER=1 $(BIN)/python -m pytest

$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	@touch $@

## docs: build the documentation site into site/ (mkdocs-material; strict: any warning, such as a broken link, fails)
docs: $(VENV)/.installed-docs
	$(BIN)/mkdocs build --strict

lint: $(VENV)/.installed-test
	$(BIN)/ruff check lockaspect tests examples bench
	$(BIN)/ruff format --check lockaspect
	$(BIN)/lint-imports

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy --strict lockaspect

## unit: the fast tests only (no server needed)
unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest tests/unit

## bench: every store against its raw floor and its peers, then docs/benchmarks.md and its plots (about 25 minutes)
bench: $(VENV)/.installed-test
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/make_page.py

## bench-quick: the same page from short runs (a few minutes; the page says "quick run: noisy")
bench-quick: $(VENV)/.installed-test
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/make_page.py --quick

## bench-core: the sync Redis benchmark in full (cycles, 5,000 held locks, key rendering) and the lock kinds
bench-core: $(VENV)/.installed-test
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/bench_core.py
	$(BIN)/python bench/bench_kinds.py

## bench-async: asyncio cycles and multi-process contention (about 10 minutes)
bench-async: $(VENV)/.installed-test
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/bench_async.py

## bench-sql: the SQL stores against their raw floors, uncontended and contended (about 3-5 minutes)
bench-sql: $(VENV)/.installed-test
	$(BIN)/python bench/bench_sql.py

## bench-zk: the ZooKeeper store against kazoo's Lock and the raw kazoo floors (about 3-4 minutes)
bench-zk: $(VENV)/.installed-test
	$(BIN)/python bench/bench_zookeeper.py

## bench-cluster: the Redis Cluster store against the raw RedisCluster floor, and its renewal round trips (about 2 minutes)
bench-cluster: $(VENV)/.installed-test
	$(BIN)/python bench/bench_cluster.py

## bench-scale: 50,000 locks held by one thread and 5,000 by asyncio tasks under the watchdog (about 1 minute)
bench-scale: $(VENV)/.installed-test
	$(BIN)/python bench/bench_scale.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache site
