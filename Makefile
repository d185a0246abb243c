VENV ?= .venv
PY := $(VENV)/bin/python
JOB ?= jobs/demo.yaml

# pytest-xdist workers: two, one a core of the 2-core machines CI and developers use.
WORKERS ?= 2

.PHONY: setup demo test check lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/specrej-ray run $(JOB)

# Every test, on $(WORKERS) workers; loadgroup keeps each xdist_group on one (tests/conftest.py).
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup

# The edit loop: lint and the tests that start no Ray cluster, subprocess, vLLM engine,
# trainer or server (not `slow`); at most 3 minutes (docs/testing.md).
check: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) out .pytest_cache
