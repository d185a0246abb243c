VENV ?= .venv
PY := $(VENV)/bin/python
JOB ?= jobs/demo.yaml

# pytest-xdist workers for `make test`. One (no xdist) by default: on the 2-core machines CI
# and developers use, two workers overloaded the machine and the tests with fixed startup
# deadlines (actors within 120 s, a shard within 60 s) timed out (docs/testing.md). WORKERS=2
# on a machine with more cores. `make check` starts no Ray, so it always uses two.
WORKERS ?= 1
XDIST = $(if $(filter 1,$(WORKERS)),-p no:xdist,-n $(WORKERS) --dist loadgroup)

.PHONY: setup demo test check lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/specrej-ray run $(JOB)

# Every test; with WORKERS > 1, loadgroup keeps each xdist_group on one worker (tests/conftest.py).
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST)

# The edit loop: lint and the tests that start no Ray cluster, subprocess, vLLM engine,
# trainer or server (not `slow`); aims at 3 minutes, 1 min 19 s measured (docs/testing.md).
check: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) out .pytest_cache
