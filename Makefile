# aiayn: `make demo` (the main job) and `make test` (the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt

.PHONY: install demo test lint bench clean

install: $(VENV)/.installed

# torch first, pinned, so that pip never resolves a newer (CUDA) build; then the project.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

demo: install
	$(VENV)/bin/aiayn copy-task

test: install
	$(PY) -m pytest

lint: install
	$(VENV)/bin/ruff check src tests bench

bench: install
	$(PY) bench/model_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
