# The README's two set-up commands: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv with Python 3.11 (or python3) and installs the package with what it needs.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint clean report-image

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

# The README's pictures, drawn again into docs/images/: the default job's GPUOptReport, and an OOM's picture
# (examples/oom_forensics.py).
report-image: install
	rm -rf build/report-image
	$(VENV)/bin/gpuopt fit --config examples/configs/default.yaml --trainer.logger.init_args.save_dir build/report-image \
		--trainer.enable_progress_bar false
	mkdir -p docs/images
	cp build/report-image/default/run-*/gpuopt_report.png docs/images/gpuopt_report.png
	$(PY) examples/oom_forensics.py build/report-image/oom
	cp build/report-image/oom/oom_3_rank0.png docs/images/oom_example.png

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache
