# The README's two set-up commands: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv with Python 3.11 (or python3) and installs the package with what it needs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/gpuopt fit --config examples/configs/default.yaml

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check lightning_gpuopt tests benchmarks examples

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
