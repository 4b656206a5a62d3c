# Two entry points for a fresh machine: `make demo` and `make test` (see README).
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: demo test install install-dev bench gpu-check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) -e '.[dev]'
	@touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/ppokit demo

test: install
	$(PY) -m pytest -q

bench: install
	$(PIP) -e '.[bench]'
	$(PY) bench/control.py

# On one GPU, with only torch, transformers and peft installed (bench/gpu_check.py says how to bring the rest)
gpu-check:
	$(PYTHON) bench/gpu_check.py

clean:
	rm -rf $(VENV) runs .pytest_cache
