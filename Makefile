# One command is the gate: `make test` (lint, types, the whole suite).
VENV   ?= .venv
PYTHON ?= $(shell command -v python3.11 || command -v python3)
BIN    := $(VENV)/bin

.PHONY: install test lint typecheck unit demo bench clean

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

typecheck: install
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/pytest

unit: install
	$(BIN)/pytest tests/unit

demo: install
	$(BIN)/torpor demo

bench: install
	$(BIN)/python bench/bench_storage.py

clean:
	rm -rf $(VENV) .torpor .mypy_cache .ruff_cache .pytest_cache
