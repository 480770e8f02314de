# The two commands a reader needs: `make book` and `make test`. Everything installs into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch for a machine without an NVIDIA GPU. On this project's CI machines pip finds the CPU
# build of 2.13.0 locally; elsewhere add the PyTorch CPU wheel index through PIP_EXTRA_INDEX_URL.
TORCH_CPU ?= torch==2.13.0
NPROC := $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup test test-fast lint book execute exercises lab bench gpu-check clean help

help:
	@echo "make test   install everything into $(VENV), then run ruff, the tests and every notebook once"
	@echo "make test-fast  the tests not marked slow (no notebooks, processes, compiles or servers)"
	@echo "make book   render the book into _build/html from the committed notebook outputs"
	@echo "make execute      re-run every chapter and solution here and save their outputs"
	@echo "make exercises    regenerate exercises/ from solutions/"
	@echo "make bench  run the generation benchmark (minillm vs transformers, cache vs recompute)"
	@echo "make lab    install and open JupyterLab"
	@echo "make gpu-check  on a CUDA machine: kernel correctness and speed -> minillm/results/<gpu>/gpu_check.json"

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install torch; \
	  else $(PIP) install "$(TORCH_CPU)"; fi; \
	fi
	$(PIP) install -r requirements-dev.txt
	$(PIP) install --no-deps -e .
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check minillm tests chapters solutions

# The chapters run under nbval from an installed wheel (conftest.py), the solutions in-process
# (tests/book/test_exercises.py). Work is shared out file by file: a notebook's cells share one
# kernel, a test module's tests its module fixtures. The slowest 25 are printed.
PYTEST := MINILLM_THREADS=1 $(PY) -m pytest -n $(NPROC) --dist loadfile -q --durations=25
test: lint
	$(PYTEST) chapters tests --nbval-lax

test-fast: setup
	$(PYTEST) -m "not slow" tests

bench: setup
	$(PY) -m minillm bench generate

gpu-check: setup
	$(PY) -m minillm.bench.gpu

book: setup
	@$(PY) -m minillm.book.links --check
	$(VENV)/bin/jupyter-book build . --warningiserror --keep-going

execute: setup
	$(PY) -m minillm.book.exercises --execute chapters/*.ipynb solutions/*.ipynb

exercises: setup
	$(PY) -m minillm.book.exercises solutions exercises

lab: setup
	$(PY) -c "import jupyterlab" 2>/dev/null || $(PIP) install jupyterlab
	$(VENV)/bin/jupyter lab

clean:
	rm -rf $(VENV) _build .pytest_cache .ruff_cache
