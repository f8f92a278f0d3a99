# One command is the gate: `make test` (lint, types, the whole suite).
VENV   ?= .venv
PYTHON ?= $(shell command -v python3.11 || command -v python3)
BIN    := $(VENV)/bin

.PHONY: install test lint typecheck services browser promtool loadgen unit demo bench clean settings-table

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

# The suite talks to a real Redis: start one if none answers (the machine's redis-server).
# REDIS_URL names another one: it must answer (nothing is started for it).
services:
	@if [ -n "$$REDIS_URL" ]; then redis-cli -u "$$REDIS_URL" ping; exit $$?; fi; \
	redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || { \
	  echo "starting redis-server on 127.0.0.1:6379"; \
	  mkdir -p /tmp/torpor-redis; \
	  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
	    --dir /tmp/torpor-redis --logfile /tmp/torpor-redis/redis.log; \
	  for i in $$(seq 1 50); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.2; done; \
	  redis-cli -h 127.0.0.1 -p 6379 ping; }

# The console's browser tests drive Debian's headless Chromium (never Playwright's own).
browser:
	@test -x /usr/bin/chromium || { \
	  echo "installing chromium (apt-get)"; \
	  apt-get install -y chromium >/dev/null 2>&1 || \
	    { apt-get update >/dev/null && apt-get install -y chromium >/dev/null; }; }
	@test -x /usr/bin/chromium

# The ingress bench (run small in the suite, tests/ray/test_benches_with_ray.py) puts
# Serve behind Debian's HAProxy and loads it with wrk; the gateway's profile counts its
# instructions with valgrind's callgrind (tests/storage/test_benches_run.py).
loadgen:
	@command -v haproxy >/dev/null && command -v wrk >/dev/null && command -v valgrind >/dev/null || { \
	  echo "installing haproxy, wrk and valgrind (apt-get)"; \
	  apt-get install -y haproxy wrk valgrind >/dev/null 2>&1 || \
	    { apt-get update >/dev/null && apt-get install -y haproxy wrk valgrind >/dev/null; }; }
	@command -v haproxy >/dev/null && command -v wrk >/dev/null && command -v valgrind >/dev/null

# The alert and recording rules in deploy/prometheus are checked by Prometheus's promtool.
promtool:
	@command -v promtool >/dev/null || { \
	  echo "installing prometheus for promtool (apt-get)"; \
	  apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || \
	    { apt-get update >/dev/null && apt-get install -y --no-install-recommends prometheus >/dev/null; }; }
	@command -v promtool >/dev/null

test: lint typecheck services browser promtool loadgen
	# A crash of the runner itself (at exit, after the summary) prints every thread's stack.
	# The slowest tests are listed after the summary: where the suite's time goes, in
	# every CI log, so a slow hour's overrun can be told from a test that grew.
	PYTHONFAULTHANDLER=1 $(BIN)/pytest --durations=30

# The README's settings table, from the Field descriptions in torpor/settings.py and its
# sections (torpor/settings_*.py).
settings-table: install
	$(BIN)/python -m tests.unit.test_settings_table

unit: install
	$(BIN)/pytest tests/unit

demo: install
	$(BIN)/torpor demo

bench: install services
	$(BIN)/python bench/bench_storage.py
	$(BIN)/python bench/bench_runtime.py
	$(BIN)/python bench/bench_ingress.py

clean:
	rm -rf $(VENV) .torpor .mypy_cache .ruff_cache .pytest_cache
