# One virtual environment for everything; override TORCH_SPEC for a CUDA build, e.g.
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench cov clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

test: install
	$(PY) -m pytest -n 2 -q tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: install
	$(VENV)/bin/accel launch --simulate cuda --num_processes 4 examples/train_regression.py

bench: install
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

cov: install
	$(PY) -m pytest -n 2 -q --cov=accel --cov=harness --cov-report=term-missing tests

clean:
	rm -rf $(VENV) .coverage .coverage.* htmlcov
