# Quick start: `make run` trains the default job, `make test` runs the whole suite.
# Every target creates and reuses .venv on its own; torch stays on the CPU wheel (constraints.txt).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip install -q -c constraints.txt

.PHONY: install run lint test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $(STAMP)

run: install
	$(BIN)/scaletrain train

lint: install
	$(BIN)/ruff check src tests benchmarks

test: install lint
	$(BIN)/python -m pytest tests -q -p no:cacheprovider --durations=30

test-fast: install
	$(BIN)/python -m pytest tests -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
