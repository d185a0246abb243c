VENV ?= .venv
# Python and pytest keep their compiled modules (__pycache__, ignored by git) even where the
# environment says not to (some sandboxes and CI images set PYTHONDONTWRITEBYTECODE=1): without
# them every test worker and every CLI subprocess compiles the project and pytest rewrites every
# test module's asserts again (measured: docs/testing-history.md, "Compiled modules").
unexport PYTHONDONTWRITEBYTECODE
PY := $(VENV)/bin/python
JOB ?= jobs/demo.yaml

# pytest-xdist workers for `make test`: two, since the tests' Ray workers are forks of a
# preloaded process (tests/helpers/ray_worker.py) and the suite needs a third less CPU; before,
# two workers overloaded a 2-core machine and tests with fixed startup deadlines timed out
# (docs/testing.md). WORKERS=1 runs it in one process. `make check` always uses two.
WORKERS ?= 2
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
# trainer or server (not `slow`); aims at 90 s (issue 45); measured in docs/testing.md, "Timings".
check: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) out .pytest_cache
