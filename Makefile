VENV ?= .venv
PY := $(VENV)/bin/python
JOB ?= jobs/demo.yaml

.PHONY: setup demo test lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/specrej-ray run $(JOB)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) out .pytest_cache
